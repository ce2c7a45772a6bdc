"""Throughput and memory of fsdp_trainer against a hand-written FSDP2 loop, measured side by side.

    python benchmarks/bench.py --recipe recipes/debug.yaml --nproc 2 --steps 20 [--repeats 2] [--model.dim 512 ...]

Runs, in pairs that alternate which goes first, each as its own torchrun job (so peak memory is per job): the
trainer (`python -m fsdp_trainer.train`, logging every --log_every steps, no eval, no checkpoints) and
baseline_loop.py (the same model, init, batch and optimizer in a plain loop that never logs). Both read the same
token file: random tokens by default (--tokens synthetic), or the recipe's train_path (--tokens recipe). Throughput is
measured over --steps steps after a warmup of --log_every steps. Prints a table (MFU on known GPUs; the median and
largest step time, for the spread), each pair's ratio ours / baseline and their median, the headline, and writes
everything to --out as JSON. Any recipe key can be overridden as in training (`--model.dim 512`).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Literal

import torch
from runner import report_header, run_baseline, run_ours, synthetic_data

from fsdp_trainer.config import fail, parse_args, recipe_parser, recipe_to_yaml
from fsdp_trainer.distributed.runtime import precision_on
from fsdp_trainer.metrics import flops_per_token, peak_flops


def main(argv: list[str] | None = None) -> None:
    parser = recipe_parser("benchmarks/bench.py", __doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="measured steps (a multiple of --log_every)")
    parser.add_argument("--log_every", type=int, default=10, help="ours logs this often; also the warmup length")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens", type=Literal["synthetic", "recipe"], default="synthetic",
                        help="random ids, or the recipe's data.train_path")  # fmt: skip
    parser.add_argument("--out", default="bench_out/bench.json")
    recipe, args = parse_args(parser, argv)
    # Both implementations compute in what the trainer would choose here (auto: what this device does natively).
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    recipe.parallel.mixed_precision, _ = precision_on(recipe.parallel.mixed_precision, device_type)
    if args.steps % args.log_every:
        fail(f"--steps={args.steps} must be a multiple of --log_every={args.log_every}")
    data = recipe.data
    tokens_per_step = data.micro_batch_size * data.grad_accum_steps * data.seq_len * args.nproc

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        recipe_path = str(tmp / "recipe.yaml")
        Path(recipe_path).write_text(recipe_to_yaml(recipe))
        if args.tokens == "synthetic":
            n_tokens = 4 * (args.log_every + args.steps) * tokens_per_step + 1
            train_path, tokenizer_path = synthetic_data(tmp, recipe.model.vocab_size, n_tokens)
        else:
            train_path, tokenizer_path = recipe.data.train_path, recipe.data.tokenizer_path
        results = {"ours": [], "baseline": []}
        run = {
            "baseline": lambda: run_baseline(recipe_path, train_path, args.nproc, args.steps, args.log_every, tmp),
            "ours": lambda: run_ours(recipe_path, train_path, tokenizer_path, args.nproc, args.steps, args.log_every,
                                     tokens_per_step, tmp),
        }  # fmt: skip
        for i in range(args.repeats):
            # Pairs alternate which runs first, so a machine that slows down or speeds up over the run favours neither.
            for impl in ("baseline", "ours") if i % 2 == 0 else ("ours", "baseline"):
                results[impl].append(run[impl]())
            print(f"baseline {results['baseline'][-1]['tokens_per_s']:,.0f} tok/s | "
                  f"ours {results['ours'][-1]['tokens_per_s']:,.0f} tok/s", flush=True)  # fmt: skip

    summary = {}
    for impl, runs in results.items():
        summary[impl] = {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
            "tokens_per_s_min": min(r["tokens_per_s"] for r in runs),
            "tokens_per_s_max": max(r["tokens_per_s"] for r in runs),
            "peak_mem_gb_max": max(r["peak_mem_gb"] for r in runs),
            "step_time_s_median": statistics.median(r["step_time_s"] for r in runs),
            "step_time_max_s": max(r["step_time_max_s"] for r in runs),
        }

    # The headline is the median over pairs of ours / baseline: a pair ran back to back, so it shares the machine's
    # state of the moment, which on a shared machine moves more than the difference being measured.
    def ratios(key: str) -> list[float]:
        return [o[key] / b[key] for o, b in zip(results["ours"], results["baseline"], strict=True)]

    pair_ratios = ratios("tokens_per_s")
    ratio = statistics.median(pair_ratios)
    # The same per CPU second of rank 0: work done, blind to time other processes on a shared machine take.
    cpu_ratios = ratios("tokens_per_cpu_s")
    cpu_ratio = statistics.median(cpu_ratios)
    shape = recipe.model
    # MFU of both from their tokens/s, against the device's dense peak in the precision they computed in (none on CPU
    # and on unknown devices).
    peak = peak_flops(torch.device(device_type), recipe.parallel.mixed_precision)
    flops = flops_per_token(shape, data.seq_len)
    for s in summary.values():
        s["mfu"] = s["tokens_per_s_median"] * flops / (peak * args.nproc) if peak else None
    print(f"\n{recipe.model.family} dim {shape.dim} x {shape.n_layers} layers, seq {recipe.data.seq_len}, "
          f"{recipe.parallel.sharding}, {recipe.parallel.mixed_precision}, {args.nproc} ranks, "
          f"{flops / 1e6:.0f} MFLOP/token")  # fmt: skip
    print("| impl | tokens/s (median) | min - max | per device | MFU | step s: median (max) | peak mem / rank |")
    print("|---|---|---|---|---|---|---|")
    for impl, s in summary.items():
        mfu = "-" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
        step_time = f"{s['step_time_s_median']:.3f} ({s['step_time_max_s']:.3f})"
        print(f"| {impl} | {s['tokens_per_s_median']:,.0f} | {s['tokens_per_s_min']:,.0f} - "
              f"{s['tokens_per_s_max']:,.0f} | {s['tokens_per_s_median'] / args.nproc:,.0f} | {mfu} | {step_time} | "
              f"{s['peak_mem_gb_max']:.2f} GB |")  # fmt: skip
    print(f"ours / baseline per pair: {', '.join(f'{r:.3f}' for r in pair_ratios)}")
    print(f"ours / baseline = {ratio:.3f} (median over pairs)")
    print(f"per CPU second of rank 0, ours / baseline per pair: {', '.join(f'{r:.3f}' for r in cpu_ratios)}; "
          f"median {cpu_ratio:.3f}")  # fmt: skip
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        header = report_header(recipe, args, ("nproc", "steps", "log_every", "repeats", "tokens"))
        json.dump({**header, "runs": results, "summary": summary,
                   "pair_ratios": pair_ratios, "ratio": ratio,
                   "cpu_pair_ratios": cpu_ratios, "cpu_ratio": cpu_ratio}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
