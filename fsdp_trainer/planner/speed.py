"""How long will it take? Predicted step time, tokens/s per GPU and MFU of a planner row on a named GPU.

A step is its compute and its communication, overlapped as FSDP2 overlaps them:

- compute: the step's FLOPs (metrics.flops_per_token per token; a frozen weight (LoRA) 4 per token instead of 6, with
  no weight gradient; full AC runs each block's forward twice) at ACHIEVED of the GPU's dense peak, times COMPILED
  with parallel.compile;
- communication: the bytes a rank sends per step (plan.comm_bytes_per_rank, the collectives tests/test_collectives.py
  counts) over NVLink within a node and the network between nodes, at LINK_EFFICIENCY of the datasheet's rate;
- overlap: FSDP2 all-gathers the next block while this one computes and reduce-scatters a block while the previous
  one runs backward, so communication hides under compute, except the first block's all-gather and the last block's
  reduce-scatter (1/n_layers of it) and whatever exceeds the compute;
- the optimizer step: AdamW reads and writes 28 bytes per parameter of its shard (weight, gradient, two moments)
  from HBM.

ACHIEVED and COMPILED are calibrated on torchtitan's Llama 3.1 8B on 8 H100s and checked against OLMo-core's
figures (docs/benchmarks.md, with the model's error on each). Rows with the state offloaded to the host get no
prediction: their step waits on the host's optimizer and PCIe, which this model does not price.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_trainer.adapters import adapter_kind
from fsdp_trainer.config import Recipe
from fsdp_trainer.distributed.runtime import precision_on
from fsdp_trainer.metrics import PEAK_FLOPS, attention_flops_per_token, flops_per_token
from fsdp_trainer.model import count_params
from fsdp_trainer.steps import training_kind


@dataclass(frozen=True)
class Gpu:
    """One GPU of a node, from its vendor's datasheet (dense, no sparsity)."""

    memory_gb: float
    hbm_gb_s: float
    nvlink_gb_s: float
    """NVLink per GPU, one direction (the datasheets quote both directions together: half of that)."""
    network_gb_s: float
    """The node's network per GPU, one direction: one 400 Gb/s NIC per GPU (200 Gb/s on A100 systems)."""
    fp8_flops: float | None


# H100 SXM, H200 SXM, A100 SXM 80GB and B200 (HGX) datasheets; peak bf16 FLOP/s are metrics.PEAK_FLOPS's.
GPUS: dict[str, Gpu] = {
    "H100": Gpu(memory_gb=80, hbm_gb_s=3350, nvlink_gb_s=450, network_gb_s=50, fp8_flops=1979e12),
    "H200": Gpu(memory_gb=141, hbm_gb_s=4800, nvlink_gb_s=450, network_gb_s=50, fp8_flops=1979e12),
    "A100": Gpu(memory_gb=80, hbm_gb_s=2039, nvlink_gb_s=300, network_gb_s=25, fp8_flops=None),
    "B200": Gpu(memory_gb=180, hbm_gb_s=8000, nvlink_gb_s=900, network_gb_s=50, fp8_flops=4500e12),
}

ACHIEVED = 0.34
"""The fraction of dense peak that eager training's matmuls reach: torchtitan's 8B on 8 H100s (5,762 tokens/s per GPU
at 57.9 GFLOPs a token is 33.7% MFU; the rest of its step is the exposed communication and the optimizer)."""
COMPILED = 6667 / 5762
"""torch.compile's speed-up in the same measurement (6,667 tokens/s per GPU against 5,762)."""
LINK_EFFICIENCY = 0.8
"""The share of a link's datasheet rate a ring collective moves, as NCCL's bus-bandwidth tests show."""
ADAM_BYTES = 28
"""Bytes AdamW reads and writes per parameter: weight, gradient, two moments read; weight, two moments written."""


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    optimizer_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float


def step_time(recipe: Recipe, estimate, gpu: str, nproc: int, nnodes: int) -> StepTime | None:
    """The predicted step of a planner row (plan.Estimate) on `gpu`; None for offload rows."""
    if estimate.offload:
        return None
    spec, cfg, data = GPUS[gpu], recipe.model, recipe.data
    peak = PEAK_FLOPS[gpu][precision_on(recipe.parallel.mixed_precision, "cuda")[0]]
    tokens = data.micro_batch_size * data.seq_len * data.grad_accum_steps  # per GPU per step
    model_flops = flops_per_token(cfg, data.seq_len)
    compute_flops = model_flops
    if adapter_kind(recipe.lora) == "lora":  # frozen weights: no weight gradient, 4 FLOPs a token instead of 6
        attention = attention_flops_per_token(cfg, data.seq_len)
        compute_flops = attention + (model_flops - attention) * 4 / 6
    if estimate.ac == "full":  # each block's forward again in backward: a third more of its matmuls
        compute_flops *= 4 / 3
    # The training kind's forwards without gradient (a reference's, a teacher's): 2 FLOPs a weight, against the
    # policy's 6, scaled by their weights
    n_params = count_params(cfg)
    compute_flops += training_kind(recipe).forward_params(recipe, n_params) / n_params * model_flops / 3
    efficiency = ACHIEVED * (COMPILED if recipe.parallel.compile else 1.0)
    compute_s = tokens * compute_flops / (peak * efficiency)
    intra_gb = estimate.sent_gb - estimate.internode_gb
    comm_s = intra_gb / (spec.nvlink_gb_s * LINK_EFFICIENCY) + estimate.internode_gb / (
        spec.network_gb_s * LINK_EFFICIENCY
    )
    exposed = comm_s / cfg.n_layers + max(0.0, comm_s - compute_s)
    # The state is 16 bytes per trained parameter (LoRA: plus the frozen weights, which the step does not touch).
    optimizer_s = estimate.state_gb * ADAM_BYTES / 16 / spec.hbm_gb_s
    step_s = compute_s + exposed + optimizer_s
    per_gpu = tokens / step_s
    return StepTime(compute_s, comm_s, exposed, optimizer_s, step_s, per_gpu, per_gpu * model_flops / peak)
