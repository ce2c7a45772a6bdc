"""What a run writes where, and how a file is written so that no reader ever sees half of it.

OUT_DIR/config.yaml      the fully resolved recipe (config.write_config)
OUT_DIR/metrics.jsonl    one JSON object per logged step (metrics.py)
OUT_DIR/tensorboard/     the same scalars as TensorBoard events (metrics.py)
OUT_DIR/checkpoints/     step directories and `latest`, the name of the newest complete one: checkpoint.py writes
                         them; published_step() below is the one reader of `latest` that needs no torch
OUT_DIR/run.lock         locked by the live run's first rank (RunLock), with who it is; empty once a run ended cleanly
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

logger = logging.getLogger("fsdp_trainer")

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
LOCK_FILE = "run.lock"


def write_atomic(path: str | os.PathLike, content: bytes | str, sync: bool = False) -> None:
    """Write `content` to `path` through a temporary file and a rename: readers see the old file or the new one, also
    when the write fails. With `sync`, the file and its directory are on disk when it returns (a power cut too)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
            if sync:
                f.flush()
                os.fsync(f.fileno())
    except OSError as e:  # a full disk: no temp file left behind, and the error names the file
        tmp.unlink(missing_ok=True)
        e.filename = e.filename or str(tmp)
        raise
    os.replace(tmp, path)
    if sync:
        sync_dir(path.parent)


def sync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so the renames into it survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def size_text(n: float) -> str:
    """A byte count as people read it: GB, else MB."""
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def write_failure(error: OSError, where: str | os.PathLike) -> str:
    """What went wrong with a write under directory `where`, for a one-line message: the file (where the error
    names it), the reason, and the room left on that disk (full disk, quota, I/O error)."""
    where = Path(where)
    while not where.exists() and where != where.parent:
        where = where.parent
    free = size_text(shutil.disk_usage(where).free)
    return f"writing {error.filename or where} failed ({error.strerror or error}), {free} free there now"


def published_step(path: str | os.PathLike) -> Path | None:
    """The step directory `latest` names in a checkpoints directory, or in a run directory's checkpoints/; None where
    neither has a `latest`. Whether that step is complete is checkpoint.py's business."""
    path = Path(path)
    for latest in (path / LATEST_FILE, path / CHECKPOINTS_DIR / LATEST_FILE):
        if latest.is_file():
            return latest.parent / latest.read_text().strip()
    return None


def check_writable(out_dir: str, rank: int) -> None:
    """Fail before any collective, naming the directory, if this rank cannot create files in `out_dir` (every rank
    writes checkpoint shards there): a probe file is written, synced and removed."""
    probe = os.path.join(out_dir, f".write_test.rank{rank}")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(bytes(4096))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ValueError(f"train.out_dir={out_dir} is not writable ({e.strerror}); choose another directory") from e
    finally:
        if os.path.exists(probe):
            os.remove(probe)


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --- one live run per directory -------------------------------------------------------------------------------------


class RunDirInUse(ValueError):
    """Another live run holds the lock of this train.out_dir."""


def _holder(record: str) -> str:
    """Who a lock file's record names, for a message."""
    try:
        who = json.loads(record)
        slurm = f", Slurm job {who['slurm_job']}" if who.get("slurm_job") else ""
        return f"pid {who['pid']} on host {who['host']}{slurm}, started {who['started']}"
    except (ValueError, KeyError, TypeError):
        return "a run that left no record of itself"


def _in_use(path: Path, record: str) -> RunDirInUse:
    return RunDirInUse(
        f"train.out_dir={path.parent} is in use by a live run ({_holder(record)}; it holds {path}): two runs in one "
        "directory overwrite each other's checkpoints. Wait for it to end or stop it, or choose another train.out_dir"
    )


def _no_locks(e: OSError) -> bool:
    """The file system offers no locks (some network file systems, Lustre mounted without -o flock)."""
    return e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def check_run_dir_free(out_dir: str | os.PathLike) -> None:
    """Raise RunDirInUse if a live run holds `out_dir`'s lock; touches nothing (a shared lock, taken and dropped).
    fsdp-train calls it before it starts any worker."""
    path = Path(out_dir) / LOCK_FILE
    try:
        with open(path) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _in_use(path, f.read()) from None
            except OSError as e:
                if not _no_locks(e):
                    raise
    except FileNotFoundError:
        pass


class RunLock:
    """One live run per train.out_dir: an advisory lock (flock) on OUT_DIR/run.lock, held by the job's first rank from
    start-up to exit, with the holder's host, pid, Slurm job and start time in the file for the refusal message.

    The kernel releases the lock when its holder dies, however it dies (SIGKILL, the OOM killer, a node that reboots
    releases its network file system locks), so a crash never needs manual clean-up: the next run takes the lock over
    and says whose record it found. A torchrun restart or a resumed preempted job takes it again the same way.
    """

    def __init__(self, out_dir: str | os.PathLike):
        self.path = Path(out_dir) / LOCK_FILE
        self._file = None

    def acquire(self, wait_s: float = 2.0) -> None:
        """Take the lock, or raise RunDirInUse naming the holder. `wait_s` covers another job's check_run_dir_free,
        whose shared lock lasts microseconds; a live run's lock is never released while it trains."""
        f = open(self.path, "a+")  # "a+", not "w": the holder's record stays until the lock is ours
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _same_file(f, self.path):
                    break
                f.close()  # its holder removed it as it released it (a run that wrote nothing): take the new one
                f = open(self.path, "a+")
            except BlockingIOError:
                if time.monotonic() > deadline:
                    f.seek(0)
                    error = _in_use(self.path, f.read())
                    f.close()
                    raise error from None
                time.sleep(0.05)
            except OSError as e:
                f.close()
                if not _no_locks(e):
                    raise
                logger.warning(
                    f"{self.path.parent}'s file system offers no file locks: nothing stops a second run there"
                )
                return
        f.seek(0)
        previous = f.read()
        if previous:  # a holder that died without release(): killed, or its node lost
            logger.info(f"taking over {self.path} from a run that ended without releasing it ({_holder(previous)})")
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        f.seek(0)
        f.truncate()
        f.write(json.dumps(record) + "\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        """Empty the record (a clean end) and drop the lock. The file stays, for the next run of the directory; of a
        run that wrote nothing there (refused as it started) it goes, with the directory if that is left empty: the
        next run checks that the file it locked is still the one at the path (acquire)."""
        if self._file is None:
            return
        self._file.truncate(0)
        run_dir = self.path.parent
        if not (run_dir / CONFIG_FILE).exists() and not (run_dir / CHECKPOINTS_DIR).exists():
            self.path.unlink(missing_ok=True)  # still locked: no run can take it before it is gone
            try:
                run_dir.rmdir()
            except OSError:  # the user's files, or another run's
                pass
        self._file.close()  # closing drops the flock
        self._file = None


def _same_file(f, path: Path) -> bool:
    """Whether the open file `f` is still the file at `path` (not removed or replaced since it was opened)."""
    try:
        return os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False
