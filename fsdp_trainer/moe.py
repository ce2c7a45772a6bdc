"""A mixture of experts in place of the feed-forward (Qwen3-MoE), in plain PyTorch.

A router scores each token against every expert (a linear layer, softmax in fp32), keeps the top k and weighs their
outputs by those probabilities (renormalized to sum to 1 with norm_topk_prob). Each expert is a SwiGLU feed-forward;
the experts' weights are held as one stacked tensor per projection, transformers' own layout in memory:
`experts.gate_up_proj` (experts, 2 x ffn, dim: the gate's rows, then the up projection's) and `experts.down_proj`
(experts, dim, ffn), so FSDP shards them like any weight (along the experts). A forward sorts the token copies by
expert and computes each projection for all experts in one grouped matmul (torch._grouped_mm): no loop over
experts and no host sync, so its shapes are static (a step on fake tensors runs it as a GPU would). A GPU's grouped
matmul takes bf16 only: in fp32 or fp16 there, a matmul per expert.

The router's load-balancing loss (Switch Transformer's, as transformers computes it: experts x sum over experts of the
fraction of token copies routed to each times its mean probability, over every MoE layer's tokens) comes from the
counts and probabilities each layer's forward routed with, kept by the last forward that built a graph (`aux_loss`),
for the step to add with moe.aux_loss_coef.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from fsdp_trainer.config import ModelConfig
from fsdp_trainer.lean_autograd import gated


class Experts(nn.Module):
    """`experts` SwiGLU feed-forwards, their weights stacked: each token copy goes through its own expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        self.gate_up_proj = nn.Parameter(torch.empty(moe.experts, 2 * moe.ffn_dim, cfg.dim))
        self.down_proj = nn.Parameter(torch.empty(moe.experts, cfg.dim, moe.ffn_dim))

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x (copies, dim) sorted by expert, expert e's rows ending at offsets[e] (int32) -> (copies, dim)."""
        gate, up = grouped_linear(x, held(self.gate_up_proj), offsets).chunk(2, dim=-1)
        return grouped_linear(gated(gate, up), held(self.down_proj), offsets)


def held(weight: torch.Tensor) -> torch.Tensor:
    """An experts' weight as this rank holds it: under expert parallelism a DTensor of every expert whose local part
    is this rank's experts (distributed/expert_parallel.py), that part; else the weight. (isinstance: a compiled
    block's trace does not see a DTensor's methods through hasattr.)"""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each group of rows of x times its expert's weight (experts, out, in) transposed, as F.linear does, in one
    grouped matmul. CPU's grouped matmul differentiates only a contiguous (experts, in, out) weight: a copy there,
    but for the planner's step on fake tensors, which stands for a GPU's (it multiplies the transposed view)."""
    weight = weight.transpose(-2, -1)
    if x.device.type != "cpu" and x.dtype != torch.bfloat16:  # torch's GPU grouped matmul takes bf16 alone
        return looped_linear(x, weight, offsets)
    if x.device.type == "cpu" and not (torch.compiler.is_compiling() or is_fake(x)):  # compiled, torch lays it out
        weight = weight.contiguous()
    return torch._grouped_mm(x, weight, offs=offsets)


def looped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grouped_linear as a matmul per expert, for a dtype the grouped matmul does not take (fp32, fp16 on a GPU):
    reading where each expert's rows end is a host sync. `weight` is (experts, in, out)."""
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([x[start:end] @ weight[e] for e, (start, end) in enumerate(zip(starts, ends, strict=True))])


class Router(nn.Module):
    """Scores a token against each expert: HF's `mlp.gate` (experts, dim)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.moe.experts, cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MixtureOfExperts(nn.Module):
    """HF's Qwen3MoeSparseMoeBlock: the router (`gate`) and the experts, (B, T, dim) -> (B, T, dim)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.n_experts = cfg.moe.top_k, cfg.moe.norm_topk_prob, cfg.moe.experts
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.routing: tuple[torch.Tensor, torch.Tensor, int] | None = None
        """The last forward's token copies per expert, router probabilities summed per expert (with their graph) and
        tokens, kept where autograd records: for the load-balancing loss (aux_loss)."""
        self.dispatch: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        """Expert parallelism (distributed/expert_parallel.py): `experts` holds this rank's experts, and dispatch(
        experts, copies sorted by expert, copies per expert) computes each copy where its expert is, in that order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probabilities = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (tokens, experts)
        weights, chosen = torch.topk(probabilities, self.top_k, dim=-1)  # (tokens, k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        copies = chosen.reshape(-1)  # token t's k copies at t * k ... t * k + k - 1
        order = torch.argsort(copies, stable=True)
        per_expert = torch.zeros(self.n_experts, dtype=torch.int32, device=x.device)
        per_expert.scatter_add_(0, copies, torch.ones_like(copies, dtype=torch.int32))
        if torch.is_grad_enabled() and not recomputing():
            self.routing = per_expert, probabilities.sum(dim=0), len(probabilities)
        offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
        token = order // self.top_k
        rows = x[token]
        out = self.experts(rows, offsets) if self.dispatch is None else self.dispatch(self.experts, rows, per_expert)
        out = out * weights.to(x.dtype).reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, out).reshape(shape)


def recomputing() -> bool:
    """Whether this forward is activation checkpointing's recomputation of a block in backward. It must not keep its
    routing: the recomputed graph that would hang from it holds the block's recomputed activations (its attention's,
    up to the router) until the step's backward ends, every layer's, which was 0.45 GB a layer at Qwen3-30B-A3B's
    shapes. A compiled block's recomputation is its compiled backward's, which replays no side effect
    (parallelize.apply_compile)."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1  # inside a backward


def moe_layers(cfg: ModelConfig) -> frozenset[int]:
    """The layers whose feed-forward is a mixture of experts: every moe.sparse_step-th, but moe.dense_layers."""
    if cfg.moe is None:
        return frozenset()
    step, dense = cfg.moe.sparse_step, set(cfg.moe.dense_layers)
    return frozenset(i for i in range(cfg.n_layers) if (i + 1) % step == 0 and i not in dense)


def routed_layers(model: nn.Module) -> list[MixtureOfExperts]:
    """`model`'s mixture of experts layers (none for a dense model, found without walking it)."""
    if model.cfg.moe is None:
        return []
    return [module for module in model.modules() if isinstance(module, MixtureOfExperts)]


def forget_routing(model: nn.Module) -> None:
    """Drop the routing a forward kept (a forward the step takes no aux_loss of, a reward model's say), with the graph
    it hangs from."""
    for layer in routed_layers(model):
        layer.routing = None


def aux_loss(model: nn.Module, summed: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
    """The load-balancing loss of `model`'s last forward with autograd on (None without experts), as transformers'
    load_balancing_loss_func: the fractions and mean probabilities over every MoE layer's tokens together; with
    `summed` (a tensor summed over the ranks holding the other parts of the same windows, with its gradient: context
    parallelism), over those ranks' tokens too."""
    routings = [layer.routing for layer in routed_layers(model) if layer.routing is not None]
    if not routings:
        return None
    forget_routing(model)
    counts = sum(per_expert.float() for per_expert, _, _ in routings)
    probabilities = sum(summed for _, summed, _ in routings)
    rows = counts.new_tensor(sum(tokens for _, _, tokens in routings))
    if summed is not None:
        counts, probabilities, rows = summed(counts), summed(probabilities), summed(rows)
    return len(counts) * torch.sum((counts / rows) * (probabilities / rows))
