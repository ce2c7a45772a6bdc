"""A block's RMSNorm and gated activation as autograd functions that keep only their inputs for backward.

Autograd keeps what each small op of a norm or of silu(gate) * up needs: the norm's fp32 copy of its input and its
normalized input, the activation's output. These compute the same forward, op for op, keep the inputs (and the norm's
fp32 reciprocal RMS, one number a row), and recompute the rest in backward with the formulas autograd would apply
(torch's derivatives.yaml), so a gradient is autograd's to the rounding of a sum's order (tests/test_model.py). What
that saves, per token and layer without AC: in a Llama or Qwen3 block 4 x dim bytes a norm and the gate's width in
the compute dtype; Gemma 3's four norms in fp32 more. planner/activations.py counts what is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
        xf = x.float()
        rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rms)
        ctx.offset = offset
        normed = xf * rms
        if offset:  # Gemma 3: scaled by 1 + weight in fp32, cast back after
            return (normed * (1.0 + weight.float())).to(x.dtype)
        return weight * normed.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rms = ctx.saved_tensors
        xf = x.float()
        normed = xf * rms
        if ctx.offset:
            grad = grad.to(torch.float32)
            grad_weight = (grad * normed).sum_to_size(weight.shape).to(weight.dtype)
            grad_normed = grad * (1.0 + weight.float())
        else:  # each product's gradient is cast to its operand's dtype, as autograd does (when weight's is not x's)
            grad_weight = (grad * normed.to(x.dtype)).sum_to_size(weight.shape).to(weight.dtype)
            grad_normed = (grad * weight).to(x.dtype).to(torch.float32)
        grad_rms = (grad_normed * xf).sum_to_size(rms.shape)
        grad_mean = -0.5 * grad_rms * rms.pow(3)  # rsqrt's derivative
        grad_squares = grad_mean.expand(xf.shape) / xf.shape[-1]
        grad_x = grad_normed * rms + grad_squares * (2.0 * xf)
        return grad_x.to(x.dtype), grad_weight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """x / RMS(x) in fp32, times weight (cast to x's dtype first), or with `offset` times 1 + weight in fp32 and cast
    after; keeps x and the reciprocal RMS for backward."""
    return _RMSNorm.apply(x, weight, eps, offset)


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, tanh_gelu: bool) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.tanh_gelu = tanh_gelu
        return _activation(gate, tanh_gelu) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_up = grad * _activation(gate, ctx.tanh_gelu)
        if ctx.tanh_gelu:
            grad_gate = torch.ops.aten.gelu_backward(grad * up, gate, approximate="tanh")
        else:
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up, None


def _activation(gate: torch.Tensor, tanh_gelu: bool) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") if tanh_gelu else F.silu(gate)


def gated(gate: torch.Tensor, up: torch.Tensor, tanh_gelu: bool = False) -> torch.Tensor:
    """silu(gate) * up (SwiGLU), or GELU's tanh approximation in place of silu (GeGLU); keeps gate and up alone for
    backward, the activation recomputed there."""
    return _Gated.apply(gate, up, tanh_gelu)


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """rms_norm in autograd's own small ops, as transformers writes it: the reference rms_norm is held to (its values,
    gradients and what it keeps; tests/, benchmarks/bench_lean_ops.py). The model does not use it."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype) if offset else weight * xf.to(x.dtype)


def plain_gated(gate: torch.Tensor, up: torch.Tensor, tanh_gelu: bool = False) -> torch.Tensor:
    """gated in autograd's own small ops: its reference, as plain_rms_norm is rms_norm's."""
    return _activation(gate, tanh_gelu) * up
