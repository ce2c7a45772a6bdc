"""What keeping less costs in compute: a block's RMSNorm and gated product, forward and backward, through
fsdp_trainer/lean_autograd.py (inputs kept, the rest recomputed in backward) against autograd's own small ops
(its plain_rms_norm and plain_gated, what the block ran before), one thread, alternating which goes first.

    python benchmarks/bench_lean_ops.py --shapes 256x1024 768x2048 --calls 200 --rounds 2 --dtype bf16

Each shape is WIDTHxTOKENS: a norm over WIDTH and a gated product 4 x WIDTH wide. Prints microseconds a call of both,
forward and backward, per round. The memory side is counted exactly in tests/test_plan.py and measured in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from fsdp_trainer.lean_autograd import gated, plain_gated, plain_rms_norm, rms_norm


def time_calls(norm, act, width: int, tokens: int, dtype: torch.dtype, calls: int) -> float:
    """Microseconds a call of norm and act, forward and backward, at these shapes."""
    x = torch.randn(tokens, width, dtype=dtype, requires_grad=True)
    weight = torch.ones(width, dtype=dtype, requires_grad=True)
    gate = torch.randn(tokens, 4 * width, dtype=dtype, requires_grad=True)
    up = torch.randn(tokens, 4 * width, dtype=dtype, requires_grad=True)
    start = time.perf_counter()
    for _ in range(calls):
        (norm(x, weight, 1e-6).sum() + act(gate, up).sum()).backward()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["256x1024", "768x2048"], help="WIDTHxTOKENS")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    sides = {"plain": (plain_rms_norm, plain_gated), "lean": (rms_norm, gated)}
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.dtype}, one thread")
    print("| width x tokens | round | plain us | lean us | lean / plain |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        width, tokens = map(int, shape.split("x"))
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            took = {name: time_calls(*sides[name], width, tokens, dtype, args.calls) for name in order}
            print(f"| {shape} | {round_ + 1} | {took['plain']:,.0f} | {took['lean']:,.0f} | "
                  f"{took['lean'] / took['plain']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
