"""Schedule values from the formula, parameter groups, and clipping against torch's reference."""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_trainer.config import ModelConfig, OptimConfig
from fsdp_trainer.model import Transformer
from fsdp_trainer.optim import build_optimizer, clip_grad_norm_, lr_at


def test_warmup_then_cosine_to_min_lr():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)  # the first step already moves
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(10, cfg, 110) == pytest.approx(1.0)
    mid = 10 + 99 / 2
    assert lr_at(int(mid), cfg, 110) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * int(mid - 10) / 99)))
    assert lr_at(109, cfg, 110) == pytest.approx(0.1)  # the last step reaches min_lr
    assert lr_at(500, cfg, 110) == pytest.approx(0.1)


def test_only_matrices_decay():
    model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50))
    decay, no_decay = build_optimizer(model, OptimConfig(weight_decay=0.1)).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
def test_clip_matches_torch(max_norm):
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    b.load_state_dict(a.state_dict())
    a(torch.randn(4, 8)).pow(2).sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        pb.grad = pa.grad.clone()
    norm = clip_grad_norm_(a, max_norm)
    ref = torch.nn.utils.clip_grad_norm_(b.parameters(), max_norm if max_norm else float("inf"))
    torch.testing.assert_close(norm, ref)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad)
