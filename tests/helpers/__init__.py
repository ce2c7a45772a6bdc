"""What the tests share: the tiny model, run arguments from keyword overrides, launchers for 1- and 2-rank runs
(through the benchmarks' torchrun command builder) and readers of what a run wrote."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# torch is imported inside the functions that use it: xdist's controller imports this module (tests/conftest.py)
# and runs no test, and importing torch there costs about 1.7 s of CPU.
from fsdp_trainer.files import METRICS_FILE
from fsdp_trainer.launch import child_pids
from tests.helpers import forked

REPO = Path(__file__).resolve().parents[2]
# benchmarks/runner.py under the name the benchmark scripts import it by (their folder is on their path), so that a test
# and a benchmark share one module, not two copies of it.
sys.path.insert(0, str(REPO / "benchmarks"))
from runner import torchrun_command, train_command  # noqa: E402

TINY_MODEL = {
    "family": "llama",
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 128,
    "vocab_size": 512,
    "max_seq_len": 64,
}
TINY_BATCH = {"seq_len": 32, "micro_batch_size": 2}
"""The tiny recipe's micro-batches (tests/conftest.py's tiny_data), which the forkserver's warm-up steps on too."""


def run_args(recipe: str | Path, out_dir: str | Path, steps: int | None = None, **sections: dict) -> list[str]:
    """The trainer's arguments: the recipe, the out_dir, optionally train.steps, and `--section.key value` for each
    override, given per section: run_args(r, out, 6, train={"log_every": 3}, parallel={"sharding": "NO_SHARD"})."""
    args = ["--recipe", str(recipe), "--train.out_dir", str(out_dir)]
    if steps is not None:
        args += ["--train.steps", str(steps)]
    for section, overrides in sections.items():
        for key, value in overrides.items():
            args += [f"--{section}.{key}", _flag_value(value)]
    return args


def _flag_value(value) -> str:
    """A Python value as the command line (YAML) spells it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def train_cli(
    args: list[str],
    nproc: int = 1,
    check: bool = True,
    env: dict | None = None,
    timeout: float = 900,
    torchrun: bool | None = None,
):
    """Run fsdp_trainer.train: in processes forked from one that imported it already (tests/helpers/forked.py), or
    with `torchrun` as `python -m` for one process and torchrun for more (torchrun itself forked, its workers new
    interpreters as it starts them). By default an `env` takes the second way (what it sets may act as an interpreter
    starts: a sitecustomize on its PYTHONPATH, OMP_NUM_THREADS); with torchrun=False the runs are forked with it, its
    PYTHONPATH first on their path (a stand-in package they import)."""
    with_torchrun = torchrun or (torchrun is None and env is not None)
    if with_torchrun and nproc == 1:
        cmd = train_command(args, nproc)
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=full_env, timeout=timeout)
    elif with_torchrun:
        proc = forked.run("torch.distributed.run", torchrun_args(args, nproc), env=env, timeout=timeout)
    else:
        proc = forked.run("fsdp_trainer.train", args, nproc=nproc, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{proc.args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def script(
    path: str | Path, *args, nproc: int = 1, cwd: Path = REPO, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the script at `path` with `args` (in `cwd`, with `env` added to this environment) as `python path ...`
    would, forked (tests/helpers/forked.py), as `nproc` ranks with torchrun's environment when more than one; fails
    the test with its stderr if it fails, unless not `check`."""
    proc = forked.run(str(path), list(map(str, args)), nproc=nproc, cwd=cwd, env=env)
    if check and proc.returncode:
        raise AssertionError(proc.stderr[-3000:])
    return proc


def tool(name: str, *args, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    """Run tools/`name` with `args` as `python tools/name ...` would (`script`)."""
    return script(REPO / "tools" / name, *args, nproc=nproc, check=check)


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The directory `name`, filled by make(directory) once for the whole suite: pytest-xdist's workers share their
    base temporary directory's parent; the first to ask makes it, under a lock any other waits on, and every other
    finds it made. For what tests on either worker read and none changes: prepared data, a run to compare with."""
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent
    root, made = shared / name, shared / f"{name}.made"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        if not made.exists():
            shutil.rmtree(root, ignore_errors=True)  # a make that failed before
            root.mkdir()
            make(root)
            made.touch()
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_args(args: list[str], nproc: int, **launch) -> list[str]:
    """torchrun's arguments (what follows `python -m torch.distributed.run`) to run fsdp_trainer.train with `args` on
    `nproc` processes; `launch`: torchrun_command's nnodes, rdzv_endpoint, flags."""
    return torchrun_command(["-m", "fsdp_trainer.train", *args], nproc, **launch)[3:]


def train_multinode(args: list[str], nnodes: int = 2, nproc_per_node: int = 2, timeout: float = 900) -> list[str]:
    """Launch fsdp_trainer.train as `nnodes` torchrun agents on this machine that meet through c10d rendezvous, the
    way the nodes of a cluster do; returns each agent's output. The agents are forked, and so are the workers they
    start (forked.forked_workers)."""
    endpoint = f"127.0.0.1:{free_port()}"
    argv = torchrun_args(args, nproc_per_node, nnodes=nnodes, rdzv_endpoint=endpoint)
    env = forked.forked_workers()
    with tempfile.TemporaryDirectory() as tmp:
        logs = [os.path.join(tmp, f"{node}.log") for node in range(nnodes)]
        agents = [forked.start("torch.distributed.run", argv, [(log, log)], env, timeout=timeout) for log in logs]
        try:
            for agent in agents:
                agent.wait(timeout)
        finally:
            for agent in agents:
                agent.kill()
        outputs = [Path(log).read_text(errors="replace") for log in logs]
    for agent, out in zip(agents, outputs, strict=True):
        if agent.returncode != 0:
            raise AssertionError(f"torchrun {' '.join(argv)} exited {agent.returncode}:\n{out[-5000:]}")
    return outputs


def read_metrics(out_dir: str | Path) -> list[dict]:
    with open(Path(out_dir) / METRICS_FILE) as f:
        return [json.loads(line) for line in f]


def metrics_by_step(out_dir: str | Path) -> dict[int, dict]:
    """Each step's metrics, its records (training, evaluation, memory) merged."""
    merged: dict[int, dict] = {}
    for record in read_metrics(out_dir):
        merged.setdefault(record["step"], {}).update(record)
    return merged


def rewind(out_dir: Path, step: int) -> None:
    """A finished run put back as if it had stopped at checkpoint `step`: the later checkpoints gone, `latest` naming
    it, its metrics.jsonl moved aside (to metrics.jsonl.straight), so the same command resumes it from there."""
    checkpoints = out_dir / "checkpoints"
    for later in (p for p in checkpoints.glob("step_*") if int(p.name.removeprefix("step_")) > step):
        shutil.rmtree(later)
    (checkpoints / "latest").write_text(f"step_{step:08d}\n")
    (out_dir / METRICS_FILE).rename(out_dir / f"{METRICS_FILE}.straight")


def train_losses(out_dir: str | Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out_dir) if "loss" in r}


def run_distributed(fn, *args, world_size: int = 2) -> None:
    """Run fn(rank, world_size, *args) in world_size gloo processes, forked from tests/helpers/forked.py's server
    (torch and the package imported once, not again in each process: 3-4 s of CPU a rank); any rank's exception
    fails the test. Each process gets this one's environment as it is now."""
    import torch.multiprocessing as mp

    forked.context()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _entry,
            args=(world_size, os.path.join(d, "pg"), fn, args, dict(os.environ)),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )


def _entry(rank: int, world_size: int, init_file: str, fn, args, environ: dict) -> None:
    import torch.distributed as dist

    from fsdp_trainer.distributed.runtime import close_distributed

    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    forked.forget_rank_0s_shardings(rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # A rank whose `fn` makes no collective could otherwise close its connections while a slower peer (a loaded
        # machine) is still making its own to it: gloo's connectFullMesh then fails there, "Connection closed by peer".
        dist.barrier()
    finally:
        close_distributed()


def train_popen(
    args: list[str], log_path: Path, nproc: int = 2, torchrun_flags: tuple[str, ...] = (), env: dict | None = None
) -> forked.Started:
    """Start torchrun in the background (forked; its workers new interpreters, as it starts them), its output going
    to log_path, `env` added to this process's."""
    return forked.start("torch.distributed.run", torchrun_args(args, nproc, flags=torchrun_flags),
                        [(str(log_path), str(log_path))], env)  # fmt: skip


def train_background(
    args: list[str], log_path: Path, nproc: int = 2, env: dict | None = None, target: str = "fsdp_trainer.train"
) -> forked.Started:
    """fsdp_trainer.train (or a script standing in for it, `target`) forked as `nproc` ranks in the background
    (tests/helpers/forked.py), every rank's output in log_path: train_popen without torchrun, for tests of the
    trainer's own behaviour."""
    Path(log_path).write_text("")
    return forked.start(target, args, [(log_path, log_path)] * nproc, env)


def injected(fail: str, rank: int, step: int | None = None, once: Path | None = None) -> dict[str, str]:
    """The environment that makes rank `rank` of a run fail as `fail` says (tests/helpers/inject: raise, exit or kill
    at micro-batch `step`, only once where the file `once` is given; slow), for a run started as a new interpreter."""
    env = {"PYTHONPATH": str(REPO / "tests" / "helpers" / "inject"), "INJECT_RANK": str(rank), "INJECT_FAIL": fail}
    if step is not None:
        env["INJECT_STEP"] = str(step)
    if once is not None:
        env["INJECT_ONCE"] = str(once)
    return env


def wait_for_step(
    out_dir: Path, step: int, proc: subprocess.Popen | forked.Started, log_path: Path, timeout: float = 900
) -> int:
    """Block until metrics.jsonl has logged `step` (returns the newest logged step); fail if the run dies first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run exited {proc.returncode} early:\n{Path(log_path).read_text()[-4000:]}")
        try:
            steps = [json.loads(line)["step"] for line in open(out_dir / METRICS_FILE) if line.endswith("\n")]
        except (FileNotFoundError, json.JSONDecodeError):
            steps = []
        if steps and steps[-1] >= step:
            return steps[-1]
        time.sleep(0.1)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def worker_pids(launcher_pid: int) -> list[int]:
    """The training processes torchrun started (its children running fsdp_trainer.train)."""
    pids = []
    for pid in child_pids(launcher_pid):
        try:
            if b"fsdp_trainer.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            continue  # gone meanwhile
    return pids
