"""A checkpoint's model weights without a process group, whole or one tensor at a time: for conversion, import and
consolidation."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_trainer.adapters import meta_model
from fsdp_trainer.adapters.lora import is_adapter, merged, trained_with_adapters
from fsdp_trainer.adapters.nf4 import is_nf4
from fsdp_trainer.checkpoint.starts import is_adapters_only, lora_base
from fsdp_trainer.checkpoint.storage import (
    CheckpointError,
    ChecksummedWriter,
    checkpoint_recipe,
    checkpoint_tokenizer,
    first_failure,
    load_state,
    read_metadata,
    resolve_checkpoint,
)
from fsdp_trainer.checkpoint.verify import verified_checkpoint
from fsdp_trainer.config import LoraConfig, ModelConfig, load_sections
from fsdp_trainer.files import (
    CHECKPOINTS_DIR,
    write_failure,
)
from fsdp_trainer.model import Transformer


class ModelState(Stateful):
    """The model's (sharded) weights under their HF names, whatever wrappers the model carries; with `adapters_only`
    (a LoRA run), its adapters alone: the frozen weights are the base's, recorded by its Start, not saved again."""

    def __init__(self, model: nn.Module, adapters_only: bool = False):
        self.model, self.adapters_only = model, adapters_only

    def state_dict(self) -> dict[str, Any]:
        state = get_model_state_dict(self.model)
        if self.adapters_only:
            return {name: t for name, t in state.items() if trained_with_adapters(name)}
        # NF4 weights (QLoRA) are never saved and not loaded by DCP: restore.load_weights quantizes them
        return {name: t for name, t in state.items() if not is_nf4(t)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        strict = not self.adapters_only and not any(is_nf4(p) for p in self.model.parameters())
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=strict))


def check_model_shapes(path: Path, model_state: dict[str, Any], adapters_optional: bool = False) -> None:
    """Refuse a checkpoint of another model before DCP fails deep inside with a shape error. With
    `adapters_optional`, a checkpoint without what a LoRA run trains (its base model), or a language model's without
    a reward model's score head, passes: those keep their init."""
    check_shapes(path, saved_shapes(path), model_state, adapters_optional)


def saved_shapes(path: Path) -> dict[str, tuple | None]:
    """The shapes of the model weights a checkpoint holds, by name (None: not a tensor), from its metadata alone."""
    metadata = read_metadata(path).state_dict_metadata
    return {
        key.removeprefix("model."): tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else None
        for key, meta in metadata.items()
        if key.startswith("model.")
    }


def check_shapes(
    path: Path, saved: dict[str, tuple | None], model_state: dict[str, Any], adapters_optional: bool = False
) -> None:
    """check_model_shapes against the shapes of the weights `path` holds, by name (None: not a tensor)."""
    for name, tensor in model_state.items():
        if name not in saved and adapters_optional and trained_with_adapters(name):
            continue
        if name not in saved:
            raise CheckpointError(f"checkpoint {path} has no tensor {name}: it was saved from another model")
        if saved[name] is not None and saved[name] != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint {path} holds {name} of shape {saved[name]} but the recipe's model has "
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


@dataclass
class SavedModel:
    """A checkpoint's model, as its recipe describes it: for export, and for a run that starts from its weights."""

    path: Path
    """The step directory."""
    model: ModelConfig
    tokenizer: Path | None
    lora: LoraConfig | None
    """The adapters it was trained with, if any."""
    seed: int
    """The seed of its weight init (a LoRA run from scratch: the frozen weights are that init)."""


def read_saved_model(path: str | os.PathLike) -> SavedModel:
    ckpt = verified_checkpoint(path)  # a corrupted checkpoint never becomes a model or an HF directory
    sections = load_sections(checkpoint_recipe(ckpt))
    lora = sections["lora"] if sections["lora"].rank is not None else None
    tokenizer = checkpoint_tokenizer(ckpt, sections["data"].tokenizer_path)
    return SavedModel(ckpt, sections["model"], tokenizer, lora, sections["train"].seed)


def export_shapes(ckpt: SavedModel) -> tuple[dict[str, torch.Size], dict[str, torch.Size]]:
    """(the weights an HF model has, what a checkpoint of a LoRA run holds: its adapters, and a reward model's score
    head, which is among both) by name and shape; tied embeddings once, under embed_tokens."""
    model = meta_model(ckpt.model, ckpt.lora or LoraConfig())
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    if ckpt.model.tied_output:
        shapes.pop("lm_head.weight")  # the same tensor as embed_tokens; HF ties them again on load
    adapters = {name: shape for name, shape in shapes.items() if ckpt.lora and trained_with_adapters(name)}
    return {name: shape for name, shape in shapes.items() if not is_adapter(name)}, adapters


def weight_stream(ckpt: SavedModel) -> tuple[dict[str, torch.Size], Iterator[tuple[str, torch.Tensor]]]:
    """The weights an HF model has, as (shapes, the tensors one at a time in that order): the memory it takes is one
    tensor (and a LoRA run's adapters, which are small), not the model. A LoRA checkpoint holds its adapters only: the
    frozen weights come from the base it records, and each adapted one is merged as it passes."""
    cfg, lora = ckpt.model, ckpt.lora
    weights, adapter_shapes = export_shapes(ckpt)
    if lora is None:
        return weights, iter_model_weights(ckpt.path, weights)
    adapters = load_model_weights(ckpt.path, adapter_shapes)
    base_weights = {name: shape for name, shape in weights.items() if name not in adapters}  # a score head: the run's
    base = lora_base(ckpt.path)
    if base is None:  # the recipe's seeded init: the whole model in memory, as small as a from-scratch LoRA run is
        init = Transformer(cfg)
        init.init_weights(seed=ckpt.seed)
        init_state = init.state_dict()
        frozen = ((name, init_state[name]) for name in base_weights)
    elif is_adapters_only(base):  # a LoRA run started from another LoRA run's weights: merged in turn
        frozen = ((name, tensor) for name, tensor in weight_stream(read_saved_model(base))[1] if name in base_weights)
    else:
        frozen = iter_model_weights(base, base_weights)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name in weights:
            if name in adapters:
                yield name, adapters[name]
            else:
                frozen_name, tensor = next(frozen)
                yield frozen_name, merged(frozen_name, tensor, adapters, lora)

    return weights, stream()
