"""Schedule values from the formula, parameter groups, clipping against torch's reference, and Muon against torch's
and under FSDP."""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_trainer.config import ModelConfig, OptimConfig, parse_recipe
from fsdp_trainer.loss import NextTokenLoss
from fsdp_trainer.model import Transformer, count_params
from fsdp_trainer.muon import NS_COEFFICIENTS, assign_owners, newton_schulz_flops, orthogonalize
from fsdp_trainer.optim import build_optimizer, clip_grad_norm_, lr_at
from tests.helpers import REPO, read_metrics, run_args, train_cli, train_losses


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


def newton_schulz_by_svd(grad, coefficients=NS_COEFFICIENTS, steps=5, eps=1e-7):
    """The iteration in closed form: it maps G = U S V^T to U p(S / |G|_F) V^T, p the quintic composed `steps`
    times; in float64."""
    a, b, c = coefficients
    u, s, vh = torch.linalg.svd(grad.double(), full_matrices=False)
    s = s / grad.double().norm().clamp(min=eps)
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return (u * s) @ vh


def test_newton_schulz_is_the_quintic_on_singular_values():
    g = torch.Generator().manual_seed(0)
    for shape in ((48, 16), (16, 48)):
        grad = torch.randn(shape, generator=g)
        ours = orthogonalize(grad)
        torch.testing.assert_close(ours.double(), newton_schulz_by_svd(grad), atol=1e-5, rtol=0)
        singular = torch.linalg.svdvals(ours)  # near 1: neither 0 nor the gradient's scale
        assert singular.min() > 0.5 and singular.max() < 1.5


def test_muon_steps_as_torch_muon_and_leaves_the_rest_to_adamw(monkeypatch):
    """One process: the blocks' matrices take torch.optim.Muon's steps (Nesterov, weight decay, its shape scale),
    every other parameter AdamW's. torch's iterates in bf16; here it gets the closed form, ours fp32."""
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", newton_schulz_by_svd)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50)
    ours, ref = Transformer(cfg), Transformer(cfg)
    ours.init_weights(seed=0)
    ref.load_state_dict(ours.state_dict())
    optim = OptimConfig(name="muon", lr=1e-3, muon_lr=0.02, muon_weight_decay=0.1, weight_decay=0.1)
    optimizer = build_optimizer(ours, optim)
    named = dict(ref.named_parameters())
    muon_names = [n for n, p in named.items() if ".layers." in n and p.ndim == 2]
    assert muon_names and optimizer.param_groups[2]["names"] == muon_names
    torch_muon = torch.optim.Muon([named[n] for n in muon_names], lr=0.02, weight_decay=0.1, momentum=0.95)
    others = [p for n, p in named.items() if n not in muon_names]
    torch_adamw = torch.optim.AdamW(
        [
            {"params": [p for p in others if p.ndim == 2], "weight_decay": 0.1},
            {"params": [p for p in others if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=optim.betas,
        eps=optim.eps,
    )
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for model, optimizers in ((ours, [optimizer]), (ref, [torch_muon, torch_adamw])):
            for o in optimizers:
                o.zero_grad()
            (model(tokens[:, :-1], loss=NextTokenLoss(tokens[:, 1:])) / tokens[:, 1:].numel()).backward()
            for o in optimizers:
                o.step()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    assert all("momentum_buffer" in optimizer.state[p] for p in optimizer.param_groups[2]["params"])


MUON = {"name": "muon", "muon_lr": 0.02}


@pytest.mark.slow
def test_muon_under_fsdp_matches_one_process_and_resumes_exactly(tiny_data, tmp_path):
    """2 ranks FULL_SHARD (each matrix orthogonalized whole by its owner) give the losses of one process x
    accumulation 2 over 10 steps (fp32); a run stopped at step 5 continues exactly on 2 ranks, and on 1 rank with
    the momentum buffers resharded."""
    one = ["--data.grad_accum_steps", "2"]
    reference = _run(tiny_data, tmp_path / "one", one, optim=MUON)
    two = _run(tiny_data, tmp_path / "two", nproc=2, optim=MUON, checkpoint={"every": 5})
    assert len(two) == 10
    for step, ref in reference.items():
        assert two[step] == pytest.approx(ref, rel=1e-5), step
    adamw = _run(tiny_data, tmp_path / "adamw", nproc=2)
    assert adamw[10] != pytest.approx(two[10], rel=1e-3)  # Muon did update the matrices its own way
    # The measured optimizer state per rank is the planner's: one buffer per matrix weight, AdamW's two for the rest.
    model = parse_recipe(["--recipe", str(tiny_data)]).model
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    n_matrices = sum(p.numel() for n, p in Transformer(model).named_parameters() if n.split(".")[-2] in projections)
    formula = (4 * n_matrices + 8 * (count_params(model) - n_matrices)) / 2 / 1e9
    [state] = [r for r in read_metrics(tmp_path / "two") if "optimizer_gb" in r]
    assert state["optimizer_gb"] == pytest.approx(formula, rel=0.01) and formula < 8 * count_params(model) / 2 / 1e9

    step5 = tmp_path / "two" / "checkpoints" / "step_00000005"
    for name, nproc, extra in (("same", 2, []), ("resharded", 1, one)):
        losses = _run(tiny_data, tmp_path / name, extra, nproc=nproc, optim=MUON, checkpoint={"resume": step5})
        assert sorted(losses) == list(range(6, 11))
        for step in losses:
            if nproc == 2:
                assert losses[step] == two[step], step  # bitwise
            else:
                assert losses[step] == pytest.approx(two[step], rel=1e-5), step


def _run(tiny_data, out_dir, extra=(), nproc=1, **sections):
    train_cli([*run_args(tiny_data, out_dir, **sections), *extra], nproc=nproc)
    return train_losses(out_dir)


def test_newton_schulz_work_is_spread_evenly_over_ranks():
    """Every rank computes the same owners from names and shapes; the busiest rank gets its share of the FLOPs."""
    model = parse_recipe(["--recipe", str(REPO / "recipes" / "125m.yaml")]).model
    with torch.device("meta"):
        named = [
            (n, tuple(p.shape)) for n, p in Transformer(model).named_parameters() if ".layers." in n and p.ndim == 2
        ]
    names, shapes = [n for n, _ in named], [s for _, s in named]
    for world in (2, 3, 8):
        owners = assign_owners(names, shapes, world)
        assert owners == assign_owners(names[::-1], shapes[::-1], world)[::-1]  # the order given does not matter
        load = [
            sum(newton_schulz_flops(s) for s, o in zip(shapes, owners, strict=True) if o == r) for r in range(world)
        ]
        assert max(load) <= 1.05 * sum(load) / world
