"""Imported at start-up by every Python process whose PYTHONPATH holds this folder, to make one worker of a run fail
as a test asks, whatever launches it:

- INJECT_RANK: the rank (torchrun's RANK) that fails; every other process is left alone;
- INJECT_FAIL: `raise` (a RuntimeError), `exit` (os._exit(3), as a crash in native code would) or `kill` (SIGKILL,
  as the kernel's OOM killer would) at the INJECT_STEP-th micro-batch of next-token training; or `slow`: sleep
  INJECT_SLEEP seconds before anything runs;
- INJECT_ONCE: a file made when the failure is injected; a process that finds it there is left alone (the workers
  torchrun restarts after it).
"""

import os
import signal
import time
from pathlib import Path

once = Path(os.environ["INJECT_ONCE"]) if os.environ.get("INJECT_ONCE") else None
if os.environ.get("INJECT_RANK") is not None and os.environ.get("RANK") == os.environ["INJECT_RANK"]:
    how = os.environ["INJECT_FAIL"]
    if how == "slow":
        time.sleep(float(os.environ.get("INJECT_SLEEP", "5")))
    else:
        from fsdp_trainer.steps.next_token import NextTokenStep

        original, calls = NextTokenStep.sums, [0]

        def sums(self, model, batch):
            calls[0] += 1
            if calls[0] == int(os.environ.get("INJECT_STEP", "3")) and not (once and once.exists()):
                if once:
                    once.touch()
                if how == "exit":
                    os._exit(3)
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected failure")
            return original(self, model, batch)

        NextTokenStep.sums = sums
