"""What a block keeps for its backward, per token: the planner's activation memory (plan.py), by AC mode, counted
from what autograd saves in model.py's and moe.py's forward (tests/test_plan.py checks it against a real forward)."""

from __future__ import annotations

import torch

from fsdp_trainer.config import LoraConfig, ModelConfig, Recipe
from fsdp_trainer.distributed.parallelize import WIDENING, uses_flex_attention
from fsdp_trainer.moe import moe_layers
from fsdp_trainer.steps import training_kind


def rank_tokens(recipe: Recipe) -> int:
    """The tokens a rank's micro-batch holds: the kind's rows of data.seq_len, 1 / N of each under context
    parallelism (parallel.context_parallel N)."""
    return training_kind(recipe).trained_rows(recipe) * recipe.data.seq_len // recipe.parallel.context_parallel


def activation_bytes_per_token(
    cfg: ModelConfig, compute_bytes: int, ac: str, lora: LoraConfig | None = None
) -> tuple[float, float]:
    """(bytes saved per token by each layer, bytes per token of one layer's full activations).

    Counted from what autograd keeps in model.py's Block (tests/test_plan.py checks it against a real forward): each
    RMSNorm its input and (lean_autograd.rms_norm) an fp32 reciprocal RMS a row, and the matmul after it its output
    (2ad for the two); attention the rotated q and k, v and the output (a(2q + 2kv), q = n_heads x head_dim) plus the
    log-sum-exp; the SwiGLU gate and up (lean_autograd.gated) and the product (3af); Qwen3's and Gemma 3's RMSNorm on
    each query and key head its input (a(q + kv)), its output going to the rotation, which keeps nothing of it. Gemma
    3's four norms keep their inputs, and the two before a matmul their outputs are kept by it (6ad). A mixture of
    experts' layer: moe_feed_forward. Selective AC keeps the block input and the matmul and attention outputs, and of
    each projection `lora` adapts two matmuls more: its adapter's A (rank wide) and B (as wide as the projection's
    output) unless B widens more than parallelize.WIDENING (then recomputed), for an expert adapter each token copy's;
    full AC only the block input.
    """
    a, d, f, h = compute_bytes, cfg.dim, cfg.ffn_dim, cfg.n_heads
    q = cfg.n_heads * cfg.resolved_head_dim
    kv = cfg.n_kv_heads * cfg.resolved_head_dim
    gemma3 = cfg.family == "gemma3"
    small = (16 if gemma3 else 8) + 4 * h  # RMSNorm's fp32 rsqrt per norm, attention's fp32 log-sum-exp per head
    # Each norm keeps its input; the matmuls after the two pre-norms keep their outputs (Gemma 3's post-norms' go to
    # the residual stream, which keeps nothing).
    norms = 6 * a * d if gemma3 else 4 * a * d
    feed_forward, kept = 3 * a * f, 2 * a * f  # all it keeps; what selective AC keeps (gate and up outputs)
    if cfg.moe is not None:  # the mean over the layers, of which some mixtures of experts (moe_feed_forward)
        share, (routed, routed_kept) = len(moe_layers(cfg)) / cfg.n_layers, moe_feed_forward(cfg, a)
        feed_forward, kept = (1 - share) * feed_forward + share * routed, (1 - share) * kept + share * routed_kept
    full = norms + a * (2 * q + 2 * kv) + feed_forward + small
    if cfg.qk_norm:
        full += a * (q + kv) + 4 * (h + cfg.n_kv_heads)  # and an fp32 rsqrt per head
    saved = {"none": full, "full": a * d, "selective": a * (3 * d + 2 * q + 2 * kv) + kept + 4 * h}
    if lora is not None and lora.rank is not None:
        widths = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": d, "gate_proj": f, "up_proj": f, "down_proj": d}
        adapted = [widths[target] for target in lora.targets if target in widths]
        saved["selective"] += a * sum(kept_by_adapter(lora.rank, width) for width in adapted)
        if cfg.moe is not None and "experts" in lora.targets:  # each copy's two grouped matmuls a projection more
            k, share = cfg.moe.top_k, len(moe_layers(cfg)) / cfg.n_layers
            per_copy = kept_by_adapter(lora.rank, 2 * cfg.moe.ffn_dim) + kept_by_adapter(lora.rank, d)
            saved["selective"] += share * a * k * per_copy
    return saved[ac], full


def attention_mask_bytes(recipe: Recipe, compute_bytes: int, device: str) -> int:
    """Bytes every windowed layer's backward reads in one tensor: a sliding window shorter than the sequence, attended
    eagerly (a CPU, or a GPU without compile), goes through the additive mask of every query and key, T x T in the
    compute dtype, made once a forward (model.additive). Compiled on a GPU, flex_attention's block mask: a few bytes a
    128 x 128 block, none counted."""
    window, seq_len = recipe.model.sliding_window, recipe.data.seq_len
    dense = not uses_flex_attention(recipe.parallel, torch.device(device))
    return compute_bytes * seq_len * seq_len if dense and window and window < seq_len else 0


def adapter_copies_per_block(cfg: ModelConfig, compute_bytes: int, ac: str, lora: LoraConfig | None = None) -> float:
    """Bytes a layer keeps for backward whatever its tokens (the mean over the layers): with adapters on a mixture's
    experts and no AC, where the rank is narrower than 16 bytes a row, the zero-padded copies of their factors that
    each grouped matmul keeps (ExpertsAdapter.factors), (2 x ffn + dim) + (dim + ffn) x the padded rank a expert for
    gate_up's and down's A and B; none at a wider rank (the matmuls keep the factors themselves). Checkpointing
    recomputes them: a copy is no matmul's output."""
    if ac != "none" or cfg.moe is None or lora is None or lora.rank is None or "experts" not in lora.targets:
        return 0.0
    a, d, experts, ffn = compute_bytes, cfg.dim, cfg.moe.experts, cfg.moe.ffn_dim
    padded = lora.rank + -lora.rank % (16 // a)
    copied = (2 * ffn + d) + (d + ffn) if padded != lora.rank else 0
    return len(moe_layers(cfg)) / cfg.n_layers * a * experts * padded * copied


def kept_by_adapter(rank: int, width: int) -> int:
    """Values a token of a projection `width` wide keeps under selective AC for its LoRA adapter: A's output (rank
    wide), and B's (the projection's width) unless B widens more than parallelize.WIDENING, when it is recomputed."""
    return rank + (0 if width > WIDENING * rank else width)


def moe_feed_forward(cfg: ModelConfig, a: int) -> tuple[float, float]:
    """(bytes a token keeps in a mixture of experts' layer (moe.py), what selective AC keeps of them). For its k
    copies: the gathered input, the gate_up output, the product and the down output, and its routing weight
    (a(3kd + 3kI + k)); the fp32 router probabilities (4E); the top-k indices and values, the sort order and each
    copy's token (28k), and the weights' sum (4). Selective AC keeps the matmuls' outputs: the router logits,
    gate_up and the experts' outputs (a(E + 2kI + kd))."""
    k, ffn, d, experts = cfg.moe.top_k, cfg.moe.ffn_dim, cfg.dim, cfg.moe.experts
    full = 4 * experts + 28 * k + 4 + a * (3 * k * d + 3 * k * ffn + k)
    return full, a * (experts + 2 * k * ffn + k * d)


def context_parallel_bytes(
    recipe: Recipe, compute_bytes: int, ac: str, device: str
) -> tuple[float, float, float, float]:
    """Under context parallelism (parallel.context_parallel N > 1: distributed/context_parallel.py), what a rank holds
    and sends beyond its 1 / N of each window's tokens: (bytes a layer keeps more, bytes a block's backward holds more,
    the masks' bytes, bytes sent per micro-step). Attention keeps the whole window's gathered keys and values in place
    of its own (rows x T x 2kv x a, without AC: checkpointing gathers them again); a block's backward holds them and
    their gradient; attended eagerly (a CPU, a GPU without compile), a run's T / 2N queries read an additive mask of the
    keys they may see, made once a forward (a packed window's B of them: the plan counts one; flex_attention's block
    masks, compiled on a GPU: a few bytes, none counted). Each layer's gather sends (N - 1) / N of them, its
    backward's reduce-scatter as much, a recomputation gathers them again."""
    n = recipe.parallel.context_parallel
    if n == 1:
        return 0.0, 0.0, 0.0, 0.0
    cfg, seq_len = recipe.model, recipe.data.seq_len
    rows = recipe.data.micro_batch_size
    gathered = compute_bytes * rows * seq_len * 2 * cfg.n_kv_heads * cfg.resolved_head_dim
    chunk, window = seq_len // (2 * n), cfg.sliding_window
    keys = [min(end, window + chunk - 1) if window else end for end in (chunk, seq_len)]  # rank 0's runs, the most
    dense = not uses_flex_attention(recipe.parallel, torch.device(device))
    mask = compute_bytes * chunk * sum(keys) if dense else 0.0
    sent = cfg.n_layers * (2 + (ac != "none")) * gathered * (n - 1) / n
    return (gathered * (n - 1) / n if ac == "none" else 0.0), 2 * gathered, mask, sent
