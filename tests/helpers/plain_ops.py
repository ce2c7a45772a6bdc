"""A block's RMSNorm and gated activation in autograd's own small ops, as transformers writes them: the reference
fsdp_trainer/lean_autograd.py is held to (its values and gradients, and what it keeps for backward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """RMSNorm computed in fp32; Gemma 3's (`offset`) times 1 + weight, cast after."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype) if offset else weight * xf.to(x.dtype)


def plain_gated(gate: torch.Tensor, up: torch.Tensor, tanh_gelu: bool = False) -> torch.Tensor:
    return (F.gelu(gate, approximate="tanh") if tanh_gelu else F.silu(gate)) * up
