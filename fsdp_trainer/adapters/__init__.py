"""Adapters applied to a built model from outside, between its construction on the meta device and parallelize():
LoRA (lora.py) and QLoRA's 4-bit frozen weights (nf4.py). The rest of the house asks a model whether it carries
adapters (`has_adapters`) instead of reading the lora section, and builds the recipe's model in one place
(`meta_model`)."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from fsdp_trainer.adapters.lora import LoRAEmbedding, LoRAExperts, LoRALinear, apply_lora, load_adapters
from fsdp_trainer.adapters.nf4 import check_nf4_shapes, quantize_frozen, require_torchao
from fsdp_trainer.adapters.peft_format import check_peft_adapter, load_peft_adapter
from fsdp_trainer.config import LoraConfig, ModelConfig, ParallelConfig
from fsdp_trainer.distributed.parallelize import SHARDING, fill_local_shard
from fsdp_trainer.model import Transformer, on_meta


def meta_model(
    model: ModelConfig,
    lora: LoraConfig,
    flex_attention: bool = False,
    frozen_dtype: torch.dtype | None = None,
    quantize: bool = False,
) -> Transformer:
    """The model a recipe trains, on the meta device (shapes only): the Transformer, with the adapters its lora section
    asks for, every other weight frozen and held in `frozen_dtype`; with `quantize`, QLoRA's frozen projections in
    NF4 as lora.quantize_base asks. Materialized by distributed.parallelize.materialize after parallelize()."""
    with on_meta():
        built = Transformer(model, flex_attention=flex_attention)
        if lora.rank is not None:
            apply_lora(built, lora, frozen_dtype=frozen_dtype)
    if quantize and quantizes_base(lora):  # FSDP2 shards the frozen projections in their 4-bit form
        quantize_frozen(built)
    return built


def read_only_meta_model(model: ModelConfig, lora: LoraConfig) -> Transformer:
    """meta_model(model, lora), built once a process for each model and adapters (by their reprs: every field), for
    readers that only read it: the checks before the workers start (room, start, the summary line) and the planner,
    row after row. Not to be changed by them."""
    key = (repr(model), repr(lora))
    if key not in _READ_ONLY:
        _READ_ONLY[key] = meta_model(model, lora)
    return _READ_ONLY[key]


_READ_ONLY: dict[tuple[str, str], Transformer] = {}


def has_adapters(model: nn.Module) -> bool:
    """Whether a model carries adapters: it trains them alone, and its checkpoints hold them alone."""
    return any(isinstance(module, (LoRALinear, LoRAEmbedding, LoRAExperts)) for module in model.modules())


def adapter_kind(lora: LoraConfig) -> str:
    """What a run trains, by its lora section: `lora` (adapters on a frozen base, QLoRA's included) or `full`."""
    return "full" if lora.rank is None else "lora"


def quantizes_base(lora: LoraConfig) -> bool:
    """Whether the adapters' frozen projections are held in NF4 (QLoRA)."""
    return lora.quantize_base == "nf4"


def check_adapters(model: ModelConfig, lora: LoraConfig, parallel: ParallelConfig) -> None:
    """What the adapters a recipe asks for need before any process group exists: a PEFT adapter to start from that
    is there and made for this rank, scale and targets; for QLoRA, torchao, and projections that split over the shard
    group. ValueError / FileNotFoundError, one line."""
    if lora.adapter is not None:
        check_peft_adapter(lora.adapter, lora)
    if quantizes_base(lora):
        require_torchao()
        # The launcher knows no world size yet: it checks the whole weights, each worker its shard group too
        world = int(os.environ.get("WORLD_SIZE", 1))
        check_quantized_split(model, lora, parallel.sharding, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def check_quantized_split(model: ModelConfig, lora: LoraConfig, sharding: str, world: int, per_node: int) -> None:
    """QLoRA's 4-bit projections split into whole rows and NF4 scale blocks over the shard group `sharding` makes of
    `world` ranks, `per_node` a node; ValueError naming the one that does not."""
    _, shard_ranks = SHARDING[sharding].mesh_shape(world, per_node)
    check_nf4_shapes(meta_model(model, lora), shard_ranks)


def start_adapters(model: nn.Module, lora: LoraConfig) -> bool:
    """Set a fresh run's adapters to the PEFT adapter lora.adapter names, if it names one; returns whether it did."""
    if lora.adapter is None:
        return False
    load_adapters(model, load_peft_adapter(lora.adapter, lora), fill_local_shard)
    return True
