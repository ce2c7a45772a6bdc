"""The model against Hugging Face transformers (same weights -> same logits), and its init contract."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from fsdp_trainer.config import ModelConfig, MoEConfig, RopeScaling
from fsdp_trainer.lean_autograd import gated, plain_gated, plain_rms_norm, rms_norm
from fsdp_trainer.loss import NextTokenLoss
from fsdp_trainer.model import KVCache, Transformer, on_meta, rope_tables

transformers = pytest.importorskip("transformers")


def hf_model(cfg: ModelConfig):
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.resolved_head_dim,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    if cfg.rope_scaling is not None:
        common["rope_scaling"] = {"rope_type": "llama3", **asdict(cfg.rope_scaling)}  # 4.x's spelling; 5.x reads it
    if cfg.family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common)).eval()


# Llama 3.1's and 3.2's factors over a pretraining context short enough that this tiny model's wavelengths fall into
# all three bands: kept, interpolated, stretched.
SCALINGS = {
    "3.1": RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32),
    "3.2": RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=48),
}


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_rope_scaling_equals_transformers_llama3_init(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = ModelConfig(
        dim=256, n_heads=4, n_kv_heads=4, max_seq_len=128, rope_theta=500000.0, rope_scaling=SCALINGS[scaling]
    )
    hf_config = hf_model(ModelConfig(**{**asdict(cfg), "rope_scaling": SCALINGS[scaling], "n_layers": 1})).config
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)
    cos, sin = rope_tables(cfg.resolved_head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
    assert attention_factor == 1.0
    assert torch.equal(cos, torch.cat([angles, angles], -1).cos()) and torch.equal(
        sin, torch.cat([angles, angles], -1).sin()
    )
    plain_cos, _ = rope_tables(cfg.resolved_head_dim, cfg.max_seq_len, cfg.rope_theta)
    stretched = (cos != plain_cos).any(0)[: cfg.resolved_head_dim // 2]
    assert stretched.any() and not stretched.all()  # the short wavelengths are kept, the long ones are not


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
def test_logits_and_gradients_match_transformers(family, tie):
    cfg = ModelConfig(
        family=family,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32 if family == "qwen3" else None,
        ffn_dim=160,
        vocab_size=101,
        max_seq_len=64,
        tie_embeddings=tie,
        rope_theta=500000.0,
        norm_eps=1e-6,
    )
    ours = Transformer(cfg)
    ours.init_weights(seed=3)
    with torch.no_grad():  # norms start at 1; perturb them so a swapped or ignored norm would show
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    hf = hf_model(cfg)
    # Same names, same shapes: loading is a copy (strict), with lm_head shared when tied.
    hf.load_state_dict(ours.state_dict(), strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 37))
    logits = ours(tokens), hf(tokens).logits
    torch.testing.assert_close(*logits, rtol=1e-5, atol=1e-5)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie
    # Every parameter's gradient too: the backward the lean norm and gated activation compute (lean_autograd.py) is
    # the one autograd computes on transformers' ops.
    for side in logits:
        F.cross_entropy(side[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    "dtype, weight_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)]
)
@pytest.mark.parametrize("variant", [False, True])  # Gemma 3's norm (1 + weight) and GeGLU
def test_the_lean_norm_and_gated_activation_give_autograds_values_and_gradients_bitwise(dtype, weight_dtype, variant):
    """lean_autograd keeps less for backward and recomputes the rest with autograd's own formulas: outputs and every
    gradient equal those of the plain ops, bit for bit, in fp32, in bf16, and with fp32 weights on bf16 inputs."""
    torch.manual_seed(0)
    x, grad = torch.randn(3, 17, 64, dtype=dtype), torch.randn(3, 17, 64, dtype=dtype)
    weight = (0.1 * torch.randn(64) + (0.0 if variant else 1.0)).to(weight_dtype)
    gate, up = torch.randn(3, 17, 96, dtype=dtype), torch.randn(3, 17, 96, dtype=dtype)

    def run(norm, act) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (x, weight, gate, up)]
        y = norm(leaves[0], leaves[1], 1e-6, variant)
        h = act(leaves[2], leaves[3], variant)
        (y.float() * grad.float()).sum().add((h.float() ** 2).sum()).backward()
        return [y.detach(), h.detach(), *(t.grad for t in leaves)]

    for lean, plain in zip(run(rms_norm, gated), run(plain_rms_norm, plain_gated), strict=True):
        assert lean.dtype == plain.dtype and torch.equal(lean, plain)


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_rope_scaled_logits_match_transformers(scaling):
    cfg = ModelConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=160,
        vocab_size=101,
        max_seq_len=64,
        rope_theta=500000.0,
        rope_scaling=SCALINGS[scaling],
    )
    ours = Transformer(cfg)
    ours.init_weights(seed=3)
    hf = hf_model(cfg)
    hf.load_state_dict(ours.state_dict(), strict=True)
    unscaled = hf_model(ModelConfig(**{**asdict(cfg), "rope_scaling": None}))
    unscaled.load_state_dict(ours.state_dict(), strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = hf(tokens).logits
        torch.testing.assert_close(ours(tokens), logits, rtol=1e-5, atol=1e-5)
        assert (logits - unscaled(tokens).logits).abs().max() > 1e-3  # the scaling changes what the model computes


def test_init_weights_is_deterministic_and_follows_its_table():
    cfg = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=256, vocab_size=1000)
    a, b = Transformer(cfg), Transformer(cfg)
    a.init_weights(seed=7)
    b.init_weights(seed=7)
    a.init_weights(seed=7)  # idempotent
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    sd = a.state_dict()
    assert torch.equal(sd["model.norm.weight"], torch.ones(64))
    assert sd["model.embed_tokens.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    # Residual-writing projections are scaled down by sqrt(2 * n_layers).
    assert sd["model.layers.0.mlp.down_proj.weight"].std().item() == pytest.approx(0.02 / 8**0.5, rel=0.1)
    assert sd["model.embed_tokens.weight"].abs().max() <= 3 * 0.02 + 1e-6  # truncated at 3 std
    c = Transformer(cfg)
    c.init_weights(seed=8)
    assert not torch.equal(c.state_dict()["lm_head.weight"], sd["lm_head.weight"])


def test_meta_build_then_materialize_equals_direct_build():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=16)
    with on_meta():
        meta = Transformer(cfg)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.init_weights(seed=1)
    direct = Transformer(cfg)
    direct.init_weights(seed=1)
    tokens = torch.randint(0, 50, (1, 16))
    torch.testing.assert_close(meta(tokens), direct(tokens), rtol=0, atol=0)  # rope tables recomputed too


def test_a_build_on_meta_skips_only_the_draws_a_meta_tensor_cannot_hold():
    """on_meta() builds what torch.device("meta") builds (every parameter and buffer: name, shape, dtype, whether it
    trains), without its initial draws, which on meta change nothing, not even the random state; a tensor on another
    device still gets its draw, and the default device is the CPU again after it."""
    cfg = ModelConfig(family="qwen3_moe", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=50,
                      max_seq_len=16, moe=MoEConfig(experts=4, top_k=2, ffn_dim=16))  # fmt: skip
    state = torch.random.get_rng_state()
    with torch.device("meta"):
        drawn = Transformer(cfg)
    assert torch.equal(torch.random.get_rng_state(), state)  # a meta draw takes nothing from the generator
    with on_meta():
        skipped = Transformer(cfg)
        on_cpu = torch.nn.init.normal_(torch.zeros(64, device="cpu"))
    assert on_cpu.count_nonzero() == 64 and torch.empty(1).device.type == "cpu"

    def layout(model):
        tensors = [*model.named_parameters(), *model.named_buffers()]
        return [(name, t.shape, t.dtype, t.requires_grad, t.is_meta) for name, t in tensors]

    assert layout(skipped) == layout(drawn) and all(meta for *_, meta in layout(skipped))


def _tiny_for_loss(tie: bool) -> Transformer:
    cfg = ModelConfig(
        family="llama",
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        vocab_size=2000,
        max_seq_len=64,
        tie_embeddings=tie,
    )
    model = Transformer(cfg)
    model.init_weights(seed=0)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_chunked_loss_and_gradients_equal_the_whole_ones(tie):
    """The output layer in 7 uneven slices (2 x 45 tokens): the loss of a direct computation from the logits, and the
    same gradient for every parameter (the tied embedding too), to the order of the float sums."""
    model = _tiny_for_loss(tie)
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, 2000, (2, 45), generator=g), torch.randint(0, 2000, (2, 45), generator=g)
    reference = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    reference.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    for chunks in (1, 7):
        model.zero_grad()
        loss = model(tokens, loss=NextTokenLoss(targets, chunks)) / targets.numel()
        loss.backward()
        assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-8, msg=name)


def test_chunked_loss_never_keeps_the_whole_logits_for_backward():
    """What autograd saves for backward: with one piece, the fp32 log-softmax of all tokens x vocab; with 8 slices,
    none of it (each slice's logits are recomputed in backward), so the saved bytes drop by about the logits' size."""
    model = _tiny_for_loss(tie=False)
    tokens = torch.randint(0, 2000, (4, 64))
    saved = {}
    for chunks in (1, 8):
        sizes = []

        def keep(t: torch.Tensor, sizes=sizes) -> torch.Tensor:
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            model(tokens, loss=NextTokenLoss(tokens, chunks))
        saved[chunks] = sum(sizes)
    logits_bytes = 4 * 64 * 2000 * 4  # tokens x vocab x fp32
    assert saved[1] - saved[8] > 0.9 * logits_bytes, saved


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma3"])
def test_a_kv_cache_gives_the_logits_of_the_whole_sequence(family):
    """Reading a prompt into a KVCache and then a token at a time gives each position the logits the whole sequence
    gives it (QK-norm and RoPE at the cached offsets; a sliding window shorter than the sequence, Mistral's on every
    layer, Gemma 3's on its local layers, with their own rotary base)."""
    window = {
        "mistral": {"sliding_window": 5},
        "gemma3": {"sliding_window": 5, "sliding_window_pattern": 2, "rope_local_theta": 100.0},
    }.get(family, {})
    cfg = ModelConfig(family=family, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, **window)
    model = Transformer(cfg)
    model.init_weights(seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(0))
    whole = model(tokens)
    cache = KVCache(cfg, max_len=16)
    pieces = [model(tokens[:, :6], cache=cache)]
    pieces += [model(tokens[:, t : t + 1], cache=cache) for t in range(6, 10)]
    pieces.append(model(tokens[:, 10:], cache=cache))
    assert cache.length == 14
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_a_sliding_windows_mask_is_kept_once_for_all_the_layers_backward(family):
    """A window shorter than the sequence attends through a mask of every query and key (eager, as on a CPU or a GPU
    without compile), which autograd keeps for each windowed layer's backward: one tensor for all of them, not the
    T x T copy a layer that scaled_dot_product_attention makes of a boolean mask on each call (Mistral windows its 4
    layers, Gemma 3 two of them: 0.5 GB a layer at 16,384 tokens in bf16)."""
    pattern = {"sliding_window_pattern": 2} if family == "gemma3" else {}
    T = 96
    cfg = ModelConfig(family=family, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                      max_seq_len=T, sliding_window=8, **pattern)  # fmt: skip
    model = Transformer(cfg)
    model.init_weights(seed=0)
    masks = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.numel() >= T * T:
            masks[t.untyped_storage().data_ptr()] = t.shape
        return t

    tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(tokens).sum().backward()
    assert list(masks.values()) == [(1, 1, T, T)]
