"""A mixture of experts' weights between the layouts of Hugging Face files and ours (moe.py).

The Hub's Qwen3-MoE checkpoints hold a tensor per expert and projection (`mlp.experts.7.gate_proj.weight`); transformers
5 holds them stacked in memory (`mlp.experts.gate_up_proj`: experts x (gate rows, up rows) x dim; `mlp.experts.
down_proj`: experts x dim x ffn), and so do we. Both import to the same weights; export writes the Hub's layout, which
every transformers version loads. A stacked tensor is read from its parts only when it is asked for, and written out
part by part, so import and export still hold one stacked tensor at a time, not the model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Stacked:
    """A stacked experts tensor made of per-expert tensors (each with `shape` and `read()`, as hf.StoredTensor):
    expert e's parts concatenated along their rows, the experts stacked."""

    def __init__(self, parts: list[list[Any]]):
        self.parts = parts
        rows = sum(part.shape[0] for part in parts[0])
        self.shape = torch.Size([len(parts), rows, parts[0][0].shape[1]])
        self.dtype = parts[0][0].dtype

    def read(self) -> torch.Tensor:
        return torch.stack([torch.cat([part.read() for part in expert]) for expert in self.parts])


def stacked_experts(stored: dict[str, Any], source: str = "") -> dict[str, Any]:
    """`stored` (name -> stored tensor) with each layer's per-expert tensors replaced by the two stacked ones; a
    layer's experts must be numbered 0..n-1, each with its three projections (ValueError naming what lacks)."""
    out, layers = {}, {}
    for name, entry in stored.items():
        match = PER_EXPERT.match(name)
        if match is None:
            out[name] = entry
        else:
            layers.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = entry
    for prefix, experts in layers.items():
        for e in range(len(experts)):
            lacking = [p for p in PROJECTIONS if p not in experts.get(e, {})]
            if lacking:
                raise ValueError(f"{source}: {prefix}.{e} lacks {', '.join(lacking)} (experts are numbered 0..n-1)")
        ordered = [experts[e] for e in range(len(experts))]
        out[f"{prefix}.gate_up_proj"] = Stacked([[expert["gate_proj"], expert["up_proj"]] for expert in ordered])
        out[f"{prefix}.down_proj"] = Stacked([[expert["down_proj"]] for expert in ordered])
    return out


def per_expert(
    shapes: dict[str, torch.Size], tensors: Iterable[tuple[str, torch.Tensor]]
) -> tuple[dict[str, torch.Size], Iterator[tuple[str, torch.Tensor]]]:
    """Our weights (`shapes`, and the tensors one at a time in that order) in the Hub's layout: each stacked experts
    tensor as its per-expert tensors, in the same place of the order."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix, ffn = name.removesuffix(".gate_up_proj"), shape[1] // 2
            for e in range(shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = out[f"{prefix}.{e}.up_proj.weight"] = torch.Size(
                    [ffn, shape[2]]
                )
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = torch.Size(shape[1:])
        else:
            out[name] = shape

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            if name.endswith(".experts.gate_up_proj"):
                prefix = name.removesuffix(".gate_up_proj")
                for e, (gate, up) in enumerate(t.chunk(2) for t in tensor):
                    yield f"{prefix}.{e}.gate_proj.weight", gate
                    yield f"{prefix}.{e}.up_proj.weight", up
            elif name.endswith(".experts.down_proj"):
                prefix = name.removesuffix(".down_proj")
                for e, down in enumerate(tensor):
                    yield f"{prefix}.{e}.down_proj.weight", down
            else:
                yield name, tensor

    return out, stream()
