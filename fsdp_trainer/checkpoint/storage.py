"""DCP storage for checkpoints: the writer that checksums, attaches and publishes a step, the reader that runs no
code, and the facts of the layout (step directories, `latest`, the recipe a checkpoint was saved with)."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from fsdp_trainer.config import load_sections
from fsdp_trainer.files import (
    CONFIG_FILE,
    LATEST_FILE,
    published_step,
    write_atomic,
)
from fsdp_trainer.tokenizer import first_tokenizer

STEP_DIR = re.compile(r"^step_(\d{8})$")
RECIPE_FILE = "recipe.yaml"
"""The recipe a checkpoint was saved with, inside its step directory (beside the tokenizer it was trained with)."""


CHECKSUMS_FILE = "checksums.json"
"""In a step directory: {"algorithm": "crc32", "files": {name: {"bytes": size, "crc32": checksum}}} for every other
file of the step; its presence means the step was written in full."""
_PENDING_CHECKSUM = ".crc32.json"  # beside each rank's file until the coordinator folds it into CHECKSUMS_FILE


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: missing, incomplete, corrupted, foreign, or of another model."""


# --- checksums ------------------------------------------------------------------------------------------------------


def file_checksum(path: Path) -> dict[str, int]:
    """Size and CRC-32 of a file. zlib's CRC-32 runs at about 5 GB/s here, 3x sha256 and 5x blake2b (measured), and
    a checksum against accidents (a bad disk, an interrupted copy) needs no cryptographic strength."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"bytes": size, "crc32": crc}


class NamingFileSystem(FileSystem):
    """DCP's file access, with a failed write raised as the OSError behind it, naming the file: a write that finds the
    disk full raises ENOSPC without a file name, and torch.save's zip writer turns it into "RuntimeError: [enforce fail
    at inline_container.cc:672] . unexpected pos" (the ENOSPC only its context). The message should say which file of
    which rank did not fit, and why."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except Exception as e:
            cause = e
            while cause is not None and not isinstance(cause, OSError):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror, cause.filename or str(path)) from e


class ChecksummedWriter(dcp.FileSystemWriter):
    """DCP's file writer, plus checksums, attachments and publication. Each rank hashes the files it has just written
    (re-read from the page cache) and leaves the result beside them; the coordinator, which runs `finish` only once
    every rank's writes are done, writes `.metadata` and the attachments, folds every checksum into CHECKSUMS_FILE,
    and last points `latest` at the step. For an async save all of this runs in the background thread.
    Whatever fails on whichever rank, DCP raises it on every rank, `latest` included: the ranks never disagree on
    whether a step was saved."""

    def __init__(self, path: str | os.PathLike, attachments: dict[str, bytes], file_per_tensor: bool = False):
        # DCP's writer holds every tensor of a file until the file is written: one file per tensor bounds a save
        # that reads its tensors as it goes (save_model_weights' `read`) by the largest tensor.
        super().__init__(path, single_file_per_rank=not file_per_tensor)
        self.fs = NamingFileSystem()
        self.attachments = attachments

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        future = super().write_data(plan, planner)  # the files are written (and fsynced) when it returns
        for name in sorted({result.storage_data.relative_path for result in future.wait()}):
            pending = Path(self.path) / (name + _PENDING_CHECKSUM)
            write_atomic(pending, json.dumps(file_checksum(Path(self.path) / name)))
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        path = Path(self.path)
        for name, content in self.attachments.items():
            write_atomic(path / name, content)
        files = {}
        for name in sorted({r.storage_data.relative_path for rank_results in results for r in rank_results}):
            pending = path / (name + _PENDING_CHECKSUM)
            files[name] = json.loads(pending.read_text())
            pending.unlink()
        for name in [".metadata", *self.attachments]:
            files[name] = file_checksum(path / name)
        write_atomic(path / CHECKSUMS_FILE, json.dumps({"algorithm": "crc32", "files": files}, indent=1))
        publish_latest(path.parent, path.name)


# --- reading without running code ----------------------------------------------------------------------------------

# What DCP's `.metadata` pickle is made of (torch 2.13, every kind of checkpoint this trainer writes), besides torch's
# dtypes: anything else in it is not DCP metadata, and unpickling it could run code.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """pickle, admitting only the classes DCP's metadata is made of: as torch.load(weights_only=True) does for
    tensors, a foreign `.metadata` (a shared run, a download) cannot name a function for pickle to call."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.path} names {module}.{name}, which a checkpoint's metadata never holds: refused unread, since "
            "unpickling it could run code (this metadata was not written by torch.distributed.checkpoint, or was "
            "altered since); use only checkpoints from sources you trust"
        )


class CheckpointReader(dcp.FileSystemReader):
    """DCP's file reader, with `.metadata` read by _MetadataUnpickler instead of pickle.load. Every read of a
    checkpoint goes through it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, path).load()
            except CheckpointError:
                raise
            except Exception as e:  # truncated or not a pickle at all
                raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e})") from e
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class CheckpointLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, with the non-tensor entries (the step, the data position, the loss scale) first read by
    torch.load(weights_only=True): DCP's default reads them with weights_only=False, which runs any code they name."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)  # plain data only (a few bytes: ints, strings), else UnpicklingError
        value.seek(0)
        super().load_bytes(read_item, value)


def read_metadata(path: Path) -> Metadata:
    """The metadata of a complete DCP directory, read without running code (CheckpointReader)."""
    return CheckpointReader(str(path)).read_metadata()


def first_failure(error: BaseException) -> tuple[int | None, BaseException]:
    """(rank, cause) of a failed DCP call: DCP gathers every rank's exception into one CheckpointException, raised on
    all ranks; anything else is this rank's own (rank None)."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = next(iter(error.failures.items()))
        return rank, cause
    return None, error


def load_state(state: dict[str, Any], path: Path, partial: bool = False, no_dist: bool = False) -> None:
    """dcp.load of `state` from `path` through CheckpointReader and CheckpointLoadPlanner (`partial`: the entries the
    checkpoint lacks keep their values; `no_dist`: in this process alone); a refused or unreadable entry on any rank is
    one CheckpointError naming it."""
    planner = CheckpointLoadPlanner(allow_partial_load=partial)
    try:
        with warnings.catch_warnings():
            if no_dist:  # "torch.distributed is disabled ... assuming ... a single process": intended
                warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=CheckpointReader(str(path)), planner=planner, no_dist=no_dist)
    except CheckpointException as e:
        rank, cause = first_failure(e)
        raise CheckpointError(f"loading {path} failed on rank {rank}: {type(cause).__name__}: {cause}") from e


def is_complete(path: str | os.PathLike) -> bool:
    """A DCP directory is complete once its coordinator wrote `.metadata`, which it does last."""
    return os.path.isfile(os.path.join(path, ".metadata"))


CHECKPOINT_FIELD_HINT = "a run directory or step of ours: tools/import_hf.py writes one from a Hugging Face model"
"""What a recipe field that names a checkpoint takes, said where it names none."""


def resolve_checkpoint(path: str | os.PathLike, field: str | None = None) -> Path:
    """A step directory, or a run / checkpoints directory whose `latest` names one; raises with what is wrong, after
    the recipe `field` the path came from when one is given."""
    path, named = Path(path), f"{field}: " if field else ""
    target = published_step(path)
    if target is not None:
        if not is_complete(target):
            latest = target.parent / LATEST_FILE
            raise CheckpointError(f"{named}{latest} names {target}, which is missing or incomplete (no .metadata)")
        return target
    hint = f" ({CHECKPOINT_FIELD_HINT})" if field else ""
    if not path.is_dir():
        raise CheckpointError(f"{named}checkpoint {path} does not exist{hint}")
    if not is_complete(path):
        raise CheckpointError(f"{named}{path} is not a complete DCP checkpoint (no .metadata); it is truncated or "
                              f"foreign{hint}")  # fmt: skip
    return path


def checkpoint_recipe(path: Path) -> Path:
    """The recipe a checkpoint was saved with: its own recipe.yaml, else its run's config.yaml."""
    for candidate in (path / RECIPE_FILE, path.parent.parent / CONFIG_FILE):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{path} has no {RECIPE_FILE} and no run {CONFIG_FILE} two levels up")


def saved_sections(path: Path) -> dict:
    """A checkpoint's recipe sections (checkpoint_recipe's), parsed once a process (load_sections): the planner asks a
    teacher's or a reward model's size for every row."""
    return load_sections(checkpoint_recipe(path))


def checkpoint_tokenizer(path: Path, tokenizer_path: str | None) -> Path | None:
    """Where the tokenizer a checkpoint was trained with is: its own copy (the step directory), else the recipe's
    data.tokenizer_path, if either exists."""
    return first_tokenizer((path, tokenizer_path))


def publish_latest(ckpt_dir: Path, name: str) -> None:
    """Point `latest` at step directory `name` atomically: readers see the old name or the new one, never half."""
    write_atomic(ckpt_dir / LATEST_FILE, name + "\n")


def saved_entries(path: Path) -> set[str]:
    """The top-level entries (model, optim, data, train) a DCP checkpoint holds."""
    metadata = read_metadata(path).state_dict_metadata
    return {key.split(".", 1)[0] for key in metadata}
