"""QLoRA's frozen base (Dettmers et al. 2023): the adapted projections' frozen weights stored in 4-bit NormalFloat
(NF4) through torchao's NF4Tensor, which FSDP2 shards and all-gathers in its 4-bit form and which dequantizes to the
compute dtype inside each matmul (forward and backward), one projection at a time.

NF4 quantizes blocks of 64 values to 4-bit indices into a normal-quantile table with one absmax scale each, and those
scales again (double quantization) in blocks of 256 around their mean over the whole tensor: about 0.52 bytes a
value instead of 2 in bf16. Because that mean is a whole-tensor quantity, a weight is always quantized whole and then
split into this rank's rows (as FSDP2 would split it), never shard by shard: every rank gets the same scales, and the
gathered weight is the same at any world size. Embeddings, norms and the output layer (unless lora.targets adapts
it) stay in the compute dtype.

torchao is an optional dependency (`pip install fsdp-trainer[qlora]`); nothing here imports it until NF4 is used.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from fsdp_trainer.adapters.lora import LoRALinear
from fsdp_trainer.distributed.parallelize import fill_local_shard
from fsdp_trainer.model import unwrapped_name

BLOCK = 64
"""Values per NF4 scale (torchao's and bitsandbytes' default, QLoRA's)."""
SCALER_BLOCK = 256
"""Scales per double-quantization block."""
VALUES_PER_SCALER_BLOCK = BLOCK * SCALER_BLOCK
"""The values one double-quantization block covers: the unit a quantized weight splits into across ranks."""
BYTES_PER_VALUE = 0.5 + 1 / BLOCK
"""Stored bytes per quantized value: a 4-bit index, plus an int8 scale per block (a factor per 16,384 values aside)."""


def dequantization_peak_bytes(compute_bytes: int) -> int:
    """Bytes per value that torchao's eager dequantization (NF4Tensor.get_original_weight) holds at once, its locals
    living until it returns: each half of the values' 4-bit indices widened to int64 (8 bytes a value in all), looked up
    in the table, scaled, and the two halves stacked, three tensors of the compute dtype (the table's) a value."""
    return 8 + 3 * compute_bytes


def _torchao_nf4():
    """torchao's NF4 module, imported quietly (its import logs about GPU kernels a CPU build has no use for)."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as e:
        raise ValueError(
            f"lora.quantize_base nf4 needs torchao ({e}); install it with `pip install 'fsdp-trainer[qlora]'`"
        ) from e
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    return nf4_tensor


def require_torchao() -> None:
    """ValueError (one line) if torchao cannot be imported."""
    _torchao_nf4()


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """A whole weight in NF4, by torchao's own quantizer."""
    return _torchao_nf4().to_nf4(weight.contiguous(), block_size=BLOCK, scaler_block_size=SCALER_BLOCK)


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether a (possibly sharded) tensor is stored in NF4."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return type(local).__name__ == "NF4Tensor"


def check_nf4_shapes(model: nn.Module, shard_ranks: int) -> None:
    """ValueError (one line) unless every projection of `model` (a recipe's model with its adapters, on meta) whose
    frozen weight QLoRA quantizes splits into whole double-quantization blocks and whole rows over `shard_ranks` ranks,
    as torchao's NF4 split (FSDP2's sharding of it) requires. An adapted embedding stays in the compute dtype."""
    projections = {
        name.rsplit(".", 1)[-1]: tuple(module.weight.shape)
        for name, module in model.named_modules()
        if isinstance(module, LoRALinear)
    }
    for name, (rows, cols) in projections.items():
        where = f"lora.quantize_base nf4: {name} ({rows} x {cols})"
        if rows * cols % VALUES_PER_SCALER_BLOCK:
            raise ValueError(
                f"{where} is not a whole number of NF4 scale blocks ({VALUES_PER_SCALER_BLOCK:,} values); leave "
                f"{name} out of lora.targets"
            )
        if rows * cols // VALUES_PER_SCALER_BLOCK % shard_ranks or rows % shard_ranks:
            raise ValueError(
                f"{where} does not split into whole rows and NF4 scale blocks over a shard group of {shard_ranks} "
                f"ranks; shard over fewer ranks (HYBRID_SHARD shards within a node), or leave {name} out of "
                "lora.targets"
            )


def quantize_frozen(model: nn.Module) -> None:
    """Store the frozen weight of every LoRALinear of a model on the meta device in NF4 (its shape, no values yet):
    FSDP2 then shards it in that form. Values are set by fill_shard."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.weight = nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)


def quantized_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's NF4 parameters themselves (not state-dict aliases, whose parts fill_shard could not set), by HF
    name."""
    return {unwrapped_name(name): param for name, param in model.named_parameters() if is_nf4(param)}


@torch.no_grad()
def fill_shard(param: torch.Tensor, values: torch.Tensor) -> None:
    """fill_local_shard for a model whose frozen projections may be NF4: such a weight is quantized whole, on its
    device and in its dtype, and this rank keeps its rows of the result (see the module docstring)."""
    if not is_nf4(param):
        fill_local_shard(param, values)
        return
    if isinstance(param, DTensor):
        # The shard itself: to_local() hands back a new NF4Tensor sharing its parts, which setting parts would miss
        local, (index, count) = param._local_tensor, _shard_of(param)
    else:
        local, index, count = param, 0, 1
    whole = to_nf4(values.to(device=local.device, dtype=local.dtype))
    mine = torch.chunk(whole, count, dim=0)[index]
    # Set its parts, not copy_: torchao's copy_ leaves the per-tensor mean of a shard materialized from meta on meta.
    # Each part copied: a slice of the whole's would keep all of the whole's storage alive on every rank.
    for name in mine.__tensor_flatten__()[0]:
        setattr(local, name, getattr(mine, name).clone())


def _shard_of(param: DTensor) -> tuple[int, int]:
    """(this rank's index, number of shards) along the mesh dimension that shards dim 0."""
    mesh = param.device_mesh
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"an NF4 weight is split by rows, not along dim {placement.dim}")
            return mesh.get_local_rank(dim), mesh.size(dim)
    return 0, 1
