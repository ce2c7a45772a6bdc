"""A checkpoint's model weights without a process group, whole or one tensor at a time: for conversion, import and
consolidation."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from fsdp_trainer.adapters.lora import is_adapter
from fsdp_trainer.checkpoint.storage import (
    CheckpointError,
    ChecksummedWriter,
    first_failure,
    load_state,
    read_metadata,
    resolve_checkpoint,
)
from fsdp_trainer.files import (
    CHECKPOINTS_DIR,
    write_failure,
)


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
