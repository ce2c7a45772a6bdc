"""Expert parallelism (distributed/expert_parallel.py): a mixture of experts' experts split over the ranks of a group,
each token copy computed on the rank holding its expert. Against the whole model on one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_trainer.config import ModelConfig, MoEConfig
from fsdp_trainer.distributed.expert_parallel import apply_expert_parallel
from fsdp_trainer.loss import NextTokenLoss
from fsdp_trainer.model import Transformer
from fsdp_trainer.moe import aux_loss, routed_layers
from tests.helpers import run_distributed

CFG = ModelConfig(family="qwen3_moe", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                  moe=MoEConfig(experts=4, top_k=2, ffn_dim=16))  # fmt: skip


def _model() -> Transformer:
    model = Transformer(CFG)
    model.init_weights(seed=0)
    return model


def _loss(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss, the load-balancing loss and the first layer's copies per expert."""
    loss = model(tokens[:, :-1], loss=NextTokenLoss(tokens[:, 1:]))
    first = routed_layers(model)[0].routing[0].clone()
    return loss, aux_loss(model), first


def _equals_the_whole_model(rank: int, world: int) -> None:
    # Rank 0's batch repeats one token: its first layer routes every copy to the same 2 experts, none to the others.
    batches = [torch.full((2, 13), 5), torch.randint(0, CFG.vocab_size, (2, 13), generator=torch.Generator())]
    whole, split = _model(), _model()
    expected = [_loss(whole, tokens) for tokens in batches]  # each rank's batch: its loss and load-balancing loss
    sum(loss + 0.1 * aux for loss, aux, _ in expected).backward()
    apply_expert_parallel(split, dist.group.WORLD)
    loss, aux, first = _loss(split, batches[rank])
    assert (first == 0).sum() == (2 if rank == 0 else 0), first
    (loss + 0.1 * aux).backward()
    torch.testing.assert_close(loss, expected[rank][0].detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(aux, expected[rank][1].detach(), rtol=1e-6, atol=0)
    local = CFG.moe.experts // world
    for (name, ours), theirs in zip(split.named_parameters(), whole.parameters(), strict=True):
        if "experts" in name:  # this rank's experts' gradients: every rank's copies of them, sent back here
            theirs_grad, grad = theirs.grad[rank * local : (rank + 1) * local], ours.grad
        else:  # the rest: each rank's share, summed (as FSDP's reduce-scatter sums them)
            theirs_grad, grad = theirs.grad, ours.grad.clone()
            dist.all_reduce(grad)
        assert (grad - theirs_grad).abs().max() <= 1e-5 * theirs_grad.abs().max(), name
    assert split.model.layers["0"].mlp.experts.gate_up_proj.shape[0] == local


def test_two_ranks_of_experts_compute_the_whole_models_loss_and_gradients():
    """EP 2: each rank holds 2 of the 4 experts and routes its own tokens; its loss and load-balancing loss are the
    whole model's on its batch, its experts' gradients the whole model's over both ranks' batches, and every other
    gradient summed over the ranks is the whole model's (fp32, 1e-5), with uneven routing: rank 0 sends no copy to
    two of the experts."""
    run_distributed(_equals_the_whole_model)
