"""The model against Hugging Face transformers (same weights -> same logits), and its init contract."""

from __future__ import annotations

import pytest
import torch

from fsdp_trainer.config import ModelConfig
from fsdp_trainer.model import Transformer

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
    if cfg.family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common)).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers(family, tie):
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
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie


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
    with torch.device("meta"):
        meta = Transformer(cfg)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.init_weights(seed=1)
    direct = Transformer(cfg)
    direct.init_weights(seed=1)
    tokens = torch.randint(0, 50, (1, 16))
    torch.testing.assert_close(meta(tokens), direct(tokens), rtol=0, atol=0)  # rope tables recomputed too
