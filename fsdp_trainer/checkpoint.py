"""Sharded checkpoints of the whole training state through torch.distributed.checkpoint (DCP).

Layout (this module is the only one that knows it):

    OUT_DIR/checkpoints/step_00000100/   a DCP directory: one file per rank plus `.metadata`; the attachments
                                         (recipe.yaml, the tokenizer's files: tokenizer.model or tokenizer.json +
                                         tokenizer_config.json) that make it self-describing; and checksums.json, the
                                         size and CRC-32 of every other file, written last
    OUT_DIR/checkpoints/latest           text: the name of the newest complete step directory

A weights-only checkpoint (`import_hf`) holds just the `model` entry; loading it starts a fresh optimizer,
data stream and step count.

A step directory counts only once `.metadata` exists and `latest` names it; `latest` is replaced atomically
(temp file + os.replace) after every rank has finished writing, so a crash at any instant leaves `latest` naming a
complete checkpoint. Retention deletes only published steps older than the newest `keep_last`. A save that fails on
any rank (a full disk) fails on every rank at the same step; its partial directory is removed, and the run stops or
goes on as `checkpoint.on_save_error` says.

Reading runs no code: DCP unpickles `.metadata` and the non-tensor entries, which a checkpoint from elsewhere could
fill with any callable; CheckpointReader and CheckpointLoadPlanner admit only what DCP's own files are made of.

Checksums: each rank hashes the files it wrote (in the background thread for async saves), and the coordinator folds
them into checksums.json before `latest` may name the step. Every file is verified before it is trusted: on resume
(the files split over the ranks), by consolidation and the inference loader, and by tools/verify_checkpoint.py. With
`resume: auto` a checkpoint that fails falls back to the newest older one that verifies; one saved before checksums
existed loads with a notice that it is unverified.

The Checkpointer decides when to save: every `checkpoint.every` steps, after the last step, and at once when SIGTERM
reaches any rank (preemption), whatever `every` says.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import shutil
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from fsdp_trainer.adapters.lora import apply_lora, is_adapter
from fsdp_trainer.adapters.nf4 import fill_shard, is_nf4, quantized_weights
from fsdp_trainer.config import AUTO, Recipe, load_sections, recipe_to_yaml
from fsdp_trainer.distributed.runtime import DistEnv, PreemptionFlag
from fsdp_trainer.files import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LATEST_FILE,
    file_sha256,
    published_step,
    write_atomic,
    write_failure,
)
from fsdp_trainer.model import Transformer
from fsdp_trainer.optim import MASTER_WEIGHT_BYTES, optimizer_state_bytes
from fsdp_trainer.tokenizer import HF_GENERATION_CONFIG, first_tokenizer, tokenizer_files

logger = logging.getLogger("fsdp_trainer")

_STEP_DIR = re.compile(r"^step_(\d{8})$")
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


def file_problem(path: Path, name: str, expected: dict[str, int]) -> str | None:
    """What is wrong with one file of a checkpoint against its entry in CHECKSUMS_FILE, or None."""
    file = path / name
    if not file.is_file():
        return f"{file} is missing"
    size = file.stat().st_size
    if size != expected["bytes"]:
        return f"{file} holds {size} bytes, not the {expected['bytes']} it was saved with (truncated or overwritten)"
    if file_checksum(file)["crc32"] != expected["crc32"]:
        return f"{file} does not match its checksum: its bytes changed after it was saved (a bad disk or copy)"
    return None


def verify_checkpoint(path: Path, rank: int = 0, world_size: int = 1) -> list[str] | None:
    """The problems of the files of a step directory (the share of `rank` when the ranks split the work: every
    world_size-th file from the largest down, so N ranks' N shards are read one per rank); [] when they all match,
    None when it has no checksums."""
    manifest = path / CHECKSUMS_FILE
    if not manifest.is_file():
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return [f"{manifest} is unreadable ({type(e).__name__}: {e})"]
    names = sorted(files, key=lambda name: (-files[name]["bytes"], name))[rank::world_size]
    return [problem for name in names if (problem := file_problem(path, name, files[name])) is not None]


def checkpoint_steps(path: str | os.PathLike) -> list[Path]:
    """The step directories of a run directory or of its checkpoints/ directory, oldest first, or [path] itself."""
    path = Path(path)
    if _STEP_DIR.match(path.name) or is_complete(path):
        return [path]
    for folder in (path / CHECKPOINTS_DIR, path):
        steps = sorted(p for p in folder.iterdir() if _STEP_DIR.match(p.name)) if folder.is_dir() else []
        if steps:
            return steps
    raise CheckpointError(f"{path} holds no checkpoint: no step_* directories and no .metadata")


def checkpoint_status(path: Path) -> tuple[str, str]:
    """(status, detail) of one step directory: ok, unverified (saved before checksums), incomplete, refused (its
    metadata names code to run) or corrupted."""
    if not is_complete(path):
        return "incomplete", "no .metadata: its save never finished, or it was cut short"
    problems = verify_checkpoint(path)
    if problems:
        return "corrupted", "; ".join(problems)
    try:
        read_metadata(path)  # checksums cannot vouch for it: whoever wrote a foreign .metadata wrote them too
    except CheckpointError as e:
        return "refused", str(e)
    if problems is None:
        return "unverified", f"no {CHECKSUMS_FILE} (saved before checksums existed)"
    files = json.loads((path / CHECKSUMS_FILE).read_text())["files"]
    return "ok", f"{len(files)} files, {sum(f['bytes'] for f in files.values()) / 1e6:,.1f} MB"


def _accepted(path: Path, problems: list[str] | None, warn: bool = True) -> Path:
    """`path`, given what verify_checkpoint found: nothing, or no checksums (a warning says it is unverified, if
    `warn`: on rank 0 only); else CheckpointError naming the first file that fails."""
    if problems is None and warn:
        logger.warning(f"{path} has no {CHECKSUMS_FILE} (saved before checksums existed): loading it unverified")
    elif problems:
        raise CheckpointError(f"checkpoint {path} is corrupted: {problems[0]}")
    return path


def verified_checkpoint(path: str | os.PathLike) -> Path:
    """resolve_checkpoint, then every file checked against its checksum (see _accepted)."""
    path = resolve_checkpoint(path)
    return _accepted(path, verify_checkpoint(path))


class ModelState(Stateful):
    """The model's (sharded) weights under their HF names, whatever wrappers the model carries; with `adapters_only`
    (a LoRA run), its adapters alone: the frozen weights are the base's, recorded in LORA_BASE_FILE, not saved again."""

    def __init__(self, model: nn.Module, adapters_only: bool = False):
        self.model, self.adapters_only = model, adapters_only

    def state_dict(self) -> dict[str, Any]:
        state = get_model_state_dict(self.model)
        if self.adapters_only:
            return {name: t for name, t in state.items() if is_adapter(name)}
        # NF4 weights (QLoRA) are never saved and not loaded by DCP: Checkpointer._load_base quantizes them
        return {name: t for name, t in state.items() if not is_nf4(t)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        strict = not self.adapters_only and not any(is_nf4(p) for p in self.model.parameters())
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=strict))


LORA_BASE_FILE = "lora_base.json"
"""In a LoRA run's step directory: the model its adapters apply to, {"path": a weights-only checkpoint, or null for
the recipe's seeded init; "fingerprint": sha256 of that checkpoint's checksums.json}."""


def base_fingerprint(path: Path) -> str:
    """What identifies a weights-only checkpoint's values: the sha256 of its checksums.json (the size and CRC-32 of
    every file), or of its .metadata where it has none."""
    manifest = path / CHECKSUMS_FILE
    return file_sha256(manifest if manifest.is_file() else path / ".metadata")


def lora_base(ckpt: Path) -> Path | None:
    """The base model a LoRA checkpoint's adapters apply to (None: the recipe's seeded init), checked against the
    fingerprint recorded when the run started; CheckpointError naming both if it is gone or changed."""
    return _recorded_start(ckpt, LORA_BASE_FILE, "adapters apply to", "it is not a LoRA checkpoint of this trainer")


REFERENCE_FILE = "reference.json"
"""In a full fine-tuning preference run's step directory: the weights its frozen reference model holds, the model the
run started from, recorded as LORA_BASE_FILE records a base."""


def preference_reference(ckpt: Path) -> Path | None:
    """The checkpoint a preference run's reference was loaded from (None: the recipe's seeded init), checked as
    lora_base checks a base."""
    return _recorded_start(ckpt, REFERENCE_FILE, "reference model is", "it is not a preference run's checkpoint")


def _recorded_start(ckpt: Path, record_file: str, what: str, foreign: str) -> Path | None:
    if not (ckpt / record_file).is_file():
        raise CheckpointError(f"{ckpt} has no {record_file}: {foreign}")
    record = json.loads((ckpt / record_file).read_text())
    if record["path"] is None:
        return None
    base = Path(record["path"])
    if not is_complete(base):
        raise CheckpointError(f"{ckpt}'s {what} {base}, which is gone; put that checkpoint back")
    fingerprint = base_fingerprint(base)
    if fingerprint != record["fingerprint"]:
        raise CheckpointError(
            f"{ckpt}'s {what} {base} as it was when the run started, and its weights have changed since (fingerprint "
            f"{fingerprint[:12]}, recorded {record['fingerprint'][:12]}); put the original back"
        )
    return base


def _start_record(path: Path | None) -> bytes:
    return json.dumps({"path": None, "fingerprint": None} if path is None else {
        "path": str(path.resolve()), "fingerprint": base_fingerprint(path)
    }).encode()  # fmt: skip


class OptimState(Stateful):
    """The optimizer's state (AdamW's moments and step counts, Muon's momentum), keyed by parameter name so it
    reshards to another world size."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def is_complete(path: str | os.PathLike) -> bool:
    """A DCP directory is complete once its coordinator wrote `.metadata`, which it does last."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step directory, or a run / checkpoints directory whose `latest` names one; raises with what is wrong."""
    path = Path(path)
    target = published_step(path)
    if target is not None:
        if not is_complete(target):
            latest = target.parent / LATEST_FILE
            raise CheckpointError(f"{latest} names {target}, which is missing or incomplete (no .metadata)")
        return target
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete DCP checkpoint (no .metadata); it is truncated or foreign")
    return path


def check_model_shapes(path: Path, model_state: dict[str, Any], adapters_optional: bool = False) -> None:
    """Refuse a checkpoint of another model before DCP fails deep inside with a shape error. With
    `adapters_optional`, a checkpoint without the model's LoRA adapters (its base model) passes."""
    metadata = read_metadata(path).state_dict_metadata
    for name, tensor in model_state.items():
        key = f"model.{name}"
        saved = metadata.get(key)
        if saved is None and adapters_optional and is_adapter(name):
            continue
        if saved is None:
            raise CheckpointError(f"checkpoint {path} has no tensor {name}: it was saved from another model")
        if isinstance(saved, TensorStorageMetadata) and tuple(saved.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint {path} holds {name} of shape {tuple(saved.size)} but the recipe's model has "
                f"{tuple(tensor.shape)}: the recipe's model section differs from the run that saved it"
            )


def checkpoint_recipe(path: Path) -> Path:
    """The recipe a checkpoint was saved with: its own recipe.yaml, else its run's config.yaml."""
    for candidate in (path / RECIPE_FILE, path.parent.parent / CONFIG_FILE):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{path} has no {RECIPE_FILE} and no run {CONFIG_FILE} two levels up")


def checkpoint_tokenizer(path: Path, tokenizer_path: str | None) -> Path | None:
    """Where the tokenizer a checkpoint was trained with is: its own copy (the step directory), else the recipe's
    data.tokenizer_path, if either exists."""
    return first_tokenizer((path, tokenizer_path))


def check_disk_room(recipe: Recipe) -> None:
    """Fail before any collective, naming the directory, if its disk lacks room for one checkpoint of the recipe's
    model: fp32 weights and the optimizer's state, as the planner counts it (gradients are not saved)."""
    out_dir = recipe.train.out_dir
    with torch.device("meta"):
        model = Transformer(recipe.model)
        if recipe.lora.rank is not None:  # its checkpoints hold the adapters and their state only
            apply_lora(model, recipe.lora)
    saved = sum(p.numel() for p in model.parameters() if p.requires_grad)
    need = MASTER_WEIGHT_BYTES * saved + optimizer_state_bytes(recipe.optim, model)
    free = shutil.disk_usage(out_dir).free
    if free < need:
        raise ValueError(
            f"train.out_dir={out_dir} has {free / 1e9:.1f} GB free, and one checkpoint of this model takes "
            f"{need / 1e9:.1f} GB; free space or choose another directory"
        )


def publish_latest(ckpt_dir: Path, name: str) -> None:
    """Point `latest` at step directory `name` atomically: readers see the old name or the new one, never half."""
    write_atomic(ckpt_dir / LATEST_FILE, name + "\n")


def saved_entries(path: Path) -> set[str]:
    """The top-level entries (model, optim, data, train) a DCP checkpoint holds."""
    metadata = read_metadata(path).state_dict_metadata
    return {key.split(".", 1)[0] for key in metadata}


def load_model_weights(path: str | os.PathLike, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The full fp32 model weights of a checkpoint saved at any world size, read without a process group."""
    path = resolve_checkpoint(path)
    check_model_shapes(path, {name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
    state = {"model": {name: torch.empty(shape) for name, shape in shapes.items()}}
    load_state(state, path, no_dist=True)
    return state["model"]


def iter_model_weights(path: str | os.PathLike, shapes: dict[str, torch.Size]) -> Iterator[tuple[str, torch.Tensor]]:
    """The full fp32 weights of a checkpoint saved at any world size, one tensor at a time in the order of `shapes`
    (each read from every rank's file that holds a part of it), without a process group: the memory it takes is the
    largest tensor, not the model."""
    path = resolve_checkpoint(path)
    check_model_shapes(path, {name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
    for name, shape in shapes.items():
        state = {"model": {name: torch.empty(shape)}}
        load_state(state, path, no_dist=True)
        yield name, state["model"][name]


class _ReadAsWrittenPlanner(DefaultSavePlanner):
    """DCP's save planner for a state whose tensors are on the meta device (shape and dtype only): each is read with
    `read(name)` when the writer comes to it and dropped once written, so a save holds one tensor at a time."""

    def __init__(self, read: Callable[[str], torch.Tensor]):
        super().__init__()
        self.read = read

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = super().lookup_object(index)
        if isinstance(found, torch.Tensor) and found.is_meta:
            return self.read(index.fqn.removeprefix("model."))
        return found


def save_model_weights(
    state: dict[str, torch.Tensor],
    out_dir: str | os.PathLike,
    attachments: dict[str, bytes] | None = None,
    read: Callable[[str], torch.Tensor] | None = None,
) -> Path:
    """Write full weights as a weights-only checkpoint `out_dir/checkpoints/step_00000000` and publish it, so that
    `--checkpoint.resume out_dir` starts training from them. Needs no process group. With `read`, `state` holds meta
    tensors and each is read by name as it is written, so the memory it takes is the largest tensor, not the model."""
    path = Path(out_dir) / CHECKPOINTS_DIR / "step_00000000"
    planner = _ReadAsWrittenPlanner(read) if read is not None else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            writer = ChecksummedWriter(path, attachments or {}, file_per_tensor=read is not None)
            dcp.save({"model": state}, storage_writer=writer, planner=planner, no_dist=True)
    except (OSError, CheckpointException) as e:  # a full disk: no partial step left to be taken for a checkpoint
        shutil.rmtree(path, ignore_errors=True)
        _, cause = first_failure(e)
        if isinstance(cause, OSError):
            raise OSError(f"{write_failure(cause, path.parent)}; no partial checkpoint was left at {path}") from e
        raise
    return path


class Checkpointer:
    """Saves and restores a dict of Stateful objects under `train.out_dir/checkpoints`, when due.

    Each checkpoint carries the recipe and the tokenizer of the run, so tools/consolidate.py can turn it into an HF
    model on its own. With `async_save`, save() returns once the state is copied off the training tensors, and the
    files are written by a background thread; `latest` moves to that step once the write has finished (checked
    without blocking at each later step, and waited for by the next save and by close()).
    """

    def __init__(self, recipe: Recipe, env: DistEnv, states: dict[str, Stateful], reference: nn.Module | None = None):
        self.cfg = recipe.checkpoint
        self.preference = recipe.preference.loss is not None
        self.reference = reference  # a full fine-tuning preference run's frozen reference model
        self.dir = Path(recipe.train.out_dir) / CHECKPOINTS_DIR
        self.states = states
        self.is_main = env.is_main
        self.local_main = env.local_rank == 0  # says what every rank of its node found
        self.precision = recipe.parallel.mixed_precision  # resolved: what this run computes in
        self.attachments = {
            RECIPE_FILE: recipe_to_yaml(recipe).encode(),
            **{name: path.read_bytes() for name, path in tokenizer_files(recipe.data.tokenizer_path).items()},
        }
        self.adapters_only = getattr(states.get("model"), "adapters_only", False)
        if self.adapters_only:  # until load() says otherwise: the adapters apply to the recipe's seeded init
            self.attachments[LORA_BASE_FILE] = _start_record(None)
        if reference is not None:  # likewise the reference holds the seeded init until load() loads other weights
            self.attachments[REFERENCE_FILE] = _start_record(None)
        self.last_saved: int | None = None
        self.resumed_from: Path | None = None  # the step directory load() resumed from; its attachments are read back
        self.preempted = False
        # The checkpointer's own CPU round trips (the preemption flag each step, what verification found), on a gloo
        # group apart from training's collectives.
        self._control = dist.new_group(backend="gloo", timeout=env.timeout)
        self._preemption: PreemptionFlag | None = PreemptionFlag(self._control)
        self._pending: tuple[Future, Path, float, float] | None = None  # future, path, start time, blocked seconds
        # The background write runs its own collectives; on the default group they would interleave with training's
        # and deadlock (gloo hangs until its timeout), so it gets a group of its own.
        self._async_group = dist.new_group(backend="gloo", timeout=env.timeout) if self.cfg.async_save else None
        # A step saved again (after a resume fell back past a corrupted copy of it) replaces that copy, as it should.
        warnings.filterwarnings("ignore", "Detected an existing checkpoint")

    def load(self) -> int | None:
        """Restore according to `checkpoint.resume`; returns the step resumed from, or None for a fresh start."""
        resume = self.cfg.resume
        has_own = published_step(self.dir) is not None
        if resume == "none" or (resume == "auto" and not has_own):
            return None
        path = self._newest_verified() if resume == "auto" else self._verified(resolve_checkpoint(resume))
        self._carry_generation_config(path)
        started_from = None  # the weights-only checkpoint named again, when the run goes on from its own
        if saved_entries(path) == {"model"} or self._starts_preference(path):  # where this run starts: weights only
            if not has_own:  # fresh optimizer, data stream and step; LoRA adapters as initialised, on this base
                self._load_base(path)
                if self.reference is not None:
                    self._load_reference(path)
                logger.info(f"loaded weights from {path}; starting at step 0")
                return None
            # The same command again after a preemption or a torchrun restart: the run goes on from its own latest
            # instead of starting over from the weights (and losing every step since).
            logger.info(f"{path} holds the weights this run started from; continuing the run from its own checkpoints")
            started_from, path = path, self._newest_verified()
        if self.adapters_only:  # the frozen weights come from the base the adapters were trained on
            base = lora_base(path)
            if started_from is not None and base != started_from.resolve():
                raise CheckpointError(
                    f"this run's adapters were trained on {base}, not on {started_from}; resume with "
                    f"--checkpoint.resume {base}, or start a new run in another train.out_dir"
                )
            if base is not None:
                self._load_base(base)
            self.attachments[LORA_BASE_FILE] = (path / LORA_BASE_FILE).read_bytes()
        if self.reference is not None:  # the reference holds the weights the run started from, not its latest
            reference = preference_reference(path)
            if reference is not None:
                self._load_reference(reference)
            self.attachments[REFERENCE_FILE] = (path / REFERENCE_FILE).read_bytes()
        check_model_shapes(path, self.states["model"].state_dict())
        self._check_precision(path)
        saved = saved_entries(path)
        missing = set(self.states) - saved
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks {sorted(missing)}: it was not written by this trainer")
        load_state(self.states, path)
        step = self.states["train"].step
        self.last_saved, self.resumed_from = step, path
        logger.info(f"resumed from {path} at step {step}")
        return step

    def _load_base(self, path: Path) -> None:
        """The weights of a weights-only checkpoint into the model; a LoRA run's adapters keep their values, and its
        later checkpoints record which base they apply to."""
        model = ModelState(self.states["model"].model)  # every weight, whatever the run saves
        quantized = quantized_weights(model.model)
        check_model_shapes(path, {**model.state_dict(), **quantized}, adapters_optional=True)
        load_state({"model": model}, path, partial=True)
        # QLoRA's NF4 weights: each read whole and quantized whole on every rank, which keeps its rows (adapters/nf4.py)
        for name, values in iter_model_weights(path, {name: p.shape for name, p in quantized.items()}):
            fill_shard(quantized[name], values)
        if self.adapters_only:
            self.attachments[LORA_BASE_FILE] = _start_record(path)

    def _starts_preference(self, path: Path) -> bool:
        """A preference run named a checkpoint of another kind of run (an SFT run, a pretraining run): it starts from
        that checkpoint's weights, with its own optimizer, data and step."""
        if not self.preference:
            return False
        try:
            return load_sections(checkpoint_recipe(path))["preference"].loss is None
        except (FileNotFoundError, ValueError, KeyError):
            return True  # no recipe, or one from before preference tuning existed: not a preference run's

    def _load_reference(self, path: Path) -> None:
        """The weights of a checkpoint into the frozen reference model, recorded for the run's checkpoints."""
        reference = ModelState(self.reference)
        check_model_shapes(path, reference.state_dict(), adapters_optional=True)
        load_state({"model": reference}, path, partial=True)
        self.attachments[REFERENCE_FILE] = _start_record(path)

    def _carry_generation_config(self, path: Path) -> None:
        """An imported model's generation_config.json goes on with every checkpoint of the runs that start from it,
        so that consolidate.py exports it again."""
        if (path / HF_GENERATION_CONFIG).is_file():
            self.attachments[HF_GENERATION_CONFIG] = (path / HF_GENERATION_CONFIG).read_bytes()

    def _check_precision(self, path: Path) -> None:
        """A resume in another precision than the checkpoint was trained in (auto resolved otherwise on this hardware,
        or an override) goes on from the same state, but not as the original run would have: one warning says so.
        Into fp16 from another precision it cannot: fp16's loss scale is part of the training state."""
        try:
            saved = load_sections(checkpoint_recipe(path))["parallel"].mixed_precision
        except (FileNotFoundError, ValueError):
            return  # a checkpoint without a readable recipe: nothing recorded to compare with
        if saved in (AUTO, self.precision):
            return
        if self.precision == "fp16":
            raise CheckpointError(
                f"checkpoint {path} was trained in {saved} and holds no fp16 loss scale to resume with; set "
                f"parallel.mixed_precision {saved}"
            )
        if self.is_main:
            logger.warning(
                f"checkpoint {path} was trained in {saved}, and this run computes in {self.precision}: it goes on from "
                f"the same state, not bitwise as the original run would have; set parallel.mixed_precision {saved} to "
                "keep it (if this hardware runs it natively)"
            )

    def _problems(self, path: Path) -> list[str] | None:
        """verify_checkpoint with the files split over the ranks (each reads 1/N of the bytes), and the problems every
        rank found gathered on all, so that every rank takes the same decision."""
        share = verify_checkpoint(path, dist.get_rank(), dist.get_world_size())
        found: list = [None] * dist.get_world_size()
        dist.all_gather_object(found, share, group=self._control)  # gloo: CPU objects, no device involved
        return None if found[0] is None else sorted(problem for share in found for problem in share)

    def _verified(self, path: Path) -> Path:
        return _accepted(path, self._problems(path), warn=self.is_main)

    def _newest_verified(self) -> Path:
        """The step `latest` names if it verifies; else, with one warning naming what failed, the newest older
        published step that does (keep_last kept it); CheckpointError if none does."""
        latest = published_step(self.dir).name
        older = [p.name for p in self.dir.iterdir() if _STEP_DIR.match(p.name) and p.name < latest]
        failed = []
        for name in [latest, *sorted(older, reverse=True)]:
            path = self.dir / name
            problems = self._problems(path) if is_complete(path) else [f"{path} is missing or has no .metadata"]
            if not problems:  # [] verified, or None: saved before checksums existed
                if failed and self.is_main:
                    logger.warning(f"{failed[0]}; resuming from {name}, the newest checkpoint that verifies")
                return _accepted(path, problems, warn=self.is_main)
            failed.append(f"checkpoint {name} is corrupted: {problems[0]}")
        raise CheckpointError(
            f"no checkpoint under {self.dir} verifies ({'; '.join(failed)}); copy good ones back, or start over with "
            "--checkpoint.resume none"
        )

    def save_if_due(self, step: int, last: bool = False) -> None:
        """Save `step` if it is a `checkpoint.every` step, or the `last` of the run (unless saved already), or if
        SIGTERM reached any rank; then `preempted` says the run must stop. Also settles a background write that every
        rank has finished since the last call."""
        writing = self._pending is not None and not self._pending[0].done()
        # One tiny CPU all-reduce per step (see PreemptionFlag): SIGTERM on any rank, a background write still going on
        # any rank. Settled once no rank writes, so that every rank sees a failed write at the same step.
        self.preempted, writing = self._preemption.agreed(writing)
        if self._pending is not None and not writing:
            self._finish_pending(final=False)
        every = self.cfg.every
        due = self.preempted or (bool(every) and (step % every == 0 or last))
        if due and self.last_saved != step:
            if self.preempted:  # every rank saves this step, then the run exits 0; a restart resumes here
                logger.info(f"SIGTERM: saving step {step} and stopping")
            self.save(step, final=last or self.preempted)

    def save(self, step: int, final: bool) -> None:
        """Save `step` (in the background with async_save; `latest` moves once it is complete). A `final` save (the
        run's last, or on SIGTERM) that fails stops the run whatever checkpoint.on_save_error says."""
        self.last_saved = step
        path = self.dir / f"step_{step:08d}"
        if self._pending is not None:  # one write in flight at a time
            self._finish_pending(final=False)
        start = time.perf_counter()
        try:
            writer = ChecksummedWriter(path, self.attachments)
            if self.cfg.async_save:
                future = dcp.async_save(self.states, storage_writer=writer, process_group=self._async_group)
                self._pending = (future, path, start, time.perf_counter() - start)
                return
            dcp.save(self.states, storage_writer=writer)
        except (OSError, CheckpointException) as e:
            self._failed(path, e, final)
            return
        # dcp.save returns only after the coordinator wrote .metadata, the checksums and `latest`, on every rank.
        blocked = time.perf_counter() - start
        self._published(path, blocked, blocked)

    def _finish_pending(self, final: bool) -> None:
        future, path, start, blocked = self._pending
        self._pending = None
        try:
            future.result()  # re-raises a failed background write
        except (OSError, CheckpointException) as e:
            self._failed(path, e, final)
            return
        self._published(path, time.perf_counter() - start, blocked)

    def _failed(self, path: Path, error: BaseException, final: bool) -> None:
        """A save failed on some rank (a full disk, a quota, an I/O error), and DCP raised it on every rank: the partial
        step directory is removed, `latest` (moved only once a step is complete) still names the previous checkpoint,
        each node's first rank says so in one line, and the run stops with CheckpointError or, under
        on_save_error=continue, trains on and saves at the next due step. A `final` save stops it either way: nothing
        would save its steps again."""
        rank, error = first_failure(error)
        rank = dist.get_rank() if rank is None else rank
        if isinstance(error, OSError):
            cause = f"rank {rank}: {write_failure(error, self.dir)}"
        else:
            cause = f"rank {rank}: {type(error).__name__}: {error}"
        if self.is_main:
            shutil.rmtree(path, ignore_errors=True)
        previous = published_step(self.dir)
        kept = f"{self.dir / LATEST_FILE} still names {previous.name}" if previous else "no checkpoint was saved before"
        message = f"checkpoint {path.name} was not saved: {cause}; {kept}"
        if self.cfg.on_save_error == "stop" or final:
            why = "checkpoint.on_save_error=stop" if self.cfg.on_save_error == "stop" else "the run's last save"
            raise CheckpointError(f"{message}; stopping ({why}): make room, then run the same command to resume")
        if self.local_main:
            logger.warning(
                f"{message}; training on, to save again at the next due step (checkpoint.on_save_error=continue)"
            )

    def _published(self, path: Path, total_s: float, blocked_s: float) -> None:
        if self.is_main:
            self._prune()
            logger.info(f"saved checkpoint {path} ({total_s:.2f} s, training blocked {blocked_s:.2f} s)")

    def _prune(self) -> None:
        if not self.cfg.keep_last:
            return
        latest = published_step(self.dir).name
        published = sorted(p.name for p in self.dir.iterdir() if _STEP_DIR.match(p.name) and p.name <= latest)
        for name in published[: -self.cfg.keep_last]:
            shutil.rmtree(self.dir / name, ignore_errors=True)

    def close(self, wait: bool = True) -> None:
        """Wait for a background write and settle it (unless not `wait`: after a failure that may have broken its
        collectives), and give SIGTERM back."""
        try:
            if self._pending is not None and wait:
                self._finish_pending(final=True)
        finally:
            self._pending = None
            if self._preemption is not None:
                self._preemption.close()
                self._preemption = None
                dist.destroy_process_group(self._control)  # now, not at interpreter exit (see close_distributed)
                self._control = None
