"""Throughput and memory of fsdp_trainer against a hand-written FSDP2 loop, measured side by side.

    python tools/bench.py --recipe recipes/debug.yaml --nproc 2 --steps 20 [--repeats 2] [--model.dim 512 ...]

Runs, in pairs that alternate which goes first, each as its own torchrun job (so peak memory is per job): the
trainer (`python -m fsdp_trainer.train`, logging every --log_every steps, no eval, no checkpoints) and
tools/baseline_loop.py (the same model, init, batch and optimizer in a plain loop that never logs). Both read the same
token file: random tokens by default (--data synthetic), or the recipe's train_path (--data recipe). Throughput is
measured over --steps steps after a warmup of --log_every steps. Prints a table (MFU on known GPUs; the median and
largest step time, for the spread), each pair's ratio ours / baseline and their median, the headline, and writes
everything to --out as JSON. Flags it does not know are recipe overrides (`--model.dim 512`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fsdp_trainer.config import parse_recipe, recipe_to_yaml  # noqa: E402
from fsdp_trainer.data import write_token_file  # noqa: E402
from fsdp_trainer.metrics import flops_per_token, peak_flops  # noqa: E402
from fsdp_trainer.tokenizer import file_sha256  # noqa: E402


def synthetic_data(tmp: Path, vocab_size: int, n_tokens: int) -> tuple[str, str]:
    """A token file of uniform random ids, and a stand-in tokenizer file whose hash the token file's meta names."""
    tokenizer = tmp / "synthetic.tokenizer"
    tokenizer.write_bytes(b"synthetic tokens: no tokenizer\n")
    tokens = np.random.default_rng(0).integers(0, vocab_size, n_tokens)
    write_token_file(tmp / "train.bin", tokens, vocab_size, file_sha256(tokenizer))
    return str(tmp / "train.bin"), str(tokenizer)


def run_ours(
    recipe_path, train_path, tokenizer_path, nproc, steps, log_every, tokens_per_step, tmp: Path, flags=()
) -> dict:
    """Train under torchrun (`flags` override the recipe) and read throughput, peak memory and the training state
    per rank from the run's metrics.jsonl."""
    out = tmp / "ours_run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "fsdp_trainer.train", "--recipe", recipe_path, "--data.train_path", train_path,
           "--data.val_path", "null", "--data.tokenizer_path", tokenizer_path, "--train.steps", str(log_every + steps),
           "--train.log_every", str(log_every), "--train.eval_every", "0", "--checkpoint.every", "0",
           "--checkpoint.resume", "none", "--train.out_dir", str(out), *flags]  # fmt: skip
    _run(cmd)
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    lines = [r for r in records if "loss" in r]
    first, last = lines[0], lines[-1]  # logged after the warmup steps, and after the last step
    elapsed = last["elapsed_s"] - first["elapsed_s"]
    state = next(r for r in records if "state_gb" in r)
    tokens = (last["step"] - first["step"]) * tokens_per_step
    measured = lines[1:]  # the log windows after the warmup's
    return {"tokens_per_s": tokens / elapsed, "tokens_per_cpu_s": tokens / (last["cpu_s"] - first["cpu_s"]),
            "peak_mem_gb": max(r["peak_mem_gb"] for r in lines), "mfu": last["mfu"], "loss": last["loss"],
            # A window logs its median step time; the median of those is the run's within a step or two.
            "step_time_s": statistics.median(r["step_time_s"] for r in measured),
            "step_time_max_s": max(r["step_time_max_s"] for r in measured),
            **{k: state[k] for k in ("params_gb", "grads_gb", "optimizer_gb", "state_gb")}}  # fmt: skip


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(
            f"error: {' '.join(cmd[:8])} ... exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )


def run_baseline(recipe_path, train_path, nproc, steps, warmup, tmp: Path) -> dict:
    out = tmp / "baseline.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(REPO / "tools" / "baseline_loop.py"), "--recipe", recipe_path, "--train_path", train_path,
           "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]  # fmt: skip
    _run(cmd)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="measured steps (a multiple of --log_every)")
    parser.add_argument("--log_every", type=int, default=10, help="ours logs this often; also the warmup length")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--data", choices=["synthetic", "recipe"], default="synthetic")
    parser.add_argument("--out", default="bench_out/bench.json")
    args, overrides = parser.parse_known_args()
    if args.steps % args.log_every:
        parser.error(f"--steps={args.steps} must be a multiple of --log_every={args.log_every}")
    recipe = parse_recipe(["--recipe", args.recipe, *overrides])
    data = recipe.data
    tokens_per_step = data.micro_batch_size * data.grad_accum_steps * data.seq_len * args.nproc

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        recipe_path = str(tmp / "recipe.yaml")
        Path(recipe_path).write_text(recipe_to_yaml(recipe))
        if args.data == "synthetic":
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
    # MFU of both from their tokens/s, against the device's dense bf16 peak (none on CPU and on unknown devices).
    peak = peak_flops(torch.device("cuda")) if torch.cuda.is_available() else None
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
        json.dump({"args": vars(args), "overrides": overrides, "runs": results, "summary": summary,
                   "pair_ratios": pair_ratios, "ratio": ratio,
                   "cpu_pair_ratios": cpu_ratios, "cpu_ratio": cpu_ratio}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
