"""Low-rank adapters (LoRA, Hu et al. 2021), applied to a built model from outside, as PEFT applies them.

apply_lora() swaps each target nn.Linear of every block (and the output layer, if targeted) for a LoRALinear that
keeps the frozen weight under its name (`model.layers.0.self_attn.q_proj.weight`, so a base checkpoint loads and an HF
export reads as before) and adds PEFT's `lora_A` (rank x in) and `lora_B` (out x rank):

    y = x W^T + (alpha / rank) * B A dropout(x)

A starts Kaiming-uniform, as PEFT's, and B at zero, so the adapted model starts as the base model exactly. Everything
else is frozen: no gradients and no optimizer state, but for a reward model's score head, which no base model has:
it is trained whole beside the adapters and saved with them (PEFT's modules_to_save). Apply it on the meta device,
before parallelize(): FSDP then shards the adapters with the weights they adapt.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_trainer.config import LoraConfig
from fsdp_trainer.hf import SCORE_HEAD
from fsdp_trainer.lean_autograd import gated
from fsdp_trainer.model import unwrapped_name
from fsdp_trainer.moe import Experts, grouped_linear, held


class LoRALinear(nn.Module):
    """A frozen linear layer (no bias, as every projection here) plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scaling = alpha / rank
        self.enabled = True  # off: the base layer alone (adapters_disabled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return F.linear(x, self.weight)
        return F.linear(x, self.weight) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


class LoRAEmbedding(nn.Module):
    """A frozen embedding plus a trainable low-rank update, as PEFT's: `lora_embedding_A` (rank x vocab) looked up
    like an embedding, then `lora_embedding_B` (dim x rank): W[ids] + (alpha / rank) A^T[ids] B^T. PEFT starts A at
    zero and B normal, the other way round from a linear layer's, and applies no dropout here."""

    def __init__(self, base: nn.Embedding, rank: int, alpha: float):
        super().__init__()
        self.weight = base.weight
        self.weight.requires_grad_(False)
        device = base.weight.device
        self.lora_embedding_A = nn.Parameter(torch.empty(rank, base.num_embeddings, device=device))
        self.lora_embedding_B = nn.Parameter(torch.empty(base.embedding_dim, rank, device=device))
        self.scaling = alpha / rank
        self.enabled = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return F.embedding(ids, self.weight)
        update = F.embedding(ids, self.lora_embedding_A.T) @ self.lora_embedding_B.T
        return F.embedding(ids, self.weight) + update * self.scaling


class ExpertsAdapter(nn.Module):
    """One low-rank adapter per expert on a stacked experts weight (experts, out, in), stacked like it, experts first:
    `lora_A.weight` (experts, rank, in) and `lora_B.weight` (experts, out, rank), so expert e's update is
    (alpha / rank) B_e A_e, and expert parallelism splits the adapters along the experts as it splits their weights
    (whole experts to a rank). PEFT's file layout for it (target_parameters) differs; adapters/peft_format.py
    converts on the way in and out."""

    def __init__(self, experts: int, in_features: int, out_features: int, rank: int, device: torch.device):
        super().__init__()
        self.rank = rank
        self.lora_A, self.lora_B = nn.Module(), nn.Module()
        self.lora_A.weight = nn.Parameter(torch.empty(experts, rank, in_features, device=device))
        self.lora_B.weight = nn.Parameter(torch.empty(experts, out_features, rank, device=device))

    def factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) as this rank holds them (moe.held) in `dtype`, laid out for grouped_linear. A grouped matmul's rows
        must start 16 bytes apart (torch's GPU kernel, and the meta kernel compile and the planner's fake step run):
        a rank narrower than that, 4 in bf16, is padded with zeros to it."""
        a, b = held(self.lora_A.weight).to(dtype), held(self.lora_B.weight).to(dtype)
        pad = -self.rank % (16 // a.element_size())
        if pad:
            return F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
        return a, b


class LoRAExperts(nn.Module):
    """A mixture of experts' frozen experts (moe.Experts, their weights under the same names) plus an adapter per
    expert on each projection: gate_up_lora on gate_up_proj, down_lora on down_proj."""

    def __init__(self, base: Experts, rank: int, alpha: float):
        super().__init__()
        self.gate_up_proj, self.down_proj = base.gate_up_proj, base.down_proj
        experts, gate_up, dim = base.gate_up_proj.shape
        device = base.gate_up_proj.device
        self.gate_up_lora = ExpertsAdapter(experts, dim, gate_up, rank, device)
        self.down_lora = ExpertsAdapter(experts, gate_up // 2, dim, rank, device)
        self.scaling = alpha / rank
        self.enabled = True

    def adapted(self, x: torch.Tensor, weight: torch.Tensor, adapter: ExpertsAdapter, offsets: torch.Tensor):
        y = grouped_linear(x, held(weight), offsets)
        if not self.enabled:
            return y
        a, b = adapter.factors(x.dtype)
        return y + grouped_linear(grouped_linear(x, a, offsets), b, offsets) * self.scaling

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        gate, up = self.adapted(x, self.gate_up_proj, self.gate_up_lora, offsets).chunk(2, dim=-1)
        return self.adapted(gated(gate, up), self.down_proj, self.down_lora, offsets)


def apply_lora(model: nn.Module, cfg: LoraConfig, frozen_dtype: torch.dtype | None = None) -> None:
    """Freeze every parameter of `model`, held in `frozen_dtype` from now on (the compute dtype: with no fp32 master
    copy, a frozen weight is stored as FSDP would all-gather it anyway, so the forward is unchanged and its memory
    halves in bf16), and give each `cfg.targets` projection of its blocks an adapter (fp32, as trained weights are).
    A reward model's score head stays trained, in fp32."""
    model.requires_grad_(False)
    if frozen_dtype is not None:
        for param in model.parameters():
            param.data = param.data.to(frozen_dtype)
    if model.cfg.num_labels is not None:
        model.score.float().requires_grad_(True)
    found = set()
    for block in model.model.layers.children():
        for name, module in list(block.named_modules()):
            parent_name, _, child = name.rpartition(".")
            if child in cfg.targets and isinstance(module, (nn.Linear, Experts)):
                parent = block.get_submodule(parent_name) if parent_name else block
                if isinstance(module, Experts):
                    adapted = LoRAExperts(module, cfg.rank, cfg.alpha)
                else:
                    adapted = LoRALinear(module, cfg.rank, cfg.alpha, cfg.dropout)
                setattr(parent, child, adapted)
                found.add(child)
    missing = sorted(set(cfg.targets) - found - {"lm_head", "embed_tokens"})
    if missing:  # a mixture of experts has no gate_proj, up_proj or down_proj layer but in its dense layers
        raise ValueError(
            f"lora.targets has {', '.join(missing)}, which no block of this model has (a mixture of experts' "
            "feed-forward is adapted as `experts`): leave them out"
        )
    if cfg.dropout and "experts" in cfg.targets:
        raise ValueError("lora.dropout applies to no expert's adapter (PEFT's neither): set it to 0")
    outside = {"lm_head", "embed_tokens"} & set(cfg.targets)
    if outside and model.cfg.tied_output:  # the recipe refuses it (config.Recipe)
        raise ValueError(f"{sorted(outside)[0]} is tied: an adapter on it could not be merged into the shared weight")
    if "lm_head" in cfg.targets:  # the objectives call the output layer, adapter and all (loss.py)
        model.lm_head = LoRALinear(model.lm_head, cfg.rank, cfg.alpha, cfg.dropout)
    if "embed_tokens" in cfg.targets:
        model.model.embed_tokens = LoRAEmbedding(model.model.embed_tokens, cfg.rank, cfg.alpha)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within it the model computes as its base, every adapter off: a LoRA preference run's reference model, with no
    second copy of the weights."""
    adapted = [m for m in model.modules() if isinstance(m, (LoRALinear, LoRAEmbedding, LoRAExperts))]
    for module in adapted:
        module.enabled = False
    try:
        yield
    finally:
        for module in adapted:
            module.enabled = True


def is_adapter(name: str) -> bool:
    """Whether a parameter (by its name) belongs to an adapter, not to the model it adapts."""
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name


def trained_with_adapters(name: str) -> bool:
    """Whether a parameter (by its name) is what a LoRA run trains and saves, not the frozen model it adapts: an
    adapter's, or a reward model's score head (PEFT's modules_to_save)."""
    return is_adapter(name) or name == SCORE_HEAD


@torch.no_grad()
def init_lora(
    model: nn.Module, seed: int, fill: Callable[[torch.Tensor, torch.Tensor], None], device: torch.device
) -> None:
    """A as PEFT's (kaiming_uniform_ with a=sqrt(5), i.e. uniform within 1/sqrt(in_features)) from a generator seeded
    by (seed, parameter name), so the same at any world size; B zero; for an embedding, A zero and B standard
    normal. `fill` writes full values into a (sharded) parameter, as for the model's own init."""
    for name, param in model.named_parameters():
        name = unwrapped_name(name)
        if name.endswith(("lora_B.weight", "lora_embedding_A")):
            fill(param, torch.zeros(param.shape, dtype=param.dtype, device=device))
        elif name.endswith(("lora_A.weight", "lora_embedding_B")):
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            values = torch.empty(param.shape, dtype=torch.float32, device=device)
            if name.endswith("lora_A.weight"):
                bound = 1 / math.sqrt(param.shape[-1])  # an expert adapter's A: (experts, rank, in)
                values.uniform_(-bound, bound, generator=gen)
            else:  # an embedding's B: PEFT's normal_(B)
                values.normal_(generator=gen)
            fill(param, values.to(param.dtype))


def merged(name: str, weight: torch.Tensor, adapters: dict[str, torch.Tensor], cfg: LoraConfig) -> torch.Tensor:
    """The weight `name` with its adapter among `adapters` (if it has one) folded in, in fp32: what the model computes
    with. A linear layer's is W + (alpha / rank) B A, an embedding's W + (alpha / rank) (B A)^T."""
    prefix = name.removesuffix(".weight")
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # each expert's adapter: W_e + s B_e A_e
        adapter = name.replace("_proj", "_lora")
        if f"{adapter}.lora_A.weight" not in adapters:
            return weight
        a, b = adapters[f"{adapter}.lora_A.weight"].float(), adapters[f"{adapter}.lora_B.weight"].float()
        return weight.float() + cfg.alpha / cfg.rank * (b @ a)
    if f"{prefix}.lora_A.weight" in adapters:
        a, b = adapters[f"{prefix}.lora_A.weight"], adapters[f"{prefix}.lora_B.weight"]
        return weight.float() + cfg.alpha / cfg.rank * (b.float() @ a.float())
    if f"{prefix}.lora_embedding_A" in adapters:
        a, b = adapters[f"{prefix}.lora_embedding_A"], adapters[f"{prefix}.lora_embedding_B"]
        return weight.float() + cfg.alpha / cfg.rank * (b.float() @ a.float()).T
    return weight


@torch.no_grad()
def load_adapters(
    model: nn.Module, adapters: dict[str, torch.Tensor], fill: Callable[[torch.Tensor, torch.Tensor], None]
) -> None:
    """Set the model's adapters to `adapters` (full tensors by name, e.g. a PEFT adapter's); `fill` writes each into
    its (sharded) parameter. Every adapter of the model must be given, and nothing else."""
    left = dict(adapters)
    for name, param in model.named_parameters():
        name = unwrapped_name(name)
        if not trained_with_adapters(name):
            continue
        if name not in left:
            raise ValueError(f"the adapter has no {name}; it was made for other layers or another model")
        values = left.pop(name)
        if tuple(values.shape) != tuple(param.shape):
            raise ValueError(f"the adapter's {name} has shape {tuple(values.shape)}, the model's {tuple(param.shape)}")
        fill(param, values.to(device=param.device, dtype=param.dtype))
    if left:
        raise ValueError(f"the adapter has {sorted(left)[0]}, which this model has no place for")
