"""A mixture of experts' layer: our grouped experts (moe.py: tokens sorted by expert, one grouped matmul per
projection) against transformers' Qwen3MoeSparseMoeBlock, which loops over the experts a batch reaches.

    python benchmarks/bench_moe.py --recipe recipes/qwen3_30b_a3b_lora.yaml --tokens 2048 --repeats 5

One process, fp32 on a CPU (bf16 where the CPU computes it natively, with --dtype bf16): the recipe's MoE layer shape
(dim, experts, top_k, expert width) with the same weights in both, forward + backward of a random batch of `tokens`
tokens, alternating which goes first, `repeats` rounds of `steps` each after a warm-up. Checks the two give the same
output, then reports the median time of each, tokens/s and their ratio, as a markdown table.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_block_causal import timed

from fsdp_trainer.config import compute_dtype, parse_recipe
from fsdp_trainer.moe import MixtureOfExperts


def transformers_block(cfg, ours: MixtureOfExperts):
    """transformers' Qwen3-MoE block with our layer's weights: its experts computed one after another."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        hidden_size=cfg.dim, num_experts=cfg.moe.experts, num_experts_per_tok=cfg.moe.top_k,
        moe_intermediate_size=cfg.moe.ffn_dim, norm_topk_prob=cfg.moe.norm_topk_prob,
    )  # fmt: skip
    config._experts_implementation = "eager"  # the loop over experts, transformers' reference implementation
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    block.load_state_dict(ours.state_dict())
    return block


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    args = parser.parse_args(argv)
    cfg = parse_recipe(["--recipe", args.recipe]).model
    if cfg.moe is None:
        raise SystemExit(f"error: {args.recipe} has no model.moe section: not a mixture of experts")
    dtype = compute_dtype(args.dtype)
    torch.manual_seed(0)
    ours = MixtureOfExperts(cfg)
    for param in ours.parameters():
        torch.nn.init.normal_(param, std=0.02)
    theirs = transformers_block(cfg, ours).to(dtype)
    ours = ours.to(dtype)
    x = torch.randn(1, args.tokens, cfg.dim, dtype=dtype)
    with torch.no_grad():
        gap = (ours(x) - theirs(x)).abs().max().item()
    print(f"max |ours - transformers'| = {gap:.2e}")

    def step(layer):
        def run():
            layer.zero_grad(set_to_none=True)
            layer(x).square().mean().backward()

        return run

    runs = {"grouped (ours)": step(ours), "loop over experts (transformers)": step(theirs)}
    for run in runs.values():
        run()  # warm-up
    times = {name: [] for name in runs}
    for r in range(args.repeats):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(timed(runs[name], args.steps))
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, {args.dtype}")
    print(f"experts {cfg.moe.experts}, top_k {cfg.moe.top_k}, dim {cfg.dim}, expert width {cfg.moe.ffn_dim}, "
          f"{args.tokens} tokens, forward + backward")  # fmt: skip
    print("| layer | median s | tokens/s | vs loop |\n|---|---|---|---|")
    loop = statistics.median(times["loop over experts (transformers)"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.4f} | {args.tokens / median:,.0f} | {loop / median:.2f}x |")


if __name__ == "__main__":
    main()
