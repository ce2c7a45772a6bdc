"""Memory per rank, measured against the ZeRO formulas and the planner (planner/memory.py), one training job per
configuration.

    python benchmarks/bench_memory.py --recipe recipes/debug.yaml --nproc 2 --steps 3 \
        --configs FULL_SHARD/bf16/none SHARD_GRAD_OP/bf16/none NO_SHARD/fp32/full ... [--model.dim 512 ...]

Each config is SHARDING/PRECISION/AC, or SHARDING/PRECISION/AC/offload with parallel.cpu_offload. For each, trains
--steps steps on random tokens under torchrun and reads the run's metrics.jsonl: the training state each rank holds
(parameters, gradients, AdamW state, measured from the local shards, on the host under offload) against the planner's
ZeRO formula (16 bytes x P / shard group), and the peak memory of the largest rank against the planner's total (on a
GPU, also the host's peak beside the state the planner puts there). Prints a markdown table and writes the numbers
to --out as JSON. Any recipe key can be overridden as in training.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from runner import job_inputs, report_header, run_ours

from fsdp_trainer.config import fail, parse_args, recipe_parser
from fsdp_trainer.distributed.runtime import precision_on
from fsdp_trainer.model import count_params
from fsdp_trainer.planner.memory import estimate
from fsdp_trainer.sinks import STATE_KEYS


def measure(
    recipe_path: str,
    train_path: str,
    tokenizer_path: str,
    nproc: int,
    steps: int,
    config: str,
    parts: tuple[str, str, str, bool],
    tmp: Path,
    tokens_per_step: int,
):
    sharding, precision, ac, offload = parts
    flags = ["--parallel.sharding", sharding, "--parallel.mixed_precision", precision,
             "--parallel.activation_checkpointing", ac, "--parallel.cpu_offload", str(offload).lower()]  # fmt: skip
    result = run_ours(recipe_path, train_path, tokenizer_path, nproc, steps - 1, 1, tokens_per_step,
                      tmp / config.replace("/", "_"), flags)  # fmt: skip
    keys = (*STATE_KEYS, "state_gb", "peak_mem_gb", "peak_host_mem_gb", "tokens_per_s")
    return {"config": config, **{k: result[k] for k in keys if k in result}}


def parse_config(config: str) -> tuple[str, str, str, bool]:
    """SHARDING/PRECISION/AC[/offload] -> (sharding, precision, ac, offload)."""
    parts = config.split("/")
    if len(parts) not in (3, 4) or parts[3:] not in ([], ["offload"]):
        fail(f"--configs: {config!r} is not SHARDING/PRECISION/AC or SHARDING/PRECISION/AC/offload")
    return parts[0], parts[1], parts[2], len(parts) == 4


def main(argv: list[str] | None = None) -> None:
    parser = recipe_parser("benchmarks/bench_memory.py", __doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--configs", nargs="+", default=["FULL_SHARD/bf16/none"], help="SHARDING/PRECISION/AC[/offload]"
    )
    parser.add_argument("--out", default="bench_out/memory.json")
    recipe, args = parse_args(parser, argv)
    if args.steps < 2:
        fail("--steps must be >= 2 (the first step is the warmup)")
    # A typo fails now, not after the runs before it; a config may repeat (to alternate the order of runs).
    configs = [(config, parse_config(config)) for config in args.configs]
    n_params = count_params(recipe.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the trainer's choice under parallel.backend auto
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        recipe_path, tokens_per_step, (train_path, tokenizer_path) = job_inputs(recipe, tmp, args.nproc, args.steps)
        for config, parts in configs:
            row = measure(recipe_path, train_path, tokenizer_path, args.nproc, args.steps, config, parts, tmp,
                          tokens_per_step)  # fmt: skip
            sharding, precision, ac, offload = parts
            recipe.parallel.mixed_precision, _ = precision_on(precision, device)  # as the run resolved it
            planned = estimate(recipe, args.nproc, 1, sharding, ac, device, offload)
            row["formula_state_gb"] = planned.state_gb + planned.host_gb  # offloaded on a GPU: on the host
            row["plan"], row["plan_total_gb"] = vars(planned), planned.total_gb
            rows.append(row)
            print(json.dumps(row), flush=True)

    m = recipe.model
    print(f"\n{n_params / 1e6:.1f}M params (dim {m.dim} x {m.n_layers} layers, vocab {m.vocab_size}), "
          f"micro-batch {recipe.data.micro_batch_size} x seq {recipe.data.seq_len}, {args.nproc} ranks")  # fmt: skip
    # On a GPU, also the host: its peak RSS (libraries included) beside the state the plan puts there.
    print("| sharding / precision / AC | params / grads / AdamW GB (measured) | state GB: measured / formula | "
          "peak GB: measured / plan | plan error | host peak GB / planned state there | tokens/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        err = r["plan_total_gb"] / r["peak_mem_gb"] - 1
        host = f"{r['peak_host_mem_gb']:.2f} / {r['plan']['host_gb']:.2f}" if "peak_host_mem_gb" in r else "-"
        print(f"| {r['config']} | {r['params_gb']:.3f} / {r['grads_gb']:.3f} / {r['optimizer_gb']:.3f} | "
              f"{r['state_gb']:.3f} / {r['formula_state_gb']:.3f} | {r['peak_mem_gb']:.2f} / {r['plan_total_gb']:.2f} "
              f"| {100 * err:+.0f}% | {host} | {r['tokens_per_s']:,.0f} |")  # fmt: skip
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        header = report_header(recipe, args, ("nproc", "steps", "configs"))
        json.dump({**header, "n_params": n_params, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
