"""Chunked cross-entropy: peak memory and tokens/s of train.loss_chunks = c against 1, with the planner's logits term.

    python benchmarks/bench_loss_chunks.py --recipe recipes/debug.yaml --chunks 1 4 8 16 --repeats 2 --nproc 1 \
        --model.vocab_size 32000 --data.seq_len 1024 --model.max_seq_len 1024 --data.micro_batch_size 8

Trains on random tokens under torchrun for each chunk count, `repeats` rounds with the order reversed every other
round, and reads tokens/s and peak memory per rank from metrics.jsonl. Reports, per chunk count, the median tokens/s
as a ratio to loss_chunks 1 measured in the same rounds, the peak memory saved against 1, and what the planner says
the output layer takes. Prints a markdown table and writes the numbers to --out as JSON. Any recipe key can be
overridden as in training.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from runner import report_header, run_ours, synthetic_data

from fsdp_trainer.config import parse_args, recipe_parser, recipe_to_yaml
from fsdp_trainer.planner.memory import estimate


def main(argv: list[str] | None = None) -> None:
    parser = recipe_parser("benchmarks/bench_loss_chunks.py", __doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=list[int], default=[1, 4, 8, 16], help="loss_chunks values (1 included)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run, after one warm-up step")
    parser.add_argument("--out", type=str, default="bench_loss_chunks.json")
    recipe, args = parse_args(parser, argv)
    chunks = sorted(set(args.chunks) | {1})
    data = recipe.data
    tokens_per_step = data.micro_batch_size * data.seq_len * data.grad_accum_steps * args.nproc
    runs: dict[int, list[dict]] = {c: [] for c in chunks}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        n_tokens = 4 * tokens_per_step * (args.steps + 1)
        train_path, tokenizer_path = synthetic_data(tmp, recipe.model.vocab_size, n_tokens)
        recipe.data.train_path, recipe.data.tokenizer_path, recipe.data.val_path = train_path, tokenizer_path, None
        recipe_path = tmp / "recipe.yaml"
        recipe_path.write_text(recipe_to_yaml(recipe))
        for repeat in range(args.repeats):
            for c in chunks if repeat % 2 == 0 else chunks[::-1]:
                flags = ["--train.loss_chunks", str(c)]
                result = run_ours(
                    str(recipe_path),
                    train_path,
                    tokenizer_path,
                    args.nproc,
                    args.steps,
                    1,
                    tokens_per_step,
                    tmp / f"c{c}",
                    flags,
                )
                runs[c].append(result)
                print(f"loss_chunks {c}: {result['tokens_per_s']:,.0f} tok/s, peak {result['peak_mem_gb']:.2f} GB")
    rows = []
    for c in chunks:
        recipe.train.loss_chunks = c
        planned = estimate(
            recipe, args.nproc, 1, recipe.parallel.sharding, recipe.parallel.activation_checkpointing, "cpu"
        )
        ratios = [r["tokens_per_s"] / base["tokens_per_s"] for r, base in zip(runs[c], runs[1], strict=True)]
        rows.append(
            {
                "loss_chunks": c,
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[c]),
                "ratio_to_1": statistics.median(ratios),
                "peak_mem_gb": statistics.median(r["peak_mem_gb"] for r in runs[c]),
                "planned_logits_gb": planned.logits_gb,
                "loss": runs[c][0]["loss"],
            }
        )
    base = rows[0]
    print("| loss_chunks | tokens/s | ratio to 1 | peak memory / rank | saved against 1 | planner's logits term |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        saved = base["peak_mem_gb"] - r["peak_mem_gb"]
        print(
            f"| {r['loss_chunks']} | {r['tokens_per_s']:,.0f} | {r['ratio_to_1']:.3f} | {r['peak_mem_gb']:.2f} GB "
            f"| {saved:.2f} GB | {r['planned_logits_gb']:.2f} GB |"
        )
    header = report_header(recipe, args, ("chunks", "repeats", "nproc", "steps"))
    Path(args.out).write_text(json.dumps({**header, "rows": rows, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
