"""The memory planner: its terms against what the model really saves for backward, and its recommendation."""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import subprocess
from collections import namedtuple

import pytest
import torch

from fsdp_trainer.adapters.lora import apply_lora
from fsdp_trainer.config import ModelConfig, MoEConfig, Recipe, parse_recipe
from fsdp_trainer.lean_autograd import plain_gated, plain_rms_norm
from fsdp_trainer.metrics import PEAK_FLOPS, attention_flops_per_token, flops_per_token
from fsdp_trainer.model import Transformer, count_params
from fsdp_trainer.planner.activations import activation_bytes_per_token
from fsdp_trainer.planner.memory import estimate
from fsdp_trainer.planner.plan import HEADROOM, SAME_STEP, plan, recommend
from fsdp_trainer.planner.speed import CALIBRATION, GPUS, matmul_efficiency, seconds_per_token, step_time
from tests.helpers import REPO, forked

shutil_usage = namedtuple("usage", "total used free")


def _saved_bytes_of_one_block(cfg: ModelConfig, dtype: torch.dtype, tokens: tuple[int, int]) -> int:
    """Bytes autograd keeps for backward in one block's forward: distinct storages, parameters and RoPE tables
    excluded (they exist anyway)."""
    model = Transformer(cfg)
    model.init_weights(seed=0)
    model.to(dtype)
    block = model.model.layers["0"]
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    B, T = tokens
    x = torch.randn(B, T, cfg.dim, dtype=dtype, requires_grad=True)
    cos, sin = model.rope_cos[:T].to(dtype), model.rope_sin[:T].to(dtype)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin)
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "shape",
    [
        dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=160),
        dict(dim=96, n_heads=6, n_kv_heads=6, ffn_dim=256),
        dict(family="qwen3", dim=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=160),  # QK-norm, q wider than d
        # Gemma 3: four norms that scale by 1 + weight in fp32, QK-norm too, GELU, its own attention scale
        dict(family="gemma3", dim=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=160, query_pre_attn_scalar=24),
        # Qwen3-MoE: a router and top-3 of 8 experts in place of the feed-forward
        dict(
            family="qwen3_moe",
            dim=64,
            n_heads=4,
            n_kv_heads=2,
            head_dim=32,
            moe=MoEConfig(experts=8, top_k=3, ffn_dim=32),
        ),
    ],
)
def test_activation_formula_counts_what_a_block_saves(dtype, shape):
    cfg = ModelConfig(n_layers=1, vocab_size=32, max_seq_len=64, **shape)
    B, T = 2, 64
    measured = _saved_bytes_of_one_block(cfg, dtype, (B, T))
    if cfg.moe is not None:  # the experts' offsets, and on a CPU the experts' weights copied for its grouped matmul
        experts, ffn = cfg.moe.experts, cfg.moe.ffn_dim
        measured -= 4 * experts + dtype.itemsize * experts * 3 * ffn * cfg.dim
    per_token, _ = activation_bytes_per_token(cfg, dtype.itemsize, "none")
    assert per_token * B * T == measured


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_block_keeps_less_for_backward_than_its_ops_would(dtype, monkeypatch):
    """A Llama block's norms keep their input alone (lean_autograd), not its fp32 copy and the normalized input too,
    and its SwiGLU gate and up, not silu(gate) too: 8 x dim bytes a token less (two norms' fp32 input, or in fp32 the
    normalized input) and the gate's width in the compute dtype, than autograd keeps for the same ops."""
    cfg = ModelConfig(n_layers=1, vocab_size=32, max_seq_len=64, dim=64, n_heads=4, n_kv_heads=2, ffn_dim=160)
    lean = _saved_bytes_of_one_block(cfg, dtype, (2, 64))
    monkeypatch.setattr("fsdp_trainer.model.rms_norm", plain_rms_norm)
    monkeypatch.setattr("fsdp_trainer.model.gated", plain_gated)
    assert _saved_bytes_of_one_block(cfg, dtype, (2, 64)) - lean == 2 * 64 * (
        8 * cfg.dim + dtype.itemsize * cfg.ffn_dim
    )


def test_state_follows_zero_formulas_and_sharding_order():
    recipe = Recipe()
    n_params, n_block = count_params(recipe.model), count_params(recipe.model, one_block=True)
    assert 0 < n_block < n_params
    for sharding, group in (("FULL_SHARD", 8), ("SHARD_GRAD_OP", 8), ("NO_SHARD", 1), ("HYBRID_SHARD", 4)):
        e = estimate(recipe, nproc=4, nnodes=2, sharding=sharding, ac="none", device="cuda")
        assert e.state_gb == pytest.approx(16 * n_params / group / 1e9)
    # Each prefetched block is one more gathered bf16 block.
    recipe.parallel.prefetch_blocks = 3
    deeper = estimate(recipe, nproc=4, nnodes=2, sharding="FULL_SHARD", ac="none", device="cuda")
    recipe.parallel.prefetch_blocks = 1
    e = estimate(recipe, nproc=4, nnodes=2, sharding="FULL_SHARD", ac="none", device="cuda")
    assert deeper.gathered_gb - e.gathered_gb == pytest.approx(2 * 2 * n_block / 1e9)
    by_key = {(e.sharding, e.ac, e.offload): e for e in plan(recipe, nproc=4, nnodes=2, device="cuda")}
    assert len(by_key) == 30  # 5 shardings x 3 AC modes x offload or not
    by_key = {(sharding, ac): e for (sharding, ac, offload), e in by_key.items() if not offload}
    assert by_key["FULL_SHARD", "none"].gathered_gb < by_key["SHARD_GRAD_OP", "none"].gathered_gb
    assert by_key["FULL_SHARD", "full"].activations_gb < by_key["FULL_SHARD", "selective"].activations_gb
    assert by_key["FULL_SHARD", "selective"].activations_gb < by_key["FULL_SHARD", "none"].activations_gb
    # The recommendation is the least recomputation, then the fewest bytes between nodes, then sent, that fits.
    estimates = plan(recipe, nproc=4, nnodes=2, device="cuda")
    best = recommend(estimates, 1e9)
    assert (best.sharding, best.ac) == ("HYBRID_SHARD", "none") and best.internode_gb < best.sent_gb
    # A row that fits only within HEADROOM of the device is taken when nothing leaves that room.
    tight = by_key["FULL_SHARD", "none"].total_gb
    roomy = recommend(estimates, tight / (1 - HEADROOM))
    assert (roomy.sharding, roomy.ac) == ("FULL_SHARD", "none")
    edge = recommend(estimates, tight, headroom=0.0)
    assert (edge.sharding, edge.ac) == ("FULL_SHARD", "none")
    assert recommend(estimates, tight).ac != "none" and recommend(estimates, tight).total_gb <= (1 - HEADROOM) * tight
    assert recommend(estimates, 0.0) is None


@pytest.mark.parametrize(
    "precision, accum, best",
    # bf16 + fp32 reduction: ZeRO-2 sends (2 + 4)P, DDP and ZeRO-3 8P; fp32: ZeRO-2 and DDP 8P (the tie goes to the
    # smaller), ZeRO-3 12P; ZeRO-1 equals ZeRO-2 without accumulation (the tie goes to the first listed). Accumulating
    # 4 micro-steps re-gathers parameters and reduce-scatters gradients 4 times under ZeRO-2/3 (keeping them
    # sharded), which DDP never does and ZeRO-1 does once: ZeRO-1 then ties with DDP at 8P and holds less.
    [("bf16", 1, "SHARD_GRAD_OP"), ("fp32", 1, "SHARD_GRAD_OP"), ("fp32", 4, "SHARD_OP")],
)
def test_communication_volume_orders_the_one_node_choice(precision, accum, best):
    recipe = Recipe()
    recipe.parallel.mixed_precision, recipe.data.grad_accum_steps = precision, accum
    n_params = count_params(recipe.model)
    estimates = {
        e.sharding: e for e in plan(recipe, nproc=8, nnodes=1, device="cuda") if e.ac == "none" and not e.offload
    }
    a = 2 if precision == "bf16" else 4
    assert estimates["NO_SHARD"].sent_gb == pytest.approx(8 * n_params * 7 / 8 / 1e9)
    regathered = (recipe.model.n_layers - 1) * count_params(recipe.model, one_block=True)  # all blocks but the last
    gathered = accum * a * (n_params + regathered)
    assert estimates["FULL_SHARD"].sent_gb == pytest.approx((gathered + accum * 4 * n_params) * 7 / 8 / 1e9)
    assert estimates["SHARD_OP"].sent_gb == pytest.approx((a + 4) * n_params * 7 / 8 / 1e9)  # whatever accum is
    # Unsharded fp32 gradients over the micro-steps, where the gradient shard holds nothing until the last reduction.
    accumulated = 4 * n_params * 7 / 8 / 1e9 if accum > 1 else 0
    assert estimates["SHARD_OP"].accumulated_gb == pytest.approx(accumulated)
    assert estimates["FULL_SHARD"].accumulated_gb == estimates["SHARD_GRAD_OP"].accumulated_gb == 0  # kept sharded
    assert estimates["NO_SHARD"].accumulated_gb == 0  # its gradients are whole anyway
    # Accumulated unsharded instead (parallel.accumulate_unsharded), ZeRO-3 reduce-scatters once and holds them.
    recipe.parallel.accumulate_unsharded = True
    once = estimate(recipe, nproc=8, nnodes=1, sharding="FULL_SHARD", ac="none", device="cuda")
    assert once.sent_gb == pytest.approx((gathered + 4 * n_params) * 7 / 8 / 1e9)
    assert once.accumulated_gb == pytest.approx(accumulated)
    if precision == "fp32" and accum == 1:  # 12P less the last block's and the root's backward gathers, against 8P
        assert estimates["NO_SHARD"].sent_gb < estimates["FULL_SHARD"].sent_gb < 1.5 * estimates["NO_SHARD"].sent_gb
    assert all(e.internode_gb == 0 for e in estimates.values())
    assert recommend(list(estimates.values()), 1e9).sharding == best


def test_chunked_loss_counts_one_slice_of_logits_beside_the_output_layers_weight_gradient():
    """The output layer's backward holds one slice's logits, 12 bytes a token and class, and, when the layer trains,
    its unsharded weight gradient in the compute dtype, which each slice's backward adds into (twice while a slice's
    own is added, with 8 bytes a token and class left; three times while the two are summed into a new one); LoRA's
    frozen output layer has none."""
    recipe = Recipe()
    tokens, vocab = recipe.data.micro_batch_size * recipe.data.seq_len, recipe.model.vocab_size
    head = 2 * vocab * recipe.model.dim  # bf16 on a GPU

    def planned(slice_tokens: int, head_gradient: int) -> float:
        logits = slice_tokens * vocab
        return max(12 * logits + head_gradient, 8 * logits + 2 * head_gradient, 3 * head_gradient) / 1e9

    whole = estimate(recipe, nproc=2, nnodes=1, sharding="FULL_SHARD", ac="none", device="cuda")
    assert whole.logits_gb == pytest.approx(planned(tokens, head))
    recipe.train.loss_chunks = 64  # slices small enough that the weight gradient counts twice
    assert 8 * math.ceil(tokens / 64) * vocab + head > 12 * math.ceil(tokens / 64) * vocab
    sliced = estimate(recipe, nproc=2, nnodes=1, sharding="FULL_SHARD", ac="none", device="cuda")
    assert sliced.logits_gb == pytest.approx(planned(math.ceil(tokens / 64), head))
    assert sliced.total_gb < whole.total_gb and sliced.state_gb == whole.state_gb
    recipe.train.loss_chunks = tokens  # a token a slice: the sum of two weight gradients is the larger
    single = estimate(recipe, nproc=2, nnodes=1, sharding="FULL_SHARD", ac="none", device="cuda")
    assert single.logits_gb == pytest.approx(3 * head / 1e9) == pytest.approx(planned(1, head))
    recipe.lora.rank, recipe.train.loss_chunks = 8, 64
    frozen = estimate(recipe, nproc=2, nnodes=1, sharding="FULL_SHARD", ac="none", device="cuda")
    assert frozen.logits_gb == pytest.approx(planned(math.ceil(tokens / 64), 0))


def test_small_slices_of_the_logits_peak_where_two_weight_gradients_are_summed():
    """Small slices of a large vocabulary: the peak is the output layer's backward summing a slice's weight gradient
    into the accumulated one, three of them at once (the plan priced two: 0.85 of the step on fake tensors)."""
    from fsdp_trainer.planner.fake import measured_peak_gb

    recipe = parse_recipe(["--recipe", str(REPO / "recipes" / "debug.yaml"), "--model.n_layers", "2",
                           "--model.vocab_size", "65536", "--train.loss_chunks", "64", "--parallel.mixed_precision",
                           "fp32", "--parallel.activation_checkpointing", "full"])  # fmt: skip
    row = estimate(recipe, nproc=2, nnodes=1, sharding="FULL_SHARD", ac="full", device="cuda")
    assert row.logits_gb == pytest.approx(3 * 4 * 65536 * recipe.model.dim / 1e9)
    assert (row.total_gb - row.runtime_gb) / measured_peak_gb(recipe, 2, 1) == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_OP", "NO_SHARD"])
@pytest.mark.parametrize("accum", [1, 8])
def test_cpu_offload_moves_the_state_to_the_host_for_copies_every_step(sharding, accum):
    """On a GPU, offload takes the 16 bytes of state per parameter (/ S) off the device and onto the host, and copies
    the fp32 shards to the device for every all-gather and their fp32 gradients back at every reduction (each
    micro-step's under ZeRO-3, once a step under ZeRO-1 and DDP); on a CPU, host and device are one memory, so there
    is nothing to move and the plan does not list it."""
    recipe = Recipe()
    recipe.data.grad_accum_steps = accum
    n_params, world = count_params(recipe.model), 4
    shard_group = 1 if sharding == "NO_SHARD" else world
    kept = estimate(recipe, nproc=world, nnodes=1, sharding=sharding, ac="selective", device="cuda")
    moved = estimate(recipe, nproc=world, nnodes=1, sharding=sharding, ac="selective", device="cuda", offload=True)
    assert moved.host_gb == pytest.approx(kept.state_gb) == pytest.approx(16 * n_params / shard_group / 1e9)
    # Accumulating unsharded (ZeRO-1), the device holds the whole unsharded gradients either way; kept on it, the
    # state's gradient shard holds nothing until they are reduced, so they add 4P/S less.
    unsharded = 4 * n_params / shard_group / 1e9 if sharding == "SHARD_OP" and accum > 1 else 0
    assert moved.accumulated_gb == pytest.approx(kept.accumulated_gb + unsharded)
    # Without accumulation the peak (the start of backward) comes before any gradient shard exists: the state there
    # is what the step did not free.
    before_gradients = kept.state_gb - (4 * n_params / shard_group / 1e9 if accum == 1 else 0)
    assert kept.late_gradients_gb == pytest.approx(kept.state_gb - before_gradients) and moved.late_gradients_gb == 0
    assert moved.state_gb == 0 and moved.total_gb == pytest.approx(kept.total_gb - before_gradients + unsharded)
    regathered = (recipe.model.n_layers - 1) * count_params(recipe.model, one_block=True)
    gathered = {"FULL_SHARD": accum * (n_params + regathered), "SHARD_OP": n_params, "NO_SHARD": accum * n_params}
    reduced = accum * n_params if sharding == "FULL_SHARD" else n_params
    assert moved.host_traffic_gb == pytest.approx(4 * (gathered[sharding] + reduced) / shard_group / 1e9)
    assert moved.sent_gb == kept.sent_gb and kept.host_gb == kept.host_traffic_gb == 0
    on_cpu = estimate(recipe, nproc=world, nnodes=1, sharding=sharding, ac="selective", device="cpu", offload=True)
    assert on_cpu.host_gb == on_cpu.host_traffic_gb == 0 and on_cpu.state_gb == kept.state_gb
    assert not any(e.offload for e in plan(recipe, nproc=world, nnodes=1, device="cpu"))


def test_offload_is_recommended_only_when_nothing_else_fits():
    """The 8b recipe on one GPU: its 128 GB of state fit no 80 GB device, so offload is the way, if the host can
    hold the state; at 200 GB per device it fits without, and the planner does not offload."""
    estimates = plan(parse_recipe(["--recipe", str(REPO / "recipes" / "8b.yaml")]), nproc=1, nnodes=1, device="cuda")
    best = recommend(estimates, 80, host_mem_gb=1000)
    assert best.offload and best.total_gb <= 80 and best.host_gb > 80
    assert recommend(estimates, 80, host_mem_gb=100) is None  # nor does the host hold it
    assert not recommend(estimates, 200, host_mem_gb=1000).offload


def plan_cli(*args) -> subprocess.CompletedProcess:
    """`python -m fsdp_trainer.planner.plan *args`, forked (tests/helpers/forked.py)."""
    return forked.run("fsdp_trainer.planner.plan", list(args), timeout=1800)


def test_plan_cli_recommends_or_says_what_to_change():
    cmd = ["--recipe", str(REPO / "recipes" / "8b.yaml"), "--nproc", "8", "--device", "cuda", "--host_mem_gb", "8"]
    fits = plan_cli(*cmd, "--device_mem_gb", "80")
    assert fits.returncode == 0, fits.stderr
    assert "| FULL_SHARD | full |" in fits.stdout and "recommended: --parallel.sharding " in fits.stdout
    assert "| FULL_SHARD + offload | full |" in fits.stdout
    tiny = plan_cli(*cmd, "--device_mem_gb", "8")
    assert tiny.returncode == 1 and tiny.stderr.startswith("nothing fits in 8.0 GB per device")
    # 16 GB: ZeRO-3 + full AC needs 27, 11 with the state on the host, where 64 GB hold its 16 (and 8 do not).
    offload = plan_cli(*cmd[:-1], "64", "--device_mem_gb", "16")
    assert offload.returncode == 0, offload.stderr
    assert "--parallel.cpu_offload true" in offload.stdout
    negative = plan_cli(*cmd[:-1], "0", "--device_mem_gb", "16")
    assert negative.returncode == 1 and negative.stderr == "error: --host_mem_gb must be positive, not 0.0\n"
    # A distillation is sized with its teacher, read from the teacher's checkpoint: one that is not there is one line.
    distill = ["--recipe", str(REPO / "recipes" / "distill_qwen3_8b_to_0.6b.yaml"), "--gpu", "H100", "--nproc", "8"]
    missing = plan_cli(*distill, "--distill.teacher", "/nonexistent/teacher")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1, missing.stderr
    assert missing.stderr.startswith("error: distill.teacher: checkpoint /nonexistent/teacher does not exist")


def test_muon_state_is_one_buffer_per_block_matrix():
    """optim.name=muon: 4 bytes of momentum per weight of the blocks' projections, AdamW's 8 for the rest, beside the
    fp32 weight and gradient (8 bytes), all / 2 ranks."""
    recipe = Recipe()
    recipe.optim.name = "muon"
    n_params = count_params(recipe.model)
    with torch.device("meta"):
        named = Transformer(recipe.model).named_parameters()
        projections = sum(p.numel() for n, p in named if n.endswith("_proj.weight"))
    e = estimate(recipe, nproc=2, nnodes=1, sharding="FULL_SHARD", ac="none", device="cuda")
    assert e.state_gb == pytest.approx((8 * n_params + 4 * projections + 8 * (n_params - projections)) / 2 / 1e9)
    assert 0 < projections < n_params
    # The step's exchange: 12 bytes per matrix weight / 2, and the iteration on the largest (the feed-forward's).
    m, n = sorted((recipe.model.dim, recipe.model.ffn_dim))
    assert e.optimizer_step_gb == pytest.approx((12 * projections / 2 + 4 * (3 * m * n + 3 * m * m)) / 1e9)
    recipe.optim.name = "adamw"  # fused, in place
    assert estimate(recipe, nproc=2, nnodes=1, sharding="FULL_SHARD", ac="none", device="cuda").optimizer_step_gb == 0


def test_lora_prices_frozen_weights_without_gradients_or_optimizer_state():
    """With adapters, the frozen weights are held in the compute dtype (bf16 on these GPUs) and only the adapters have
    fp32 master weights, gradients, AdamW state, accumulated gradients and reduce-scattered bytes."""
    recipe = parse_recipe(["--recipe", str(REPO / "recipes" / "8b.yaml"), "--lora.rank", "16"])
    full = Recipe(model=recipe.model, data=recipe.data)
    cfg, r = recipe.model, 16
    q, kv = cfg.n_heads * cfg.resolved_head_dim, cfg.n_kv_heads * cfg.resolved_head_dim
    shapes = [
        (cfg.dim, q),
        (cfg.dim, kv),
        (cfg.dim, kv),
        (q, cfg.dim),
        *[(cfg.dim, cfg.ffn_dim)] * 2,
        (cfg.ffn_dim, cfg.dim),
    ]
    adapters = cfg.n_layers * sum(r * (i + o) for i, o in shapes)  # A: r x in, B: out x r, for each projection
    for sharding, group in (("FULL_SHARD", 8), ("NO_SHARD", 1)):
        e = estimate(recipe, nproc=8, nnodes=1, sharding=sharding, ac="full", device="cuda")
        assert e.state_gb == pytest.approx((2 * count_params(cfg) + (4 + 4 + 8) * adapters) / group / 1e9)
        assert e.state_gb < estimate(full, nproc=8, nnodes=1, sharding=sharding, ac="full", device="cuda").state_gb / 3
    accumulating = parse_recipe(["--recipe", str(REPO / "recipes" / "8b.yaml"), "--lora.rank", "16",
                                 "--data.grad_accum_steps", "2"])  # fmt: skip
    e = estimate(accumulating, nproc=8, nnodes=1, sharding="SHARD_OP", ac="full", device="cuda")
    assert e.accumulated_gb == pytest.approx(4 * adapters * 7 / 8 / 1e9)  # only the adapters', accumulated whole


@pytest.mark.parametrize("lora", [None, 16])
def test_a_preference_run_prices_its_reference_model(lora):
    """Full fine-tuning holds a frozen copy in bf16, sharded (2P/S bytes); with LoRA the reference is the policy with
    its adapters off (nothing held). Either way its forward gathers the model again each micro-step, 2P(S-1)/S bytes
    sent, and adds a third of a step's FLOPs (a forward, no backward) to the predicted step."""
    args = ["--recipe", str(REPO / "recipes" / "8b.yaml"), "--lora.rank", str(lora or "null")]
    args += ["--data.grad_accum_steps", "2"]
    plain, preference = parse_recipe(args), parse_recipe([*args, "--preference.loss", "sigmoid"])
    n = count_params(plain.model)
    with torch.device("meta"):  # what the reference's forward gathers: the adapters too (switched off, not dropped)
        gathered = Transformer(plain.model)
        if lora:
            apply_lora(gathered, plain.lora)
    gathered = sum(p.numel() for p in gathered.parameters())
    for sharding, group in (("FULL_SHARD", 8), ("NO_SHARD", 1)):
        a, b = (
            estimate(r, nproc=8, nnodes=1, sharding=sharding, ac="full", device="cuda") for r in (plain, preference)
        )
        assert b.state_gb == a.state_gb and a.reference_gb == 0
        assert b.reference_gb == pytest.approx(0 if lora else 2 * n / group / 1e9)
        assert b.total_gb == pytest.approx(a.total_gb + b.reference_gb)
        assert b.sent_gb == pytest.approx(a.sent_gb + 2 * 2 * gathered * (group - 1) / group / 1e9)
        slower, faster = (step_time(r, e, "H100", 8, 1) for r, e in ((preference, b), (plain, a)))
        data, cfg = plain.data, plain.model
        tokens = data.micro_batch_size * data.seq_len * data.grad_accum_steps
        weights = (flops_per_token(cfg, data.seq_len) - attention_flops_per_token(cfg, data.seq_len)) / 3  # 2 a weight
        micro_batch, peak = data.micro_batch_size * data.seq_len, PEAK_FLOPS["H100"]["bf16"]
        efficiency = peak * matmul_efficiency(micro_batch, peak, GPUS["H100"].hbm_gb_s * 1e9)
        assert slower.compute_s - faster.compute_s == pytest.approx(tokens * weights / efficiency)


def test_qlora_prices_the_adapted_projections_in_nf4_and_fits_8b_on_one_24gb_gpu():
    """QLoRA holds, gathers and sends the adapted projections at NF4's 0.5 + 1/64 bytes a weight; the rest of the
    frozen model (embeddings, norms, output layer) stays in the compute dtype. The 8b recipe fits one 24 GB GPU."""
    args = ["--recipe", str(REPO / "recipes" / "qlora_llama3_8b.yaml")]
    qlora, lora = parse_recipe(args), parse_recipe([*args, "--lora.quantize_base", "null"])
    cfg = qlora.model
    q, kv = cfg.n_heads * cfg.resolved_head_dim, cfg.n_kv_heads * cfg.resolved_head_dim
    projections = cfg.n_layers * (cfg.dim * (2 * q + 2 * kv) + 3 * cfg.dim * cfg.ffn_dim)
    one_gpu = [estimate(r, nproc=1, nnodes=1, sharding="FULL_SHARD", ac="full", device="cuda") for r in (qlora, lora)]
    assert one_gpu[1].state_gb - one_gpu[0].state_gb == pytest.approx((2 - (0.5 + 1 / 64)) * projections / 1e9)
    assert one_gpu[0].total_gb < 12 and one_gpu[1].total_gb > 19  # bf16 LoRA at the edge of the card, QLoRA not
    eight = [estimate(r, nproc=8, nnodes=1, sharding="FULL_SHARD", ac="full", device="cuda") for r in (qlora, lora)]
    assert eight[0].sent_gb < eight[1].sent_gb / 2  # the gathered projections travel in 4 bits


def test_the_disk_check_of_a_lora_run_asks_room_for_its_adapters_only(monkeypatch, tmp_path):
    from fsdp_trainer import build

    monkeypatch.setattr(build.shutil, "disk_usage", lambda path: shutil_usage(total=1e12, used=0, free=10e9))
    args = ["--recipe", str(REPO / "recipes" / "8b.yaml"), "--train.out_dir", str(tmp_path)]
    with pytest.raises(ValueError, match="has 10.0 GB free, and one checkpoint of this model takes 96.4 GB"):
        build.check_disk_room(parse_recipe(args))
    build.check_disk_room(parse_recipe([*args, "--lora.rank", "16"]))  # 42M adapters: 0.5 GB


def check_rows(stdout: str) -> list[list[str]]:
    """`plan --check`'s table: each row's sharding, AC, planned, measured and ratio cells."""
    check = stdout.split("| planned / measured |")[1]
    rows = [row for row in check.splitlines()[2:] if row.startswith("| ") and row.count(" | ") == 4]
    return [row.strip(" |").split(" | ") for row in rows]


MIXTURE = ["--model.family", "qwen3_moe", "--model.head_dim", "32", "--model.moe.experts", "8",
           "--model.moe.top_k", "2", "--model.moe.ffn_dim", "256"]  # fmt: skip
"""The debug recipe's widths as a mixture of 8 experts, top 2."""


KINDS = ["fine-tuning", "dpo", "lora", "lora-1", "qlora", "moe", "grpo", "context", "experts", "experts-lora"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_planner_agrees_with_a_step_on_fake_tensors_at_the_recipes_shapes(kind):
    """`plan --check` runs one step of each row on fake tensors and a fake process group (nothing allocated) and
    measures its peak with torch's FSDPMemTracker. The planner takes each term at its worst moment (logits at 12
    bytes an element, a whole block's backward, gradient buffers in two dtypes), so it may exceed the measured peak,
    by 4% at 8B on 64 ranks (docs/benchmarks.md), 10% at these shapes; it must not fall more than 5% below
    it, or a plan it calls a fit would not fit. A DPO step runs its reference's forward (a frozen copy) and the
    policy's, here over 2 micro-batches (the accumulated gradients counted). Under LoRA, selective AC keeps each
    adapter's two matmul outputs too (they once put its plan 20% under the step, 37% at Mistral-Nemo's shapes).
    QLoRA's step quantizes as a run does (it once measured bf16 LoRA). A mixture of experts with
    LoRA on its experts runs its grouped matmuls as a GPU would (selective AC keeps their outputs). The debug recipe's
    widths with two of its blocks: one that backward gathers again and the last, which stays gathered (each block is
    seconds of Python dispatch on fake tensors; more of them repeat the same terms). A GRPO step trains the G
    completions of each prompt (G x the micro-batch's windows) after what sampling them allocates (the model gathered
    whole, a KV cache, a decode pass's logits: the step on fake tensors rehearses it, since nothing can be drawn).
    Context parallelism: each rank's share of the windows, with the keys and values its attention gathers."""
    extra = {
        "grpo": [
            "--grpo.rewards",
            '[{function: "fsdp_trainer.rewards:exact_answer"}]',
            "--grpo.num_generations",
            "4",
            "--data.micro_batch_size",
            "2",
            "--grpo.max_completion_length",
            "64",
        ],  # fmt: skip
        "dpo": ["--preference.loss", "sigmoid", "--data.grad_accum_steps", "2"],
        # context parallelism over 2 of the 4 ranks: half of each 32,768-token window a rank (9.7 GB measured
        # against 17.5 at CP 1), the whole window's keys and values kept by each block's attention, its runs' masks
        "context": ["--parallel.context_parallel", "2", "--data.seq_len", "32768", "--model.max_seq_len", "32768"],
        # expert parallelism over 2 of the 4 ranks: each rank gathers its 4 of the 8 experts, over the 2 holding them;
        # the shardings it runs under (not NO_SHARD nor HYBRID_SHARD)
        "experts": [*MIXTURE, "--parallel.expert_parallel", "2"],
        # and LoRA on them: each rank's experts' adapters beside them
        "experts-lora": [
            *MIXTURE,
            "--parallel.expert_parallel",
            "2",
            "--lora.rank",
            "4",
            "--lora.targets",
            "[q_proj, v_proj, experts]",
        ],  # fmt: skip
        "lora": ["--lora.rank", "16", "--data.micro_batch_size", "8"],
        # one device: the frozen weights outside FSDP (a shard group of one), three rows, one per AC mode
        "lora-1": ["--lora.rank", "16", "--data.micro_batch_size", "8", "--nproc", "1", "--nnodes", "1"],
        # the projections held, gathered and sent in NF4, each rank storing its rows' parts alone; one node: k_proj's
        # two NF4 scale blocks split over 2 ranks, not 4
        "qlora": ["--lora.rank", "16", "--lora.quantize_base", "nf4", "--data.micro_batch_size", "8", "--nnodes", "1"],
        "moe": [
            *MIXTURE,
            "--lora.rank",
            "4",  # 8 bytes in bf16: padded to the 16 a GPU's grouped matmul wants (its meta kernel checks)
            "--lora.targets",
            "[q_proj, v_proj, experts]",
        ],  # fmt: skip
    }.get(kind, [])
    proc = plan_cli("--recipe", REPO / "recipes" / "debug.yaml", "--model.n_layers", "2", "--nproc", "2",
                    "--nnodes", "2", "--device", "cuda", "--device_mem_gb", "80", "--check", *extra)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = {(sharding, ac): float(ratio) for sharding, ac, _, _, ratio in check_rows(proc.stdout)}
    assert len(ratios) == {"lora-1": 3, "qlora": 12, "experts": 9, "experts-lora": 9}.get(
        kind, 15
    )  # 5 shardings (HYBRID: 2 nodes) x 3 AC
    assert all(0.95 <= ratio <= 1.1 for ratio in ratios.values()), ratios


def test_the_first_gather_holds_the_roots_and_the_blocks_all_gather_outputs_beside_their_copies():
    """FSDP2 keeps an all-gather's output until the next one is copied out: at the first block's gather, before any
    activation, the root's output and the block's are held beside both unsharded copies. With LoRA on a large untied
    vocabulary and few tokens that is the step's peak (the 8B recipe's shapes with bf16 LoRA on 8 ranks at 2 blocks:
    5.6 GB on fake tensors, planned 4.6 without it). Every sharded row's plan equals the step on fake tensors (0.76
    without it); NO_SHARD, where the frozen weights stay outside FSDP, is not below it."""
    proc = plan_cli("--recipe", REPO / "recipes" / "debug.yaml", "--model.n_layers", "2", "--nproc", "2",
                    "--nnodes", "2", "--device", "cuda", "--device_mem_gb", "80", "--check", "--model.vocab_size",
                    "65536", "--model.tie_embeddings", "false", "--lora.rank", "8", "--data.micro_batch_size", "1",
                    "--data.seq_len", "32")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = check_rows(proc.stdout)
    assert len(rows) == 15
    for sharding, ac, planned, measured, ratio in rows:
        assert 0.95 <= float(ratio) <= (math.inf if sharding == "NO_SHARD" else 1.05), (sharding, ac, planned, measured)


_8B = ["--recipe", str(REPO / "recipes" / "8b.yaml"), "--model.rope_scaling", "null"]
# What benchmarks/fit_speed.py found on the published runs it checks and was not fitted to, beside llm-foundry's it
# was fitted to: each within this error (docs/benchmarks.md has the table); the runs known to be further off with why.
OUTSIDE = {  # (model, GPU, GPUs, sequence length) -> the stated error
    # Slower than at 4096 by more than its own 1024 -> 2048 rows allow attention to cost (memory at the card's edge)
    ("30b", "H100", 8, 8192): 0.22,
    ("30b", "A100", 8, 8192): 0.28,
    # Slower a GPU at 512 and 1024 tokens than at 2048, unlike every other size; the 2048 row's configuration measured
    # 10% lower in another of llm-foundry's runs, and the same model ran faster at 512 on the slower A100 40GB.
    ("760m", "A100", 8, 512): 0.22,
}


def test_the_step_time_model_holds_on_published_runs():
    """llm-foundry's 110 runs (MPT 125M-70B, sequences of 512-65,536, H100 and A100, 8-64 GPUs) that fixed its
    constants, and llm-foundry's micro-batch sweep (1 to 6 sequences of 2,048) and torchtitan's, OLMo-core's and
    torchtune's (one GPU, LoRA and QLoRA among them) and a mixture of experts' (Qwen3-30B-A3B on B200s) that did not:
    each within 15% of its published tokens/s per GPU, or the stated error of the few known to be further off."""
    from fit_speed import at_the_cards_edge, errors, planned
    from published_runs import RUNS

    rows = planned(RUNS)
    within = 0
    for (run, _, row), error in zip(rows, errors(rows, CALIBRATION), strict=True):
        key = (run.model, run.gpu, run.gpus, run.seq_len)
        allowed = OUTSIDE.get(key, 0.15)
        assert abs(error) <= allowed, (run.name, error)
        within += abs(error) <= 0.15
        # The two at 8,192 tokens are the runs the planner puts within HEADROOM of the card, where `plan` warns that
        # the allocator's retries slow a step beyond its prediction.
        assert at_the_cards_edge(run, row) == (key[0] == "30b" and key[3] == 8192), run.name
    assert within >= 133 and len(rows) == 136


def test_the_step_time_model_on_a_stack_it_cannot_state():
    """llm-foundry's 78 runs on A100 40GB in pure bf16 (no fp32 master weights, bf16 reductions: not a stack our config
    states), priced on that card's datasheet by constants fitted to none of them: most within 15%, none past 20%."""
    from fit_speed import errors, planned
    from published_runs import LLM_FOUNDRY_A100_40GB_PURE

    rows = planned(LLM_FOUNDRY_A100_40GB_PURE)
    errs = errors(rows, CALIBRATION)
    assert len(rows) == 78 and sum(abs(e) <= 0.15 for e in errs) >= 73 and max(map(abs, errs)) <= 0.20


def test_a_matmul_runs_closer_to_peak_the_larger_it_is_and_never_past_it():
    """The step-time model's shape rule: a token's compute time falls as the micro-batch (and so each matmul) grows,
    towards the time at matmul_peak of the dense peak, never below it; attention, priced by the sequence, grows
    with it; compile moves fewer bytes."""
    recipe = parse_recipe([*_8B, "--parallel.compile", "false"])
    row = estimate(recipe, nproc=8, nnodes=1, sharding="FULL_SHARD", ac="none", device="cuda")
    peak, hbm = PEAK_FLOPS["H100"]["bf16"], 3.35e12
    cfg, c = recipe.model, CALIBRATION
    times = []
    for micro in (1, 2, 4, 16, 256):
        recipe.data.micro_batch_size = micro
        times.append(seconds_per_token(recipe, row, peak, c.attention, hbm, c))
    assert all(a > b for a, b in zip(times, times[1:], strict=False))
    weights = flops_per_token(cfg, recipe.data.seq_len) - attention_flops_per_token(cfg, recipe.data.seq_len)
    # Said in bytes: a micro-batch moves each weight's 2 * matmul_half / matmul_peak bytes over HBM in each of its
    # three passes (forward, input gradient, weight gradient) however many tokens it holds, on top of the FLOPs at
    # matmul_peak. One sequence a micro-batch against two: the difference is those bytes over one and over two.
    fixed = 3 * weights / 6 * 2 * c.matmul_half / c.matmul_peak / hbm
    seq = recipe.data.seq_len
    assert times[0] - times[1] == pytest.approx(fixed / seq - fixed / (2 * seq))
    infinite = dataclasses.replace(c, matmul_half=0.0)
    assert times[-1] > seconds_per_token(recipe, row, peak, c.attention, hbm, infinite)
    assert seconds_per_token(recipe, row, peak, c.attention, hbm, infinite) > weights / (peak * c.matmul_peak) * 0.9
    longer = copy.deepcopy(recipe)
    longer.data.seq_len, longer.model.max_seq_len = 16384, 16384
    assert seconds_per_token(longer, row, peak, c.attention, hbm, c) > times[-1]
    recipe.parallel.compile = True
    assert seconds_per_token(recipe, row, peak, c.attention, hbm, c) < times[-1]
    # Half of a forward's matmuls again (another framework's selective AC) costs half a forward at the same efficiency.
    micro_batch = recipe.data.micro_batch_size * recipe.data.seq_len
    half_again = seconds_per_token(recipe, row, peak, c.attention, hbm, c, recomputed=0.5)
    assert half_again - seconds_per_token(recipe, row, peak, c.attention, hbm, c) == pytest.approx(
        weights / 3 / 2 / (peak * matmul_efficiency(micro_batch, peak, hbm))
    )


def test_an_experts_matmuls_run_at_the_size_of_the_tokens_routed_to_it():
    """A routed expert's weights are shared by top_k / experts of the micro-batch's tokens, so its matmuls run at that
    size's efficiency: one expert chosen by every token prices as the dense feed-forward of its width (the router's
    one-column matmul aside); at the same FLOPs a token, more experts (fewer tokens each) make a token slower, and a
    longer micro-batch faster again."""
    dense = parse_recipe([*_8B, "--model.n_layers", "4", "--model.ffn_dim", "2048", "--data.micro_batch_size", "1"])

    def token_time(recipe: Recipe) -> float:
        row = estimate(recipe, nproc=8, nnodes=1, sharding="FULL_SHARD", ac="none", device="cuda")
        return seconds_per_token(recipe, row, PEAK_FLOPS["H100"]["bf16"], CALIBRATION.attention, 3.35e12, CALIBRATION)

    def routed(experts: int, top_k: int, micro_batch: int = 1) -> Recipe:
        recipe = copy.deepcopy(dense)
        recipe.model = dataclasses.replace(
            dense.model, family="qwen3_moe", moe=MoEConfig(experts=experts, top_k=top_k, ffn_dim=2048)
        )
        recipe.data.micro_batch_size = micro_batch
        return recipe

    assert token_time(routed(1, 1)) == pytest.approx(token_time(dense), rel=1e-3)
    times = [token_time(routed(experts, 2)) for experts in (2, 8, 32, 128)]
    assert all(a < b for a, b in zip(times, times[1:], strict=False))
    # 2 -> 128 experts: the experts' three passes (6 FLOPs a weight) at 2/128 instead of 2/2 of the micro-batch's
    # tokens each, and the router's larger matmul at the micro-batch's.
    cfg, tokens, peak = dense.model, dense.data.seq_len, PEAK_FLOPS["H100"]["bf16"]

    def efficiency(n: float) -> float:
        return matmul_efficiency(n, peak, 3.35e12)

    experts = 6 * cfg.n_layers * 3 * cfg.dim * 2 * 2048
    router = 6 * cfg.n_layers * cfg.dim * (128 - 2)
    slower = experts * (1 / efficiency(tokens * 2 / 128) - 1 / efficiency(tokens)) + router / efficiency(tokens)
    assert times[-1] - times[0] == pytest.approx(slower / peak)
    assert token_time(routed(128, 2, micro_batch=4)) < times[-1]


def test_a_row_that_fits_only_at_the_cards_edge_is_named_not_recommended(capsys):
    """A device whose memory the row without AC fills to within HEADROOM: the plan recommends a row that leaves that
    room (with AC) and names the tight one, with its memory, on a line of its own."""
    from fsdp_trainer.planner.plan import main

    args = ["--recipe", str(REPO / "recipes" / "debug.yaml"), "--nproc", "2", "--device", "cuda"]
    recipe = parse_recipe(args[:2])
    recipe.parallel.mixed_precision = "bf16"  # what the plan resolves auto to on a GPU
    none = estimate(recipe, nproc=2, nnodes=1, sharding="FULL_SHARD", ac="none", device="cuda")
    mem = none.total_gb / (1 - HEADROOM / 2)
    main([*args, "--device_mem_gb", f"{mem:.4f}"])
    out = capsys.readouterr().out.splitlines()
    recommended = next(line for line in out if line.startswith("recommended: "))
    assert "--parallel.activation_checkpointing none" not in recommended
    tight = out[-1].split(" fits at ")
    assert tight[0].startswith("tight: --parallel.sharding ") and tight[0].endswith("activation_checkpointing none")
    assert tight[1].endswith(f"of {mem:.1f} GB, within plan.HEADROOM (5%) of the device, which the allocator's "
                             "fragmentation may take")  # fmt: skip
    assert not any(line.startswith("at the edge: ") for line in out)


def test_a_recommendation_at_the_cards_edge_says_so(capsys):
    """Where every row that fits leaves less than HEADROOM free, the plan still recommends the fastest, and says on a
    line of its own that the allocator may take that room and slow the step beyond the prediction."""
    from fsdp_trainer.planner.plan import main

    args = ["--recipe", str(REPO / "recipes" / "debug.yaml"), "--nproc", "2", "--device", "cuda"]
    recipe = parse_recipe(args[:2])
    recipe.parallel.mixed_precision = "bf16"
    full = estimate(recipe, nproc=2, nnodes=1, sharding="FULL_SHARD", ac="full", device="cuda")
    mem = full.total_gb / (1 - HEADROOM / 2)
    main([*args, "--device_mem_gb", f"{mem:.4f}"])
    out = capsys.readouterr().out.splitlines()
    recommended = next(line for line in out if line.startswith("recommended: "))
    assert "--parallel.activation_checkpointing full" in recommended
    edge = out[out.index(recommended) + 1]
    assert edge.startswith("at the edge: nothing else fits, and this leaves less than plan.HEADROOM (5%) of the device")


def test_a_plan_of_a_mixture_of_experts_says_how_many_tokens_an_expert_sees(capsys):
    """With --gpu, a mixture of experts' plan says what sets its speed: each expert's share of a micro-batch's tokens
    (top_k / experts of them) and the fraction of peak its matmuls and the others reach at those sizes; a dense
    model's plan has no such line."""
    from fsdp_trainer.planner.plan import main

    debug = ["--recipe", str(REPO / "recipes" / "debug.yaml"), "--nproc", "8", "--gpu", "A100"]
    moe = [
        "--model.family",
        "qwen3_moe",
        "--model.moe.experts",
        "16",
        "--model.moe.top_k",
        "2",
        "--model.moe.ffn_dim",
        "64",
    ]
    main([*debug, *moe])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("experts:"))
    tokens = 8 * 128  # debug.yaml's micro-batch: 8 x 128
    peak, hbm = PEAK_FLOPS["A100"]["bf16"], GPUS["A100"].hbm_gb_s * 1e9
    assert line == (
        f"experts: each sees 128 tokens a micro-batch of 1,024 (top_k 2 of 16), their matmuls at "
        f"{matmul_efficiency(tokens * 2 / 16, peak, hbm):.0%} of peak, the other matmuls at "
        f"{matmul_efficiency(tokens, peak, hbm):.0%}; a longer data.micro_batch_size raises both"
    )
    main(debug)
    assert "experts:" not in capsys.readouterr().out


def test_a_gpu_whose_compute_outruns_its_memory_needs_larger_matmuls_to_reach_the_same_share_of_its_peak():
    """The micro-batch at which a matmul reaches half of matmul_peak is proportional to the GPU's ridge point (peak
    FLOP/s over HBM bytes/s): an A100 (153 FLOPs a byte) is half-way at about half the tokens an H100 (295) needs, a
    B200 (281) near an H100's; every GPU tends to matmul_peak for long micro-batches and none passes it."""
    c = CALIBRATION
    ridge = {gpu: PEAK_FLOPS[gpu]["bf16"] / (GPUS[gpu].hbm_gb_s * 1e9) for gpu in ("A100", "H100", "B200")}
    for gpu, r in ridge.items():
        peak, hbm = PEAK_FLOPS[gpu]["bf16"], GPUS[gpu].hbm_gb_s * 1e9
        assert matmul_efficiency(c.matmul_half * r, peak, hbm) == pytest.approx(c.matmul_peak / 2)
        assert c.matmul_peak * 0.99 < matmul_efficiency(1e12, peak, hbm) < c.matmul_peak
    a100, h100 = (matmul_efficiency(4096, PEAK_FLOPS[g]["bf16"], GPUS[g].hbm_gb_s * 1e9) for g in ("A100", "H100"))
    assert a100 > h100


def test_steps_the_model_cannot_tell_apart_go_to_the_row_with_the_least_memory():
    """Predicted steps within SAME_STEP of the fastest are the same to the model: of them, the least memory. For 1B
    on 8 H100s ZeRO-2, which keeps each block gathered from forward to backward, saves an all-gather that hides under
    compute anyway: a step a fraction of a percent shorter for more memory, so ZeRO-3 is recommended. A row more than
    that slower is not, however little memory it takes (full AC)."""
    recipe = parse_recipe(["--recipe", str(REPO / "recipes" / "1b.yaml"), "--parallel.mixed_precision", "bf16"])
    rows = plan(recipe, nproc=8, nnodes=1, device="cuda")
    times = [step_time(recipe, row, "H100", 8, 1) for row in rows]
    by_key = {(r.sharding, r.ac): (r, t) for r, t in zip(rows, times, strict=True) if not r.offload}
    (zero2, zero2_step), (zero3, zero3_step) = by_key["SHARD_GRAD_OP", "none"], by_key["FULL_SHARD", "none"]
    assert zero2_step.step_s < zero3_step.step_s <= zero2_step.step_s * (1 + SAME_STEP)
    assert zero2.total_gb > zero3.total_gb
    best = recommend(rows, 80, math.inf, times)
    assert (best.sharding, best.ac) == ("FULL_SHARD", "none")
    full, full_step = by_key["FULL_SHARD", "full"]
    assert full.total_gb < best.total_gb and full_step.step_s > zero3_step.step_s * (1 + SAME_STEP)


def test_the_plan_recommends_the_fastest_row_that_fits_and_prices_the_network_a_nic_a_gpu():
    """8B on 2 nodes x 8 A100 40GB. A ring over both nodes leaves each node once: NCCL runs a ring a NIC, so a rank's
    NIC carries 1/8 of what it sends (FULL_SHARD, NO_SHARD), and HYBRID_SHARD only its gradient shard's all-reduce.
    At this size the gathers hide under compute: the fastest rows that fit are those without AC, FULL_SHARD's and
    HYBRID_SHARD's, equal to the step-time model, and of them the least memory, FULL_SHARD's, is recommended. Without
    a GPU to time them, the least recomputation and then the fewest bytes crossing between nodes: HYBRID_SHARD's, on a
    card where it fits only within HEADROOM only when that need not be left. On 25 GB/s without NVLink between the
    GPUs of a node (a PCIe box), the same rows are slower."""
    recipe = parse_recipe([*_8B, "--data.micro_batch_size", "1", "--data.seq_len", "4096"])
    rows = plan(recipe, nproc=8, nnodes=2, device="cuda")
    times = [step_time(recipe, row, "A100", 8, 2) for row in rows]
    fastest = recommend(rows, 40, 1e9, times)
    assert (fastest.sharding, fastest.ac) == ("FULL_SHARD", "none")
    hybrid = recommend(rows, 40, 1e9)  # without times: the fewest bytes between nodes
    assert (hybrid.sharding, hybrid.ac) == ("HYBRID_SHARD", "none") and hybrid.total_gb > fastest.total_gb
    card = hybrid.total_gb / (1 - HEADROOM / 2)  # it fits, in the last HEADROOM of the card
    assert recommend(rows, card, 1e9, headroom=0.0) == hybrid and recommend(rows, card, 1e9).sharding == "FULL_SHARD"
    by_key = {(r.sharding, r.ac): (r, t) for r, t in zip(rows, times, strict=True) if not r.offload}
    full_shard, hybrid = by_key["FULL_SHARD", "none"][0], by_key["HYBRID_SHARD", "none"][0]
    assert full_shard.internode_gb == pytest.approx(full_shard.sent_gb / 8)
    n = count_params(recipe.model)
    assert hybrid.internode_gb == pytest.approx(2 * 4 * n / 8 * (2 - 1) / 2 / 1e9, rel=1e-3)  # fp32, halves of a shard
    # What the model prices, each alone: full AC's second forward of every weight and of attention, the network.
    full, selective = by_key["FULL_SHARD", "full"][1], by_key["FULL_SHARD", "selective"][1]
    tokens = recipe.data.seq_len
    cfg, c = recipe.model, CALIBRATION
    weights = (flops_per_token(cfg, tokens) - attention_flops_per_token(cfg, tokens)) / 3  # a forward: 2 a weight
    peak = PEAK_FLOPS["A100"]["bf16"]
    again = weights / (peak * matmul_efficiency(tokens, peak, GPUS["A100"].hbm_gb_s * 1e9))
    padded = math.ceil(cfg.resolved_head_dim / 32) * 32 / cfg.resolved_head_dim
    again += attention_flops_per_token(cfg, tokens) / 3 * padded / 2 / (PEAK_FLOPS["A100"]["bf16"] * c.attention_a100)
    assert full.compute_s - selective.compute_s == pytest.approx(tokens * again)
    assert all(t is None for r, t in zip(rows, times, strict=True) if r.offload)


def test_plan_cli_predicts_speed_and_the_hours_to_train_on_a_named_gpu():
    cmd = [*_8B, "--nproc", "8", "--gpu", "H100"]
    proc = plan_cli(*cmd, "--train_tokens", "1e12")
    assert proc.returncode == 0, proc.stderr
    assert "| step s | exposed comm s | tokens/s / GPU | MFU |" in proc.stdout and "of 80.0 GB)" in proc.stdout
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("predicted on 8 x H100: ")]
    per_gpu = float(line.split("s a step, ")[1].split(" tokens/s")[0].replace(",", ""))
    [hours_line] = [x for x in proc.stdout.splitlines() if x.startswith("1e+12 tokens: ")]
    hours = float(hours_line.split(": ")[1].split(" hours")[0].replace(",", ""))
    assert hours == pytest.approx(1e12 / (per_gpu * 8) / 3600, rel=1e-3)
    bad = plan_cli(*cmd[:-2], "--train_tokens", "1e12")
    assert bad.returncode == 1 and bad.stderr == "error: --train_tokens needs --gpu and a positive number of tokens\n"


def test_a_gpu_plan_on_a_machine_without_one_names_the_gpu_and_one_device_gets_a_row_per_ac_mode(capsys):
    """Without a GPU here, `--device cuda` alone would plan for a GPU with this machine's RAM / nproc: refused in one
    line naming --gpu and --device_mem_gb. On one device the shardings differ only in freeing gathered blocks after
    their forward: one row per AC mode (FULL_SHARD's), with and without offload."""
    from fsdp_trainer.planner.plan import main

    recipe = ["--recipe", str(REPO / "recipes" / "lora_llama3_2_1b.yaml")]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exit_code:
            main([*recipe, "--nproc", "8", "--device", "cuda"])
        assert exit_code.value.code == 1
        refusal = capsys.readouterr().err
        assert "--device cuda on a machine without a GPU: name the GPU to plan for with --gpu" in refusal
    main([*recipe, "--nproc", "1", "--gpu", "H100"])
    rows = [line.split(" | ")[:2] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert rows == [[f"| FULL_SHARD{offload}", ac] for offload in ("", " + offload") for ac in ("none", "selective",
                                                                                                "full")]  # fmt: skip


def test_max_seq_len_finds_the_longest_window_and_largest_micro_batch_that_fit_and_checks_them(capsys):
    """`plan --max_seq_len`: per context-parallel degree (1, 2 on 2 ranks) and AC mode, the longest data.seq_len that
    fits at micro-batch 1 (a multiple of 256; one step more would not fit) and the largest micro-batch at the recipe's
    seq_len; with --check, each longest one run on fake tensors, which allocates no more than planned (to 5%). CP 2
    fits longer windows than CP 1 under each AC mode. Two of the debug recipe's blocks, as the checks of each kind."""
    from fsdp_trainer.planner.plan import SEQ_LEN_STEP, fitting, main, shaped

    args = ["--recipe", str(REPO / "recipes" / "debug.yaml"), "--model.max_seq_len", "65536", "--model.n_layers", "2"]
    main([*args, "--nproc", "2", "--device", "cuda", "--device_mem_gb", "1.0", "--max_seq_len", "--check"])
    assert not torch.distributed.is_initialized()  # the fake world is gone with its step: none left for other tests
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    recipe = parse_recipe(args)
    assert [row[:2] for row in rows[1:]] == [[cp, ac] for cp in "12" for ac in ("none", "selective", "full")]
    lengths = {}
    for cp, ac, seq_len, _, _, batch, _, _, check in rows[1:]:
        seq_len, batch = int(seq_len.replace(",", "")), int(batch)
        lengths[cp, ac] = seq_len

        def fits(length: int, micro_batch: int, ac=ac, cp=int(cp)) -> bool:
            return fitting(shaped(recipe, length, micro_batch, cp), 2, 1, ac, "cuda", 1.0) is not None

        assert fits(seq_len, 1) and not fits(seq_len + SEQ_LEN_STEP, 1), ac
        assert fits(recipe.data.seq_len, batch) and not fits(recipe.data.seq_len, batch + 1), ac
        planned, measured = map(float, check.split(" / "))
        assert planned >= 0.95 * measured, (ac, planned, measured)
    for cp in "12":  # recomputing more leaves room for longer windows
        by_ac = [lengths[cp, ac] for ac in ("none", "selective", "full")]
        assert by_ac == sorted(by_ac) and by_ac[0] < by_ac[-1]
    assert all(lengths["2", ac] > lengths["1", ac] for ac in ("none", "selective", "full"))


def test_the_check_names_the_shardings_qloras_weights_do_not_split_over_and_measures_the_rest():
    """Over a shard group its 4-bit projections do not split into (k_proj's two NF4 scale blocks over 4 ranks) a run
    would refuse to start, so there is no step to measure: those rows say so in one line per sharding, the others are
    measured."""
    proc = plan_cli("--recipe", REPO / "recipes" / "debug.yaml", "--model.n_layers", "2", "--nproc", "2",
                    "--nnodes", "2", "--device", "cuda", "--device_mem_gb", "80", "--check", "--lora.rank", "16",
                    "--lora.quantize_base", "nf4", "--data.micro_batch_size", "8",
                    "--parallel.activation_checkpointing", "full")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = proc.stdout.split("| planned / measured |")[1]
    rows = {sharding: [measured, ratio] for sharding, ac, _, measured, ratio in check_rows(proc.stdout) if ac == "full"}
    assert rows["FULL_SHARD"] == rows["SHARD_GRAD_OP"] == rows["SHARD_OP"] == ["-", "-"]
    assert 0.95 <= float(rows["NO_SHARD"][1]) and 0.95 <= float(rows["HYBRID_SHARD"][1])
    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OP"):
        assert check.count(f"\n{sharding}: lora.quantize_base nf4: k_proj (128 x 256) does not split") == 1


def test_on_one_device_the_check_counts_the_frozen_weights_fsdp_leaves_alone_and_the_plan_the_rotary_tables():
    """On one device the frozen weights stay outside FSDP, which torch's tracker does not see: the fake step hands
    them to it, so its peak holds every one of them (the embedding, which no op makes a view of, included), and the
    plan's total holds the model's buffers (the rotary tables), which no other term counts."""
    from fsdp_trainer.adapters import meta_model
    from fsdp_trainer.planner.fake import measured_peak_gb

    recipe = parse_recipe(["--recipe", str(REPO / "recipes" / "debug.yaml"), "--model.n_layers", "2",
                           "--model.vocab_size", "65536", "--model.tie_embeddings", "false", "--lora.rank", "8",
                           "--lora.quantize_base", "nf4", "--data.micro_batch_size", "1", "--data.seq_len", "32",
                           "--parallel.mixed_precision", "bf16",
                           "--parallel.activation_checkpointing", "full"])  # fmt: skip
    meta = meta_model(recipe.model, recipe.lora, frozen_dtype=torch.bfloat16, quantize=True)
    frozen = 2 * (meta.model.embed_tokens.weight.numel() + meta.output_layer.weight.numel())  # bf16, 67 MB
    assert frozen == 2 * 2 * 65536 * 256
    assert measured_peak_gb(recipe, 1, 1) * 1e9 > frozen
    buffers = sum(b.numel() * b.element_size() for b in meta.buffers())
    row = estimate(recipe, nproc=1, nnodes=1, sharding="FULL_SHARD", ac="full", device="cuda")
    assert buffers == 2 * 4 * recipe.model.max_seq_len * recipe.model.resolved_head_dim
    assert row.buffers_gb == pytest.approx(buffers / 1e9)
    assert row.total_gb == pytest.approx(dataclasses.replace(row, buffers_gb=0).total_gb + row.buffers_gb)


def test_each_rows_step_on_one_model_peaks_as_on_a_model_built_for_that_row_alone():
    """`plan --check` measures the rows of the shardings that split the world alike (FULL_SHARD, SHARD_GRAD_OP and
    SHARD_OP: one mesh) on one model, warmed by one step under the first row (here FULL_SHARD's full AC: the other rows
    follow a step that recomputed and freed its blocks after forward): each row's peak, with accumulation, is the one
    a model built for that sharding and AC mode alone measures."""
    from fsdp_trainer.planner.fake import measured_peak_gb, measured_rows_gb

    recipe = parse_recipe(["--recipe", str(REPO / "recipes" / "debug.yaml"), "--model.n_layers", "2",
                           "--parallel.mixed_precision", "fp32", "--data.grad_accum_steps", "2"])  # fmt: skip
    rows = {"FULL_SHARD": ["full", "none"], "SHARD_GRAD_OP": ["none"], "SHARD_OP": ["selective"]}
    together = measured_rows_gb(recipe, 2, 1, rows)
    assert together["SHARD_GRAD_OP", "none"] > together["FULL_SHARD", "none"] > together["FULL_SHARD", "full"]
    for (sharding, mode), gb in together.items():
        recipe.parallel.sharding, recipe.parallel.activation_checkpointing = sharding, mode
        assert gb == measured_peak_gb(recipe, 2, 1), (sharding, mode)


def test_the_checks_tracker_reads_the_peak_torchs_fsdp_mem_tracker_reads(monkeypatch):
    """`plan --check` tracks a step with a lean FSDPMemTracker (planner/fake.py: the step's peak alone, no bookkeeping
    on device queries): each mode's peak of a DPO step with accumulation, its frozen reference beside the policy, is
    the one torch's own tracker reads, to the byte."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from fsdp_trainer.planner import fake

    recipe = parse_recipe(["--recipe", str(REPO / "recipes" / "debug.yaml"), "--model.n_layers", "2",
                           "--parallel.mixed_precision", "fp32", "--preference.loss", "sigmoid",
                           "--data.grad_accum_steps", "2"])  # fmt: skip
    lean = fake.measured_peaks_gb(recipe, 2, 1, ["full", "none"])
    monkeypatch.setattr(fake, "_PeakTracker", FSDPMemTracker)
    assert lean == fake.measured_peaks_gb(recipe, 2, 1, ["full", "none"])


def test_the_check_holds_a_tied_output_layer_outside_fsdp_once():
    """LoRA under NO_SHARD (a shard group of one) leaves the frozen weights outside FSDP, and to_empty makes a tied
    output layer a tensor of its own: the trainer ties it to the embedding again (parallelize.materialize), and so
    must the fake step (parallelize.allocate, both), or it measures the embedding twice (the 1B LoRA recipe's NO_SHARD
    rows read 0.80-0.87 of the plan; here 0.65)."""
    from fsdp_trainer.planner.fake import measured_peak_gb

    recipe = parse_recipe(["--recipe", str(REPO / "recipes" / "debug.yaml"), "--model.n_layers", "2",
                           "--model.vocab_size", "65536", "--lora.rank", "8", "--data.micro_batch_size", "1",
                           "--data.seq_len", "32", "--parallel.mixed_precision", "bf16", "--parallel.sharding",
                           "NO_SHARD", "--parallel.activation_checkpointing", "full"])  # fmt: skip
    assert recipe.model.tied_output
    row = estimate(recipe, nproc=2, nnodes=1, sharding="NO_SHARD", ac="full", device="cuda")
    assert (row.total_gb - row.runtime_gb) / measured_peak_gb(recipe, 2, 1) == pytest.approx(1.0, abs=0.05)


def test_a_grpo_step_whose_peak_is_its_sampling_is_planned_at_that_moment():
    """Few tokens beside many blocks: sampling, with the model gathered whole, a KV cache and a decode pass's logits,
    holds more than any moment of the training that follows (FULL_SHARD gathers a block or two at a time there), and
    the plan puts the peak there, as the step on fake tensors, which rehearses the sampling, measures it."""
    from fsdp_trainer.planner.fake import measured_peak_gb

    recipe = parse_recipe(["--recipe", str(REPO / "recipes" / "debug.yaml"), "--model.n_layers", "12",
                           "--data.micro_batch_size", "1", "--data.seq_len", "16", "--parallel.mixed_precision", "bf16",
                           "--grpo.rewards", '[{function: "fsdp_trainer.rewards:exact_answer"}]',
                           "--grpo.num_generations", "2", "--grpo.max_completion_length", "8"])  # fmt: skip
    row = estimate(recipe, nproc=8, nnodes=1, sharding="FULL_SHARD", ac="none", device="cuda")
    planned, training_only = (e.total_gb - e.runtime_gb for e in (row, dataclasses.replace(row, sampling_gb=0.0)))
    assert planned > 1.1 * training_only  # the sampling's moment is the peak
    assert planned / measured_peak_gb(recipe, 8, 1) == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("vocab", [32000, 128256])
def test_full_ac_at_the_8bs_widths_is_planned_at_the_moments_fsdp_holds_most(vocab):
    """Full AC at the 8B's widths, 4 blocks on 8 ranks. With a 32,000-token vocabulary (Llama 2's, Mistral 7B's) the
    peak is a block's backward, beside the output layer's weight gradient, which waits for the root's reduction, and
    the previous block's gradients in their fp32 reduce-scatter input, which FSDP2 keeps until the next reduction:
    without those the plan read 0.93 of the step on fake tensors (0.89 at 32 blocks on 64 ranks). With Llama 3's
    128,256 the plan's peak is the end of backward, where FSDP2 has freed every gathered weight (the root's before
    reducing its gradients) and holds one block's gradients in flight, not its unsharded ones: counted as gathered and
    unsharded there, the plan read 1.38."""
    from fsdp_trainer.planner.fake import measured_peak_gb

    recipe = parse_recipe([*_8B, "--model.n_layers", "4", "--model.vocab_size", str(vocab), "--data.micro_batch_size",
                           "1", "--parallel.mixed_precision", "bf16", "--parallel.activation_checkpointing",
                           "full"])  # fmt: skip
    row = estimate(recipe, nproc=8, nnodes=1, sharding="FULL_SHARD", ac="full", device="cuda")
    assert 0.95 <= (row.total_gb - row.runtime_gb) / measured_peak_gb(recipe, 8, 1) <= 1.12


@pytest.mark.parametrize(
    "blocks, batch, sharding, ratio",
    [(2, [], "SHARD_GRAD_OP", 0.99), (2, [], "FULL_SHARD", 1.02),
     (16, ["--data.seq_len", "256", "--data.micro_batch_size", "1", "--lora.rank", "4"], "FULL_SHARD", 1.00)],
)  # fmt: skip
def test_forward_holds_the_all_gather_outputs_fsdp2_keeps(blocks, batch, sharding, ratio):
    """FSDP2 keeps the last all-gather's output until the root's forward returns, after the loss, and while a block's
    gather is copied out it still holds the previous block's (wait_for_unshard frees it on returning). Where a block's
    weights outweigh a slice's logits and a block's activations (Qwen3-30B-A3B's 128 experts, LoRA, few blocks or few
    tokens) one of those moments is the step's peak: at two blocks under SHARD_GRAD_OP the loss's forward, 0.93 of the
    step on fake tensors without the output; at sixteen blocks of 256 tokens under FULL_SHARD the last block's
    copy-out, 0.90 without the two and without the experts' adapter factors each block keeps whatever its tokens
    (activations.adapter_copies_per_block; rank 4, padded to 8: A's copies too), 0.98 without those alone. Under
    FULL_SHARD only the root and the last block are gathered while the loss runs (the others resharded, nothing
    prefetched yet): 1.07 at two blocks with every kept block counted."""
    from fsdp_trainer.planner.fake import measured_peak_gb

    recipe = parse_recipe(["--recipe", str(REPO / "recipes" / "qwen3_30b_a3b_lora.yaml"), "--model.n_layers",
                           str(blocks), *batch, "--parallel.mixed_precision", "bf16", "--parallel.sharding", sharding,
                           "--parallel.activation_checkpointing", "none",
                           "--parallel.expert_parallel", "1"])  # fmt: skip
    row = estimate(recipe, nproc=8, nnodes=1, sharding=sharding, ac="none", device="cuda")
    assert row.last_copy_out_gb == pytest.approx(2 * row.last_gather_gb)
    assert row.last_gather_gb > 1.2  # a block's bf16 weights, 1.25 GB
    planned = row.total_gb - row.runtime_gb
    assert planned / measured_peak_gb(recipe, 8, 1) == pytest.approx(ratio, abs=0.01)


def test_a_trained_tied_output_layer_sums_its_two_weight_gradients_beside_the_gathered_root():
    """A tied embedding's backward comes after every block's: its weight gradient and the output layer's are summed
    into a third (autograd adds a weight's two gradients out of place: `aten.add`, real tensors as fake), the root
    still gathered and its gradient shard not yet made. With few tokens that is the step's peak: the 125m recipe (tied,
    32,000 x 768) at 4 blocks of 256 tokens, full AC, on 8 ranks, 0.91 of it on fake tensors without the moment."""
    from fsdp_trainer.planner.fake import measured_peak_gb

    recipe = parse_recipe(["--recipe", str(REPO / "recipes" / "125m.yaml"), "--model.n_layers", "4", "--data.seq_len",
                           "256", "--data.micro_batch_size", "1", "--parallel.mixed_precision", "bf16",
                           "--parallel.activation_checkpointing", "full"])  # fmt: skip
    assert recipe.model.tied_output
    row = estimate(recipe, nproc=8, nnodes=1, sharding="FULL_SHARD", ac="full", device="cuda")
    cfg = recipe.model
    n_block = count_params(cfg, one_block=True)
    n_root = count_params(cfg) - cfg.n_layers * n_block  # the embedding (the output layer's too) and the final norm
    gradient = 2 * cfg.vocab_size * cfg.dim
    tied_moment = 2 * n_root + 3 * gradient - 4 * n_root / 8 + 4 * n_block  # + the last block's reduce-scatter input
    assert row.grad_buffers_gb * 1e9 == pytest.approx(tied_moment)
    assert (row.total_gb - row.runtime_gb) / measured_peak_gb(recipe, 8, 1) == pytest.approx(1.0, abs=0.01)


def test_qloras_dequantization_is_priced_at_what_torchao_holds_while_it_runs():
    """torchao's eager dequantization of an NF4 weight holds, until it returns, each half's 4-bit indices as int64 and
    three compute-dtype tensors a value (lookups, scaled, stacked): 14 bytes a weight in bf16, 0.82 GB for the 8B's MLP
    projections. With few tokens that is the peak of a block's backward: the QLoRA recipe at 2 blocks of 256 tokens
    under NO_SHARD read 0.80 of its step on fake tensors at 2 bytes a weight (0.82 at 4 blocks)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from fsdp_trainer.adapters.nf4 import dequantization_peak_bytes, to_nf4
    from fsdp_trainer.planner.fake import measured_peak_gb

    for dtype in (torch.bfloat16, torch.float32):  # torchao's own dequantization, on real tensors
        weight, tracker = to_nf4(torch.randn(256, 1024, dtype=dtype)), MemTracker()
        with tracker:
            weight.get_original_weight()
        peak = max(by_kind["Total"] for by_kind in tracker.get_tracker_snapshot("peak").values())
        assert peak / weight.numel() == pytest.approx(dequantization_peak_bytes(dtype.itemsize), rel=0.01)
    recipe = parse_recipe(["--recipe", str(REPO / "recipes" / "qlora_llama3_8b.yaml"), "--model.n_layers", "2",
                           "--data.seq_len", "256", "--data.micro_batch_size", "1", "--parallel.mixed_precision",
                           "bf16", "--parallel.sharding", "NO_SHARD", "--parallel.activation_checkpointing",
                           "none"])  # fmt: skip
    row = estimate(recipe, nproc=8, nnodes=1, sharding="NO_SHARD", ac="none", device="cuda")
    assert (row.total_gb - row.runtime_gb) / measured_peak_gb(recipe, 8, 1) == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_an_eager_sliding_window_is_planned_with_its_mask_once(ac):
    """Gemma 3's local layers at a sequence far longer than their window, eager (what the fake step runs, and a GPU
    without compile): every local layer's backward reads the one T x T additive mask, which the plan counts once
    beside the activations (0.65 of the step on fake tensors without it with AC none, 0.48 with full, where the mask
    is most of the step); compiled on a GPU, flex_attention's block mask, which the plan does not count. The plan
    sits above the step by its block backward's room at these widths (2 x a block's activations)."""
    from fsdp_trainer.planner.fake import measured_peak_gb

    recipe = parse_recipe(["--recipe", str(REPO / "recipes" / "gemma3_1b_sft.yaml"), "--model.n_layers", "4",
                           "--model.dim", "64", "--model.n_heads", "1", "--model.n_kv_heads", "1", "--model.head_dim",
                           "64", "--model.ffn_dim", "128", "--model.vocab_size", "1024", "--model.max_seq_len", "4096",
                           "--data.seq_len", "4096", "--data.micro_batch_size", "1", "--parallel.compile", "false",
                           "--parallel.mixed_precision", "fp32",
                           "--parallel.activation_checkpointing", ac])  # fmt: skip
    row = estimate(recipe, nproc=2, nnodes=1, sharding="FULL_SHARD", ac=ac, device="cuda")
    assert row.attention_mask_gb * 1e9 == 4 * 4096 * 4096
    assert 1.0 <= (row.total_gb - row.runtime_gb) / measured_peak_gb(recipe, 2, 1) <= 1.15
    compiled = dataclasses.replace(recipe, parallel=dataclasses.replace(recipe.parallel, compile=True))
    assert estimate(compiled, nproc=2, nnodes=1, sharding="FULL_SHARD", ac=ac, device="cuda").attention_mask_gb == 0


def test_a_mixture_planned_without_expert_parallelism_is_told_the_degree_that_moves_fewest_bytes(capsys):
    """A mixture of experts planned without EP: the plan names the degree (of those dividing a node's ranks and the
    experts) whose recommended row sends the fewest bytes, beside the row without; none where no degree sends fewer:
    with adapters on the experts their frozen weights are gathered but never reduced, and at these shapes the
    all-to-all's copies outweigh the gathers it saves."""
    from fsdp_trainer.planner.plan import main

    args = ["--recipe", str(REPO / "recipes" / "debug.yaml"), *MIXTURE, "--nproc", "4", "--device", "cuda",
            "--device_mem_gb", "80"]  # fmt: skip
    main(args)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("expert parallelism:"))
    degree, sent, without = re.match(
        r".*expert_parallel (\d) .* sends ([\d.e-]+) GB a step against ([\d.e-]+)", line
    ).groups()
    assert degree == "4" and float(sent) < float(without)
    main([*args, "--lora.rank", "4", "--lora.targets", "[q_proj, experts]"])
    assert "expert parallelism:" not in capsys.readouterr().out
