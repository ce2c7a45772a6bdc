"""`fsdp-train`: torchrun for this trainer, which checks the run before it starts any worker and reports as one line.

    fsdp-train --nproc_per_node 2 --recipe recipes/debug.yaml [--section.key value ...] [torchrun's options]

Every torchrun option (`--nproc_per_node`, `--nnodes`, `--rdzv_endpoint`, `--max_restarts`, ...) is taken as torchrun
takes it; every other argument goes to `fsdp_trainer.train`. Before any worker exists, the launcher reads the recipe,
opens the token files and checks the output directory, so bad input is one `error:` line and exit 1 with nothing
spawned. The workers are then started through torch.distributed.run's own API (the rendezvous, restarts and
environment are torchrun's), and what torchrun would print as a stack of tracebacks becomes:

- a worker that fails: the cause first, once the workers have stopped: a worker killed by a signal (the OOM
  killer's SIGKILL, say) or gone without a word, named, else the first worker's own `error:` line (the workers report
  their lines to the launcher, errors.py) and its traceback; then one line for each worker that failed only because
  of it ("rank 0 stopped because rank 1 failed"); without torchrun's ChildFailedError summary; exit 128 + the
  signal's number for a signal, as a shell reports it, else the worker's code;
- SIGTERM (preemption: Slurm, Kubernetes): forwarded to the workers, which save a checkpoint and exit 0, and so does
  the launcher; a second SIGTERM, or SIGINT, stops the workers at once as torchrun does (exit 128 + the signal).

Plain `torchrun -m fsdp_trainer.train` keeps working; it prints torchrun's own summaries around the same lines.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import signal
import sys
import tempfile

from fsdp_trainer.config import fail, one_line_errors, parse_recipe
from fsdp_trainer.errors import REPORTS_ENV

TRAINER_MODULE = "fsdp_trainer.train"


def torchrun_parser():
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's options, the trainer's arguments). An argument is torchrun's when it spells one of torchrun's
    options in full (`--nproc_per_node 2`, `--nproc-per-node=2`; torchrun's own parser would also take prefixes,
    which is how `--start 6` once died in torchrun); its value goes with it."""
    takes_value = {
        option: action.nargs != 0
        for action in torchrun_parser()._actions
        for option in action.option_strings
        if option not in ("-h", "--help")
    }
    launcher, trainer = [], []
    args = iter(argv)
    for arg in args:
        name = arg.split("=", 1)[0]
        if name not in takes_value:
            trainer.append(arg)
            continue
        if name in ("-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path"):
            fail(f"fsdp-train runs {TRAINER_MODULE} itself; drop {name}")
        launcher.append(arg)
        if takes_value[name] and "=" not in arg:
            launcher.append(next(args, ""))
    return launcher, trainer


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is `parent` (Linux's /proc): the workers the elastic agent started."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'.
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    return pids


class ForwardSigterm:
    """SIGTERM to the launcher is a preemption notice (Kubernetes sends it to the container's first process, a
    scheduler to the job's): pass it on to the workers, which save a checkpoint and exit 0, and keep supervising them,
    instead of what torchrun does (raise, and give the workers its shutdown timeout before SIGKILL). A second SIGTERM,
    or one before any worker exists, stops the workers at once through torchrun's path."""

    def __init__(self) -> None:
        self.forwarded = False

    def __call__(self, signum, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        workers = child_pids(os.getpid()) if not self.forwarded and os.path.isdir("/proc") else []
        if not workers:
            raise SignalException(f"Process {os.getpid()} got signal: SIGTERM", sigval=signal.SIGTERM)
        self.forwarded = True
        for pid in workers:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def exit_code_of(exitcode: int) -> int:
    """A worker's exit code as a shell reports it: a death by signal N is 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def failure_line(rank: int, pid: int, exitcode: int) -> str | None:
    """The launcher's own line for a worker that failed, or None when the worker said why itself (it exited with a
    code after printing its `error:` line)."""
    if exitcode >= 0:
        return None
    name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else f"signal {-exitcode}"
    hint = "; the kernel's OOM killer sends it: see `dmesg`" if -exitcode == signal.SIGKILL else ""
    return f"error: rank {rank} (pid {pid}) was killed by {name}{hint}"


def read_reports(reports_dir: str) -> dict[int, dict]:
    """The workers' failure reports (errors.say), by rank."""
    reports = {}
    for name in os.listdir(reports_dir):
        if name.startswith("rank_") and name.endswith(".json"):
            with open(os.path.join(reports_dir, name)) as f:
                report = json.load(f)
            reports[report["rank"]] = report
    return reports


def failure_lines(failures: dict, reports: dict[int, dict]) -> tuple[list[str], int]:
    """(what to print, the cause first; the exit code) from torchrun's failed workers ({rank: ProcessFailure}) and
    their reports. A cause is a rank that died by a signal (not the SIGTERM torchrun stops the others with) or
    exited without a report, or one that reported an error of its own (an error every rank found, once); a rank whose
    collective failed because of another's failure is folded into one line after it."""
    causes: list[tuple[int, int, list[str], int]] = []  # (order, rank, lines, exit code)
    for rank, failure in sorted(failures.items()):
        if rank in reports:
            continue
        if failure.exitcode < 0 and -failure.exitcode != signal.SIGTERM:
            causes.append(
                (0, rank, [failure_line(rank, failure.pid, failure.exitcode)], exit_code_of(failure.exitcode))
            )
        elif failure.exitcode > 0:
            line = (f"error: rank {rank} (pid {failure.pid}) exited with code {failure.exitcode} without an error "
                    "line: its output above says why")  # fmt: skip
            causes.append((0, rank, [line], failure.exitcode))
    own = sorted((r for r in reports.values() if not r["consequential"]), key=lambda r: (r["time"], r["rank"]))
    everyone = [r for r in own if r["everyone"]]
    own = [r for r in own if not r["everyone"]] + ([min(everyone, key=lambda r: r["rank"])] if everyone else [])
    for order, report in enumerate(own, start=1):
        details = report["details"].rstrip().splitlines() if report["details"] else []
        causes.append((order, report["rank"], [report["line"], *details], 1))
    followers = sorted((r for r in reports.values() if r["consequential"]), key=lambda r: (r["time"], r["rank"]))
    if not causes:  # every report follows another rank's failure (a hung rank, say): each said as it came
        return [r["line"] for r in followers], 1
    causes.sort(key=lambda cause: cause[:2])
    first = causes[0][1]
    lines = [line for cause in causes for line in cause[2]]
    lines += [f"rank {r['rank']} stopped because rank {first} failed" for r in followers]
    return lines, causes[0][3]


def quiet_torchrun() -> None:
    """torchrun's agent logs every rendezvous, restart and shutdown, and a failure as a page; the launcher reports
    what matters itself. LOGLEVEL (torchrun's own setting) brings them back. Each of its modules sets its logger's
    level itself, so each is quieted, not their parent."""
    if "LOGLEVEL" in os.environ:
        return
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith(("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")):
            if isinstance(logger, logging.Logger):
                logger.setLevel(logging.CRITICAL)


def name_rendezvous_events_cheaply() -> None:
    """torchrun's rendezvous names each event it records after the method recording it, which it finds by calling
    inspect.stack() twice: that reads the source of every frame on the stack and looks up each one's module among all
    those loaded, 0.1-0.4 s of CPU a call (more modules, more) at each step of the agent's rendezvous, its heartbeats
    and its shutdown (2% of the suite's CPU). The same name, read from the frame."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def method_name(depth: int = 2) -> str:  # inspect.stack()[depth].function: 0 is this frame, as there
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # a stack shallower than that
            return "no_method_name"

    dynamic_rendezvous.get_method_name = method_name


def main(argv: list[str] | None = None) -> None:
    gc.disable()  # importing torch makes about a million objects and no garbage: no collection walks them meanwhile
    argv = sys.argv[1:] if argv is None else argv
    launcher_args, trainer_args = split_argv(argv)  # torchrun's options, from its own parser: imports torch
    if {"-h", "--help"} & set(trainer_args):
        print("fsdp-train [torchrun's options: --nproc_per_node N --nnodes M ...] --recipe R [--section.key value]\n")
    recipe = parse_recipe(trainer_args)  # bad recipe: one line, exit 1; --help prints and exits 0
    from fsdp_trainer.build import check_run, run_summary
    from fsdp_trainer.distributed.runtime import check_groups

    with one_line_errors():  # missing or mismatched data, an unwritable out_dir: one line, nothing spawned
        check_run(recipe)
        summary = run_summary(recipe)

    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args([*launcher_args, "--module", TRAINER_MODULE, *trainer_args])
    low, _, high = str(args.nnodes).partition(":")
    if str(args.nproc_per_node).isdigit() and (high or low) == low:  # the world known before it starts
        with one_line_errors():
            check_groups(recipe.parallel, int(args.nproc_per_node) * int(low))
    nodes = f" on each of {args.nnodes} nodes" if args.nnodes not in ("1", "1:1") else ""
    print(f"starting {args.nproc_per_node} worker(s){nodes}: {summary} -> {recipe.train.out_dir}", flush=True)
    if args.nproc_per_node not in ("auto", "cpu", "gpu", "xpu") and int(args.nproc_per_node) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its warning about it
    quiet_torchrun()
    name_rendezvous_events_cheaply()
    # torchrun's agent turns SIGTERM into an exception (and the workers' shutdown) unless told to leave it to us.
    handled = getattr(args, "signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")
    args.signals_to_handle = os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(
        name for name in handled if name.strip() != "SIGTERM"
    )
    signal.signal(signal.SIGTERM, ForwardSigterm())
    reports = os.environ[REPORTS_ENV] = tempfile.mkdtemp(prefix="fsdp_train_reports_")  # the workers' error lines
    gc.freeze()  # the agent polls its workers for the whole run: what it imported is out of every later collection
    gc.enable()
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        lines, code = failure_lines(e.failures, read_reports(reports))
        print("\n".join(lines), file=sys.stderr, flush=True)
        sys.exit(code)
    except SignalException as e:
        print(f"stopped by {e.sigval.name}: the workers were terminated", file=sys.stderr, flush=True)
        sys.exit(128 + int(e.sigval))
    except Exception as e:  # the rendezvous failed (a node never came, a port taken): torchrun's own errors
        fail(f"launch failed: {type(e).__name__}: {e}")
    finally:
        shutil.rmtree(reports, ignore_errors=True)


if __name__ == "__main__":
    main()
