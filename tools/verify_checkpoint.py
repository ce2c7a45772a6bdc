"""Check checkpoints against the checksums saved with them, without a GPU or a process group.

    python tools/verify_checkpoint.py runs/1b                                  # every step of a run
    python tools/verify_checkpoint.py runs/1b/checkpoints/step_00001000        # one step

For checkpoints copied between clusters or kept on a doubtful disk: every file of each step is read and compared with
the size and CRC-32 in its checksums.json, and its `.metadata` read without running code. Prints a line per step (ok,
unverified: saved before checksums existed, incomplete, refused: its metadata names code to run, or corrupted with the
file named), the runs that depend on it (their holds keep it from rotation: fsdp_trainer/checkpoint/holds.py) and which
step `latest` names; exits 1 if any step is corrupted, incomplete or refused, 0 otherwise.

    python tools/verify_checkpoint.py runs/sft --release runs/dpo     # runs/dpo is done with runs/sft's checkpoints
    python tools/verify_checkpoint.py runs/sft --release stale        # every holder whose directory is gone
"""

from __future__ import annotations

import sys
import time

from jsonargparse import ArgumentParser

from fsdp_trainer.checkpoint.holds import STALE, release, step_holds
from fsdp_trainer.checkpoint.verify import checkpoint_status, checkpoint_steps
from fsdp_trainer.config import one_line_errors
from fsdp_trainer.files import published_step


def main(argv: list[str] | None = None) -> None:
    description = __doc__.split("\n\n")[0]
    parser = ArgumentParser(prog="tools/verify_checkpoint.py", description=description, exit_on_error=False)
    parser.add_argument("path", help="a step_NNNNNNNN directory, a checkpoints/ directory or a run directory")
    parser.add_argument(
        "--release",
        default=None,
        help=f"release the holds of this run directory (`{STALE}`: of every holder that is gone; `PID@HOST`: of a tool "
        "reading them, as listed) on the checkpoints "
        "of `path`, so that its keep_last may delete them at its next save; verifies nothing",
    )
    with one_line_errors():
        args = parser.parse_args(argv)
        steps = checkpoint_steps(args.path)
        if args.release is not None:
            released = release(steps[-1].parent, args.release)
            for held in released:
                print(f"{held.step.name}  released: {held.describe()}")
            if not released:
                print(f"no hold of {args.release} on {steps[-1].parent}")
            return
    bad = 0
    for step in steps:
        start = time.perf_counter()
        status, detail = checkpoint_status(step)
        bad += status in ("corrupted", "incomplete", "refused")
        print(f"{step.name}  {status:<10}  {detail} ({time.perf_counter() - start:.2f} s)", flush=True)
        for held in step_holds(step):
            print(f"{step.name}  held by {held.describe()}")
    latest = published_step(steps[-1].parent)
    if latest is not None:
        print(f"latest -> {latest.name}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
