"""Online RL, ours against TRL's GRPOTrainer: the same GRPO steps on the same start, side by side on CPU ranks,
alternating, in one run.

    python benchmarks/bench_grpo.py --nproc 2 --steps 40 --repeats 2 --out bench_out/grpo.json

One config-built Qwen3 (a ChatML byte-level BPE trained on the bundled corpus, bench_peers.py's) is first taught the
bundled digit reversal by a short SFT of ours ("Reverse 4821" -> "#### 1284"), exported to HF; both sides start from
that export. Each then runs --steps GRPO steps on the bundled reversal prompts: --prompts_per_rank prompts a rank a
step, --generations completions each, sampled by the policy being trained (TRL through transformers' generate, as
without vLLM; ours through its KV cache, each prompt's keys shared by its completions), rewarded by
`fsdp_trainer.rewards` exact_answer and matching_characters (TRL's signature: the same functions on both sides), DAPO's
loss with clip-higher, fp32, DDP (ours `parallel.sharding NO_SHARD`: TRL's Trainer runs DDP on CPU ranks), the same
AdamW at a constant rate. Per run: seconds a step and sampled completion tokens a second over the training loop, the
peak RSS of a rank, and the reward curve (the sampled completions' mean reward, and exact answers, first and last
fifth of the steps), so that a faster side that learns less shows.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_peers import tokenizer_and_model, tool
from runner import launch, torchrun_command, write_rows

from fsdp_trainer.convert import consolidate, import_hf
from fsdp_trainer.files import METRICS_FILE

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "fsdp_trainer" / "assets"
REWARDS = ("exact_answer", "matching_characters")
SIDES = ("ours", "trl")


def sft_start(args, work: Path) -> tuple[Path, Path]:
    """(the SFT run, its HF export): the imported model taught the reversal by --sft_steps of ours."""
    imported, data, run = work / "imported", work / "sft_data" / "train.bin", work / "sft"
    tool("prepare_data.py", "--recipe", imported / "model.yaml", "--format", "chat", "--input",
         ASSETS / "reverse_sft.jsonl.gz", "--data.tokenizer_path", imported, "--data.train_path", data,
         "--data.val_path", "null", "--val_fraction", "0", "--data.seq_len", "128")  # fmt: skip
    flags = ["--recipe", str(imported / "model.yaml"), "--checkpoint.resume", str(imported), "--train.out_dir",
             str(run), "--train.steps", str(args.sft_steps), "--train.eval_every", "0", "--train.log_every", "50",
             "--checkpoint.every", str(args.sft_steps), "--data.train_path", str(data), "--data.val_path", "null",
             "--data.tokenizer_path", "null", "--data.seq_len", "128", "--data.micro_batch_size", "8",
             "--parallel.mixed_precision", "fp32", "--parallel.compile", "false", "--optim.lr", "1e-3",
             "--optim.min_lr", "1e-4", "--optim.warmup_steps", "10", "--optim.weight_decay", "0"]  # fmt: skip
    proc = launch(torchrun_command(["-m", "fsdp_trainer.train", *flags], args.nproc),
                  env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    if proc.returncode:
        sys.exit(f"error: the SFT start exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    consolidate(run, work / "start_hf", verify="files")
    return run, work / "start_hf"


def prompts(args, work: Path) -> Path:
    """One pass of prompts: steps x prompts a rank x ranks records of the bundled reversal prompts."""
    n = args.steps * args.prompts_per_rank * args.nproc
    with gzip.open(ASSETS / "reverse_prompts.jsonl.gz", "rt") as f:
        lines = [next(f) for _ in range(n)]
    path = work / "prompts.jsonl"
    path.write_text("".join(lines))
    return path


def run_ours(args, sft: Path, data: Path, seq_len: int, work: Path) -> dict:
    """One GRPO run of ours under torchrun, read back from its metrics.jsonl."""
    out = work / f"ours_{time.monotonic_ns()}"
    rewards = "[" + ", ".join(f'{{function: "fsdp_trainer.rewards:{name}"}}' for name in REWARDS) + "]"
    flags = ["--recipe", str(work / "imported" / "model.yaml"), "--checkpoint.resume", str(sft),
             "--train.out_dir", str(out), "--train.steps", str(args.steps), "--train.log_every", "1",
             "--train.eval_every", "0", "--checkpoint.every", "0", "--data.train_path", str(data),
             "--data.val_path", "null", "--data.tokenizer_path", "null", "--data.seq_len", str(seq_len),
             "--data.micro_batch_size", str(args.prompts_per_rank), "--parallel.sharding", "NO_SHARD",
             "--parallel.mixed_precision", "fp32", "--parallel.compile", "false", "--optim.lr", str(args.lr),
             "--optim.min_lr", str(args.lr), "--optim.warmup_steps", "0", "--optim.weight_decay", "0",
             "--optim.grad_clip", "1.0", "--grpo.rewards", rewards, "--grpo.num_generations", str(args.generations),
             "--grpo.max_completion_length", str(args.max_completion_length), "--grpo.temperature",
             str(args.temperature), "--grpo.loss_type", "dapo", "--grpo.epsilon_high", "0.28"]  # fmt: skip
    proc = launch(torchrun_command(["-m", "fsdp_trainer.train", *flags], args.nproc),
                  env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    if proc.returncode:
        sys.exit(f"error: ours exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    logged = [r for r in map(json.loads, (out / METRICS_FILE).read_text().splitlines()) if "reward" in r]
    return {
        "steps": len(logged), "wall_s": logged[-1]["elapsed_s"], "peak_rss_gb": max(r["peak_mem_gb"] for r in logged),
        "rewards": [r["reward"] for r in logged], "mean_lengths": [r["completions/mean_length"] for r in logged],
        "exact": [r["rewards/exact_answer/mean"] for r in logged],
    }  # fmt: skip


def run_trl(args, start_hf: Path, prompts_file: Path, work: Path) -> dict:
    """One GRPO run of TRL under torchrun (grpo_trl.py)."""
    out = work / f"trl_{time.monotonic_ns()}"
    out.mkdir()
    job = {"model": str(start_hf), "prompts": str(prompts_file), "out": str(out), "steps": args.steps,
           "prompts_per_rank": args.prompts_per_rank, "generations": args.generations,
           "max_completion_length": args.max_completion_length, "temperature": args.temperature,
           "loss_type": "dapo", "epsilon_high": 0.28, "lr": args.lr, "seed": 0, "rewards": list(REWARDS)}  # fmt: skip
    (out / "job.json").write_text(json.dumps(job))
    cmd = torchrun_command([str(Path(__file__).with_name("grpo_trl.py")), str(out / "job.json")], args.nproc)
    proc = launch(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(f"error: TRL exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    return {**result, "wall_s": result["train_runtime_s"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps a run")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side, alternating which goes first")
    parser.add_argument("--prompts_per_rank", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=12)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--sft_steps", type=int, default=300, help="the SFT both sides start from")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--work", default=None, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--out", default="bench_out/grpo.json")
    args = parser.parse_args(argv)

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_grpo_"))
    work.mkdir(parents=True, exist_ok=True)
    import_hf(tokenizer_and_model(work, args.vocab, args.dim, args.layers), work / "imported")
    sft, start_hf = sft_start(args, work)
    prompts_file, seq_len = prompts(args, work), 32 + args.max_completion_length
    data = work / "prompts_data" / "train.bin"
    tool("prepare_data.py", "--recipe", work / "imported" / "model.yaml", "--format", "prompts", "--input",
         prompts_file, "--data.tokenizer_path", work / "imported", "--data.train_path", data, "--data.val_path",
         "null", "--val_fraction", "0", "--data.seq_len", seq_len)  # fmt: skip
    rows = []
    for repeat in range(args.repeats):
        for side in SIDES if repeat % 2 == 0 else SIDES[::-1]:
            if side == "ours":
                result = run_ours(args, sft, data, seq_len, work)
            else:
                result = run_trl(args, start_hf, prompts_file, work)
            completions = args.prompts_per_rank * args.nproc * args.generations
            sampled = sum(length * completions for length in result["mean_lengths"])
            result.update(side=side, s_per_step=result["wall_s"] / result["steps"], sampled_tokens=sampled,
                          sampled_per_s=sampled / result["wall_s"])  # fmt: skip
            rows.append(result)
            print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}), flush=True)
    print(table(rows, args))
    write_rows(args.out, args, rows)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


def fifth(values: list[float], last: bool) -> float:
    k = max(1, len(values) // 5)
    part = values[-k:] if last else values[:k]
    return sum(part) / len(part)


def table(rows: list[dict], args) -> str:
    """Markdown: a row a run, with ours / TRL (the nearest TRL run) for steps a second and peak memory."""
    lines = [f"CPU capability: {torch.backends.cpu.get_cpu_capability()}; {args.nproc} ranks, {args.steps} steps of "
             f"{args.prompts_per_rank * args.nproc} prompts x {args.generations} completions",
             "| side | steps | loop s | s / step | sampled tokens / s | peak RSS GB / rank | reward, first / last "
             "fifth | exact answers, first / last fifth | ours / TRL steps/s | ours / TRL peak |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, r in enumerate(rows):
        ratio = peak = ""
        others = [j for j, o in enumerate(rows) if o["side"] == "trl"]
        if r["side"] == "ours" and others:
            o = rows[min(others, key=lambda j: abs(j - i))]
            ratio, peak = f"{o['s_per_step'] / r['s_per_step']:.2f}x", f"{r['peak_rss_gb'] / o['peak_rss_gb']:.2f}x"
        lines.append(f"| {r['side']} | {r['steps']} | {r['wall_s']:.1f} | {r['s_per_step']:.2f} "
                     f"| {r['sampled_per_s']:,.0f} | {r['peak_rss_gb']:.2f} "
                     f"| {fifth(r['rewards'], False):.3f} / {fifth(r['rewards'], True):.3f} "
                     f"| {fifth(r['exact'], False):.3f} / {fifth(r['exact'], True):.3f} "
                     f"| {ratio} | {peak} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
