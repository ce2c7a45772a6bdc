"""The tests' runs of the trainer and the tools without a new interpreter each.

`python -m fsdp_trainer.train` spends about 3 s of CPU importing torch and the package before it does anything, and
the suite starts a few hundred of them. Here a forkserver process imports them once (one for both of `make test`'s
pytest workers: SHARED), and each run is a process forked from it that runs the module or script as `python -m` /
`python script.py` would (runpy, as `__main__`, with its own argv, environment, working directory and output files). A
run of several ranks is that many such processes meeting over TCP in a real gloo process group, with the environment
torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), but no torchrun. Tests of
torchrun's own behaviour (its restarts, the one error line a node prints, fsdp-train, nodes meeting through rendezvous)
fork torchrun or the launcher as such a run, and its workers are new interpreters, as torchrun starts them, unless the
test gives the agent forked_workers() (STAND_IN, tests/helpers/forked_python.py).
"""

from __future__ import annotations

import io
import itertools
import multiprocessing
import os
import resource
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing import forkserver, resource_tracker
from pathlib import Path

# torch is imported inside the functions that use it: xdist's controller imports this module (tests/conftest.py)
# and runs no test, and importing torch there costs about 1.7 s of CPU.

REPO = Path(__file__).resolve().parents[2]
PRELOAD = ["tests.helpers.preloaded"]
_context = None


SHARED = "FSDP_TRAINER_TESTS_FORKSERVER"
"""Where the forkserver is that the xdist controller started (tests/conftest.py) for both workers' runs: one preload
(about 6 s of CPU) instead of one a worker. Without xdist, or under the cost plugin (tests/helpers/cost.py, which
counts a test's runs in its worker's process tree), each process starts its own."""


def start_server() -> str:
    """Start this process's forkserver with the preloaded modules and one OpenMP thread (the runs' own setting, which
    torch reads when it is imported); returns its address. It lives as long as this process. Imports no torch: the
    xdist controller, which runs no test, calls it."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return forkserver._forkserver._forkserver_address


def _use_server(address: str) -> None:
    """Fork this process's runs from the forkserver at `address`, which another process started and keeps. A request
    hands the server this process's resource tracker and the write end of the pipe whose closing stops the server,
    which a forked child keeps to fork from it in turn (none of ours does): /dev/null stands for the pipe, and the
    server is not this process's child to wait for."""
    server = forkserver._forkserver
    server._forkserver_address = address
    server._forkserver_alive_fd = os.open(os.devnull, os.O_WRONLY)
    server.ensure_running = resource_tracker.ensure_running


def context():
    """The forkserver context: the shared server if there is one (SHARED), else this process's own, started on first
    use."""
    global _context
    if _context is None:
        if os.environ.get(SHARED):
            _use_server(os.environ[SHARED])
        else:
            start_server()
        _context = multiprocessing.get_context("forkserver")
    return _context


def exit_code(code) -> int:
    """What the interpreter would exit with for SystemExit(code): a message is printed and exits 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def forget_rank_0s_shardings(rank: int) -> None:
    """In a forked process of any rank but 0: forget the shardings DTensor's C++ dispatch cached in the forkserver,
    which holds rank 0's own for two ranks (tests/helpers/preloaded.py)."""
    if rank != 0:
        import torch

        torch._C._clear_DTensor_sharding_propagator_cache()


class _Inherited:
    """A file descriptor of this process that a forked child gets as its own (multiprocessing sends it to the
    forkserver as the child starts): the same open file, its offset shared with this process's other writers."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _received, (reduction.DupFd(self.fd),)


def _received(dup) -> int:
    return dup.detach()


def _run(
    target: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    out: str | int,
    err: str | int,
    file_size_limit: int | None,
) -> None:
    """In the forked child: `target` (a module name, or a script's path) as __main__, its output into files (appended
    to: the ranks of a run started in the background share one log) or onto descriptors (`_Inherited`), every file it
    writes capped at `file_size_limit` bytes if given (EFBIG past it, as ENOSPC on a full disk)."""
    if file_size_limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.RLIM_INFINITY))
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # What a new interpreter reads from its environment as it imports inductor, which the forkserver did with the
    # suite's (conftest.py: scalar kernels): a run given its own settings (flex_attention's CPU kernels need vectors).
    from torch._inductor import config as inductor_config  # preloaded
    from torch.utils._config_module import get_tristate_env  # how inductor's config reads it

    inductor_config.cpp.vec_isa_ok = get_tristate_env("TORCHINDUCTOR_VEC_ISA_OK")
    inductor_config.cpp_cache_precompile_headers = os.environ.get("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS") != "0"
    forget_rank_0s_shardings(int(env.get("RANK", "0")))
    for fd, path in ((1, out), (2, err)):
        opened = path if isinstance(path, int) else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    if env.get("PYTHONUNBUFFERED"):  # as `python -u` (torchrun's workers) writes: each write at once
        sys.stdout, sys.stderr = (
            io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=stream.encoding, errors=stream.errors,
                             write_through=True)
            for fd, stream in ((1, sys.stdout), (2, sys.stderr))
        )  # fmt: skip
    # Where a new interpreter would put them, after the script's folder: for what the run imports, not what is
    # preloaded (nor a sitecustomize, which only an interpreter's start runs).
    sys.path[1:1] = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    # runpy runs a preloaded module again as __main__, as `python -m` does after a package import: no news.
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    code = 0
    try:
        if target.endswith(".py"):
            sys.argv = [target, *argv]
            sys.path[0] = str(Path(target).parent)
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = [target, *argv]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = exit_code(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(
    target: str,
    argv: list[str],
    nproc: int = 1,
    env: dict | None = None,
    cwd: Path = REPO,
    timeout: float = 900,
    file_size_limit: int | None = None,
) -> subprocess.CompletedProcess:
    """Run `target` (module or script) with `argv` in `nproc` forked processes (ranks 0..nproc-1 of one node when
    more than one); returns what subprocess.run would: exit code 1 if any rank failed (the others then get SIGTERM,
    as torchrun sends them), the ranks' stdout and stderr one after the other. `file_size_limit`: as `_run`'s."""
    with tempfile.TemporaryDirectory() as tmp:
        files = [(os.path.join(tmp, f"{r}.out"), os.path.join(tmp, f"{r}.err")) for r in range(nproc)]
        started = start(target, argv, files, env, cwd, timeout, file_size_limit)
        started.wait(timeout)
        stdout = "".join(Path(out).read_text(errors="replace") for out, _ in files)
        stderr = "".join(Path(err).read_text(errors="replace") for _, err in files)
    return subprocess.CompletedProcess(started.args, started.returncode, stdout, stderr)


class Started:
    """The ranks of a run forked in the background (`start`), with what the tests use of a subprocess.Popen: poll,
    wait, send_signal (to every rank, as torchrun forwards it), returncode (a single process's own, as Popen's: -N
    for a death by signal N; 1 if any of several ranks failed); and `pids`."""

    def __init__(self, args: list[str], procs: list, store) -> None:
        self.args, self.procs, self._store = args, procs, store
        self.pids = [p.pid for p in procs]
        self._stopping = None

    @property
    def returncode(self) -> int | None:
        if any(p.exitcode is None for p in self.procs):
            return None
        if len(self.procs) == 1:
            return self.procs[0].exitcode
        return 0 if all(p.exitcode == 0 for p in self.procs) else 1

    def poll(self) -> int | None:
        """The exit code once every rank has exited; once one has failed, the others get SIGTERM (SIGKILL after 30 s),
        as torchrun stops a failed run's workers."""
        if any(p.exitcode not in (None, 0) for p in self.procs) and self._stopping is None:
            self._stopping = time.monotonic()
            for p in self.procs:
                if p.exitcode is None:
                    p.terminate()
        if self._stopping is not None and time.monotonic() - self._stopping > 30:
            for p in self.procs:
                if p.exitcode is None:
                    p.kill()
        if self.returncode is not None:
            for p in self.procs:
                p.join()
            self._store = None
        return self.returncode

    def wait(self, timeout: float = 900) -> int:
        """The exit code once every rank has exited; all are killed at `timeout`."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                for p in self.procs:
                    p.kill()
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        for p in self.procs:
            if p.exitcode is None:
                os.kill(p.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(
    target: str,
    argv: list[str],
    files: list[tuple[str | int, str | int]],
    env: dict | None = None,
    cwd: Path = REPO,
    timeout: float = 900,
    file_size_limit: int | None = None,
) -> Started:
    """`target` (module or script) with `argv` forked as len(files) ranks of one node, started in the background;
    rank r's stdout and stderr are appended to files[r] (one path twice, or the same pair for every rank, for one
    log), or written to this process's descriptors where files[r] names them; the ranks' store waits up to `timeout`
    for a key; `file_size_limit` caps every file a rank writes (`_run`)."""
    server = context()
    nproc = len(files)
    base = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    store = None
    if nproc > 1:
        import torch.distributed as dist

        # The ranks meet in a store this process holds, bound to a port the kernel picks, as torchrun's agent does: a
        # port found free and then handed over could be taken by another test's gloo connection in between.
        store = dist.TCPStore(
            "127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
        ranks = [
            {**base, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
             "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
             "TORCHELASTIC_USE_AGENT_STORE": "True"}
            for r in range(nproc)
        ]  # fmt: skip
    else:
        ranks = [base]
    procs = [
        server.Process(
            target=_run,
            args=(target, list(map(str, argv)), environ, str(cwd), *map(_file, paths), file_size_limit),
        )
        for environ, paths in zip(ranks, files, strict=True)
    ]
    for p in procs:
        p.start()
    return Started([target, *map(str, argv)], procs, store)


def _file(path: str | int):
    return _Inherited(path) if isinstance(path, int) else str(path)


STAND_IN = REPO / "tests" / "helpers" / "python"
"""`python` that forks what it runs from this process's forkserver (forked_python.py), in the environment
stand_in_env() gives: torchrun's workers where its agent has PYTHON_EXEC set to it."""


def stand_in_env() -> dict[str, str]:
    """The environment STAND_IN needs: this interpreter, and the forkserver this process forks its runs from (started
    if it has none yet)."""
    context()
    return {"FSDP_TRAINER_TESTS_PYTHON": sys.executable, SHARED: forkserver._forkserver._forkserver_address}


def forked_workers() -> dict[str, str]:
    """The environment of a torchrun agent whose workers are forked (STAND_IN as its PYTHON_EXEC) rather than new
    interpreters (2-2.5 s of CPU a worker spends importing torch and the package): for runs under torchrun whose
    test is not about the workers' processes themselves (their pids) and injects no failure (a sitecustomize runs as
    an interpreter starts)."""
    return {"PYTHON_EXEC": str(STAND_IN), **stand_in_env()}


def run_command(cmd: list[str], env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """`run` for a command line as benchmarks/runner.py builds it: `python -m torch.distributed.run --standalone
    --nproc_per_node=N` then `-m module args` or `script args`, or `python` with either; the same target and
    arguments run forked, as N ranks under torchrun's environment."""
    python, *rest = cmd
    nproc = 1
    if rest[:2] == ["-m", "torch.distributed.run"]:
        rest = rest[2:]
        flags = list(itertools.takewhile(lambda arg: arg.startswith("--"), rest))
        rest = rest[len(flags) :]
        if any(flag != "--standalone" and not flag.startswith("--nproc_per_node=") for flag in flags):
            raise ValueError(f"torchrun flags a forked run does not reproduce: {flags}")
        nproc = next(int(flag.split("=")[1]) for flag in flags if flag.startswith("--nproc_per_node="))
    return run(*python_target(rest), nproc=nproc, env=env, timeout=timeout)


def python_target(args: list[str]) -> tuple[str, list[str]]:
    """What `python ARGS` runs, as `run` and `start` take it: (`-m`'s module or the script, their arguments)."""
    return (args[1], args[2:]) if args[0] == "-m" else (args[0], args[1:])
