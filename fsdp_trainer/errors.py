"""How a run says it failed: one `error:` line per node, the cause first.

Under fsdp-train (launch.py) a worker does not print its error line: it writes a report (the line, whether every
rank finds the same error, whether it only follows another rank's failure, and when) into the directory the launcher
names in FSDP_TRAIN_REPORTS. Once the workers have stopped, the launcher prints the cause first (a rank killed by a
signal or gone without a word, else the first rank that failed on its own), then one line for each rank that failed
because of it. Under plain torchrun the first rank of a node to fail claims the node's line (a file created
exclusively in the directory torchrun keeps for the node's workers), so that a line is printed whichever rank exits
first and torchrun stops the others.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

REPORTS_ENV = "FSDP_TRAIN_REPORTS"
"""The directory fsdp-train gives its workers for their failure reports."""

PEER_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "imed out")  # Timed, timed
"""What a collective says when it fails because another rank died or hangs (gloo and NCCL)."""


def follows_a_peer(error: BaseException) -> bool:
    """Whether an exception only says that a collective failed: another rank died, exited or hangs."""
    import torch.distributed as dist

    return isinstance(error, dist.DistError) or any(text in str(error) for text in PEER_FAILURES)


def say(line: str, everyone: bool = False, consequential: bool = False, details: str = "") -> bool:
    """Say a worker's `error:` line: to the launcher's reports under fsdp-train (returns True: the launcher prints
    it, and `details`, a traceback, after it), else printed. `everyone`: every rank finds this error (a bad recipe, a
    checkpoint of another shape): one line for all, printed once per node; `consequential`: it only follows another
    rank's failure."""
    reports = os.environ.get(REPORTS_ENV)
    rank = int(os.environ.get("RANK", "0"))
    if reports and "LOCAL_RANK" in os.environ and os.path.isdir(reports):  # a worker of fsdp-train
        report = {"rank": rank, "line": line, "everyone": everyone, "consequential": consequential,
                  "details": details, "time": time.time()}  # fmt: skip
        path = os.path.join(reports, f"rank_{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(path + ".tmp", path)  # the launcher reads whole reports only
        return True
    if not everyone or claim_node_line():
        print(line, file=sys.stderr, flush=True)
    return False


def claim_node_line() -> bool:
    """Whether this process is the first of its node's torchrun workers to claim the node's error line (always, in a
    process of its own). The claim is a file created exclusively in the directory torchrun keeps for this attempt of
    the node's workers (their error.json files are in it), so a restart claims anew and nothing is left elsewhere."""
    if "LOCAL_RANK" not in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ:
        return True
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # <log dir>/<run>/attempt_<n>/<local rank>/error.json
    if error_file:
        path = os.path.join(os.path.dirname(os.path.dirname(error_file)), "fsdp_trainer_error_line")
    else:  # torchrun --log-dir /dev/null keeps no directory: a file named after the agent and its start time
        agent = os.getppid()
        try:
            with open(f"/proc/{agent}/stat") as f:
                started = f.read().rsplit(")", 1)[1].split()[19]
        except (OSError, IndexError):
            started = "0"
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        path = os.path.join(tempfile.gettempdir(), f"fsdp_trainer_error_{agent}_{started}_{restart}")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
