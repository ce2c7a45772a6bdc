"""How long will it take? Predicted step time, tokens/s per GPU and MFU of a planner row on a named GPU.

A step is its compute, its memory traffic and its communication, overlapped as FSDP2 overlaps them:

- matmuls: the step's weight FLOPs (6 a weight a token, 4 for a frozen one (LoRA), 2 more for each forward matmul that
  backward recomputes: all of them under full AC) at a fraction of the GPU's dense peak that grows with the matmul's
  size, the tokens of a micro-batch T: `matmul_peak * T / (T + matmul_half * ridge)`, where the ridge is the GPU's
  peak FLOP/s over its HBM bytes/s. The same thing said in bytes: each pass of a micro-batch over a weight (forward,
  backward's input gradient, its own gradient) costs its FLOPs at matmul_peak plus a fixed 2 * matmul_half /
  matmul_peak bytes of that weight over HBM (reading it, its gradient written and accumulated, the gathered copy),
  however few tokens share them. Short micro-batches leave the tensor cores waiting on those bytes, the more so the
  faster the tensor cores are against the memory; long ones approach matmul_peak. The block's width plays no
  part: fitted with a width term as well, the published runs set it to zero. A routed expert's weights are shared
  only by the tokens sent to it (top_k / experts of the micro-batch's): its matmuls run at that size;
- attention: its FLOPs with the causal half skipped (flash attention), heads as wide as the kernel's next width, at a
  fraction `attention` of the peak (an A100's own), a second forward under full AC;
- QLoRA: each NF4 weight dequantized to the compute dtype for every matmul it takes part in, priced by its bytes;
- memory traffic, priced by bytes over HBM: per token and layer `elementwise` x the width x the compute dtype's bytes
  (norms, activations, residuals, rotary, in eager PyTorch; `compiled` of it under torch.compile, which fuses them;
  a third more where AC recomputes them), and the cross-entropy's LOGIT_BYTES a logit;
- communication: the bytes a rank sends per step (memory.comm_bytes_per_rank, the collectives tests/test_collectives.py
  counts) over NVLink within a node and the network between nodes, at LINK_EFFICIENCY of the datasheet's rate;
- overlap: FSDP2 all-gathers the next block while this one computes and reduce-scatters a block while the previous
  one runs backward, so communication hides under compute, except the first block's all-gather and the last block's
  reduce-scatter (1/n_layers of it) and whatever exceeds the compute;
- the optimizer step: AdamW reads and writes 28 bytes per parameter of its shard (weight, gradient, two moments)
  from HBM.

Six constants (CALIBRATION) stand for every shape: five fitted once to llm-foundry's 110 published runs on H100s and
A100s (MPT 125M to 70B, sequences of 512 to 65,536, micro-batches of 1 to 128, 8 to 64 GPUs), the sixth (compile) from
torchtitan's compiled against eager run; llm-foundry's micro-batch sweep, torchtitan's, OLMo-core's and torchtune's
other runs and a mixture of experts' (Qwen3-30B-A3B on B200s) check them (benchmarks/published_runs.py; `python
benchmarks/fit_speed.py` prints the error on each row, docs/benchmarks.md the table: 133 of 136 within 15%; and 73 of
llm-foundry's 78 on A100 40GB in pure bf16, another stack, with `--pure_bf16`). Rows with the state offloaded to
the host get no prediction: their step waits on the host's optimizer and PCIe, which this model does not price.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdp_trainer.adapters import adapter_kind
from fsdp_trainer.adapters.nf4 import BYTES_PER_VALUE as NF4_BYTES
from fsdp_trainer.config import Recipe, compute_dtype
from fsdp_trainer.distributed.runtime import precision_on
from fsdp_trainer.generation import kv_cache_bytes
from fsdp_trainer.metrics import PEAK_FLOPS, attention_flops_per_token, expert_flops_per_token, flops_per_token
from fsdp_trainer.model import count_params
from fsdp_trainer.planner.activations import rank_tokens
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


def gpu_named(device_name: str) -> str | None:
    """GPUS's name for a CUDA device's (torch.cuda.get_device_name: "NVIDIA H100 80GB HBM3" -> H100), None for one
    not in it."""
    return next((key for key in GPUS if key in device_name), None)


@dataclass(frozen=True)
class Calibration:
    """The step-time model's constants, fitted together to published runs (benchmarks/fit_speed.py)."""

    matmul_peak: float
    """The fraction of dense peak the longest micro-batches' matmuls tend to. Fitted with the others, whose sum is
    the step, not measured alone: the published runs put it near 1, above what a lone large GEMM measures."""
    matmul_half: float
    """The tokens of a micro-batch at which a matmul reaches half of matmul_peak, per FLOP a byte of the GPU's ridge
    point (peak FLOP/s / HBM bytes/s): an H100's 295 puts it at 3,400 tokens, an A100's 153 at 1,800."""
    attention: float
    """The fraction of dense peak flash attention's FLOPs (causal half skipped) reach on Hopper and later GPUs (H100,
    H200, B200), whose tensor cores the flash attention kernels of these runs (FlashAttention 2, Triton, cuDNN's
    SDPA) leave further from peak than an A100's."""
    attention_a100: float
    """The same on an A100."""
    elementwise: float
    """Bytes moved over HBM per token, layer and unit of width in the compute dtype, eager: the norms, activations,
    residual adds and rotary embedding, forward and backward."""
    compiled: float
    """The share of those bytes torch.compile's fused kernels still move."""


CALIBRATION = Calibration(
    matmul_peak=0.99446,
    matmul_half=11.628,
    attention=0.15575,
    attention_a100=0.28252,
    elementwise=299.56,
    compiled=0.51122,
)
"""Fitted to llm-foundry's 110 runs (`python benchmarks/fit_speed.py --fit llm-foundry`); `compiled` from torchtitan's
compiled / eager speed-up, since those runs are all eager."""
DEQUANTIZED_BYTES = NF4_BYTES + 2 + 2
"""Bytes a QLoRA weight moves each time it is dequantized for a matmul: its NF4 value and scale read, its bf16 value
written and read by the matmul."""
LOGIT_BYTES = 30
"""Bytes a logit moves in the loss (counted, not fitted): the compute-dtype logit written, its fp32 copy and
log-softmax written and read, their gradients written and read, and cast back."""
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
    sampling_s: float = 0.0  # of step_s: an online kind's sampling before it trains


def step_time(
    recipe: Recipe,
    estimate,
    gpu: str,
    nproc: int,
    nnodes: int,
    calibration: Calibration = CALIBRATION,
    *,
    spec: Gpu | None = None,
    recomputed: float | None = None,
) -> StepTime | None:
    """The predicted step of a planner row (memory.Estimate) on `gpu`; None for offload rows.

    `spec` replaces GPUS[gpu]'s datasheet for a variant of that GPU (another memory); `recomputed` is the share of a
    block's forward matmuls that backward runs again, when it is not what our AC mode recomputes (full: all of them;
    selective and none: none), as in another framework's published run."""
    if estimate.offload:
        return None
    spec, cfg, data = spec or GPUS[gpu], recipe.model, recipe.data
    recomputed = recomputed_share(estimate.ac) if recomputed is None else recomputed
    peak = peak_flops(recipe, gpu)
    tokens = rank_tokens(recipe) * data.grad_accum_steps  # per GPU per step
    attention = calibration.attention_a100 if gpu == "A100" else calibration.attention
    compute_s = tokens * seconds_per_token(
        recipe, estimate, peak, attention, spec.hbm_gb_s * 1e9, calibration, recomputed
    )
    # QLoRA: each NF4 weight is read and written out in the compute dtype, which its matmul reads, in forward, in
    # backward, and again where backward recomputes its matmul (all of them under full AC), every micro-step.
    passes = data.grad_accum_steps * (2 + recomputed)
    compute_s += passes * estimate.quantized * DEQUANTIZED_BYTES / (spec.hbm_gb_s * 1e9)
    intra_gb = estimate.sent_gb - estimate.internode_gb
    comm_s = intra_gb / (spec.nvlink_gb_s * LINK_EFFICIENCY) + estimate.internode_gb / (
        spec.network_gb_s * LINK_EFFICIENCY
    )
    exposed = comm_s / cfg.n_layers + max(0.0, comm_s - compute_s)
    # The state is 16 bytes per trained parameter (LoRA: plus the frozen weights, which the step does not touch).
    optimizer_s = estimate.state_gb * ADAM_BYTES / 16 / spec.hbm_gb_s
    sampling_s = sampling_seconds(recipe, peak, spec.hbm_gb_s * 1e9, calibration)
    step_s = compute_s + exposed + optimizer_s + sampling_s
    per_gpu = tokens / step_s
    model_flops = flops_per_token(cfg, data.seq_len)
    return StepTime(compute_s, comm_s, exposed, optimizer_s, step_s, per_gpu, per_gpu * model_flops / peak, sampling_s)


def sampling_seconds(recipe: Recipe, peak: float, hbm: float, calibration: Calibration) -> float:
    """An online kind's sampling a step, on one GPU: each batch's prompts read at their matmuls' efficiency, then a
    pass a new token that reads every weight in the compute dtype and the KV cache so far (half of it on average) over
    HBM, or computes its rows' matmuls at the peak, whichever takes longer (a decode pass is bound by the bytes)."""
    shape = training_kind(recipe).sampling(recipe)
    if shape is None:
        return 0.0
    cfg, params = recipe.model, count_params(recipe.model)
    a = compute_dtype(precision_on(recipe.parallel.mixed_precision, "cuda")[0]).itemsize
    prompt_tokens = shape.prompts * max(1, shape.positions - shape.new_tokens)
    prefill = 2 * params * prompt_tokens / (peak * matmul_efficiency(prompt_tokens, peak, hbm, calibration))
    read = a * params + kv_cache_bytes(cfg, shape.rows, shape.positions, a) / 2
    decode = max(read / hbm, 2 * params * shape.rows / peak)
    return shape.share * shape.batches * (prefill + shape.new_tokens * decode)


def seconds_per_token(
    recipe: Recipe,
    estimate,
    peak: float,
    attention_fraction: float,
    hbm: float,
    calibration: Calibration,
    recomputed: float | None = None,
) -> float:
    """A token's compute in a planner row on one GPU of dense `peak` FLOP/s and `hbm` bytes/s: its matmuls at their
    size's efficiency, `recomputed` of the forward's again in backward, its attention at `attention_fraction` of the
    peak, its elementwise and loss bytes over HBM. `recomputed` None: what our AC mode recomputes (full: every
    matmul; selective, none: none)."""
    cfg, data, c, ac = recipe.model, recipe.data, calibration, estimate.ac
    recomputed = recomputed_share(ac) if recomputed is None else recomputed
    attention = attention_flops_per_token(cfg, data.seq_len)
    forward = (flops_per_token(cfg, data.seq_len) - attention) / 3  # 2 a weight a token
    # A frozen weight (LoRA) has no weight gradient: 4 FLOPs a token instead of 6. Backward recomputes `recomputed` of
    # the forward's matmuls; the kind's forwards without gradient (a reference's, a teacher's) come on top.
    passes = (2 if adapter_kind(recipe.lora) == "lora" else 3) + recomputed + estimate.frozen_forward
    if ac == "full":  # each block's forward again in backward, its attention too
        attention *= 4 / 3
    tokens, per_expert = matmul_tokens(recipe)
    # How evenly the router spreads the tokens over the experts does not change the sum: each expert's matmul costs
    # its weights' fixed bytes once and its tokens' FLOPs in proportion (while it has any).
    experts = expert_flops_per_token(cfg) / 3
    matmul = passes * (forward - experts) / (peak * matmul_efficiency(tokens, peak, hbm, c))
    matmul += passes * experts / (peak * matmul_efficiency(per_expert, peak, hbm, c))
    # Flash attention kernels come in head widths of multiples of 32 (FlashAttention 2: 32 to 256): a head of another
    # width is computed as the next one up (MPT-30B's 112 as 128).
    padded = math.ceil(cfg.resolved_head_dim / 32) * 32 / cfg.resolved_head_dim
    flash = attention * padded / 2 / (peak * attention_fraction)  # the causal half is skipped
    a = compute_dtype(precision_on(recipe.parallel.mixed_precision, "cuda")[0]).itemsize
    elementwise = c.elementwise * a * cfg.dim * cfg.n_layers * (c.compiled if recipe.parallel.compile else 1.0)
    elementwise *= 4 / 3 if ac != "none" else 1.0  # AC recomputes them
    return matmul + flash + (elementwise + LOGIT_BYTES * cfg.output_size) / hbm


def peak_flops(recipe: Recipe, gpu: str) -> float:
    """The dense peak FLOP/s of `gpu` in the precision the recipe computes in on a GPU."""
    return PEAK_FLOPS[gpu][precision_on(recipe.parallel.mixed_precision, "cuda")[0]]


def matmul_tokens(recipe: Recipe) -> tuple[int, float]:
    """The tokens that share a weight in a micro-batch's matmuls, which set their efficiency: the micro-batch's, and
    a routed expert's, top_k / experts of them on average (the micro-batch's in a dense model); under expert
    parallelism N, an expert takes the copies routed to it from the N ranks of its group, N times as many, for the
    same FLOPs a rank (its E / N experts)."""
    cfg, tokens = recipe.model, rank_tokens(recipe)
    if cfg.moe is None:
        return tokens, tokens
    return tokens, tokens * cfg.moe.top_k / cfg.moe.experts * recipe.parallel.expert_parallel


def recomputed_share(ac: str) -> float:
    """The share of a block's forward matmuls that backward runs again under our AC mode `ac`: full recomputes every
    one; selective keeps every matmul's output, and none keeps everything."""
    return 1.0 if ac == "full" else 0.0


def matmul_efficiency(tokens: float, peak: float, hbm: float, calibration: Calibration = CALIBRATION) -> float:
    """The fraction of the dense `peak` a micro-batch of `tokens` reaches in its matmuls on a GPU of `hbm` bytes/s: the
    more tokens share each weight's bytes, the closer to matmul_peak. The micro-batch at half of it scales with the
    GPU's ridge point (peak / bandwidth): a GPU whose compute outruns its memory further needs more tokens to be fed."""
    half = calibration.matmul_half * peak / hbm
    return calibration.matmul_peak * tokens / (tokens + half)
