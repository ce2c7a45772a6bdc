"""How step time and memory grow with model size and world size, measured, with the ZeRO communication volume beside.

    python benchmarks/bench_scaling.py --recipe recipes/debug.yaml --sizes 256x4 512x8 768x12 --nproc 1 2 \
        [--steps 6 --log_every 3] [--parallel.sharding FULL_SHARD ...]

For each model size (dim x layers; heads of 64, half as many kv heads, ffn 3 x dim) and each world size, trains the
recipe's shape of micro-batch per rank (weak scaling: the work per rank stays fixed) on random tokens under torchrun,
one thread per rank, and reads the run's metrics.jsonl. Reports the mean step time after warmup, tokens/s per rank,
training state and peak memory per rank, and the bytes each rank sends per step by the ZeRO formulas of the planner
(planner/memory.py), so that the extra step time of 2 ranks over 1 gives the effective collective bandwidth of this
machine. Writes the rows to --out as JSON.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from runner import report_header, run_ours, synthetic_data

from fsdp_trainer.config import compute_dtype, fail, parse_args, read_recipe, recipe_parser, recipe_to_yaml
from fsdp_trainer.distributed.runtime import precision_on
from fsdp_trainer.model import count_params
from fsdp_trainer.planner.memory import comm_bytes_per_rank, regathered_in_backward


def sent(recipe, n_params: int, nproc: int) -> float:
    """Bytes a rank sends per step, by the ZeRO formulas of fsdp_trainer.planner.memory (one node)."""
    a = compute_dtype(recipe.parallel.mixed_precision).itemsize
    regathered = regathered_in_backward(recipe.model)
    sharding, accum = recipe.parallel.sharding, recipe.data.grad_accum_steps
    return comm_bytes_per_rank(sharding, n_params, a, accum, nproc, 1, regathered)[0]


def main(argv: list[str] | None = None) -> None:
    parser = recipe_parser("benchmarks/bench_scaling.py", __doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["256x4", "512x8", "768x12"], help="DIMxLAYERS")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=6, help="measured steps (a multiple of --log_every)")
    parser.add_argument("--log_every", type=int, default=3, help="also the warmup length")
    parser.add_argument("--out", default="bench_out/scaling.json")
    base_recipe, args = parse_args(parser, argv)
    base_recipe.parallel.mixed_precision, _ = precision_on(base_recipe.parallel.mixed_precision, "cpu")  # CPU ranks
    if args.steps % args.log_every:
        fail(f"--steps={args.steps} must be a multiple of --log_every={args.log_every}")
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank at every world size: the per-device work is equal

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base_path = tmp / "base.yaml"  # the recipe and its overrides, which each size's shape flags then override
        base_path.write_text(recipe_to_yaml(base_recipe))
        for size in args.sizes:
            dim, layers = (int(x) for x in size.split("x"))
            heads = max(1, dim // 64)
            shape = ["--model.dim", str(dim), "--model.n_layers", str(layers), "--model.n_heads", str(heads),
                     "--model.n_kv_heads", str(max(1, heads // 2)), "--model.ffn_dim", str(3 * dim)]  # fmt: skip
            recipe, _ = read_recipe(recipe_parser(), ["--recipe", str(base_path), *shape])
            recipe_path = tmp / f"recipe_{size}.yaml"
            recipe_path.write_text(recipe_to_yaml(recipe))
            n_params = count_params(recipe.model)
            data = recipe.data
            tokens_per_rank = data.micro_batch_size * data.grad_accum_steps * data.seq_len
            train_path, tokenizer_path = synthetic_data(
                tmp, recipe.model.vocab_size, 4 * (args.steps + args.log_every) * tokens_per_rank * max(args.nproc) + 1
            )
            for nproc in args.nproc:
                result = run_ours(str(recipe_path), train_path, tokenizer_path, nproc, args.steps, args.log_every,
                                  tokens_per_rank * nproc, tmp / f"{size}_{nproc}")  # fmt: skip
                row = {"size": size, "params": n_params, "regathered": regathered_in_backward(recipe.model),
                       "nproc": nproc,
                       "step_s": tokens_per_rank * nproc / result["tokens_per_s"],
                       "tokens_per_s_per_rank": result["tokens_per_s"] / nproc, "state_gb": result["state_gb"],
                       "peak_mem_gb": result["peak_mem_gb"],
                       "comm_gb_per_rank": sent(recipe, n_params, nproc) / 1e9}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)

    d = recipe.data
    print(f"\n{recipe.parallel.sharding}, {recipe.parallel.mixed_precision}, micro-batch {d.micro_batch_size} x "
          f"seq {d.seq_len} per rank, one thread per rank")  # fmt: skip
    print("| model | params | ranks | step s | tokens/s per rank | state GB / rank | peak GB / rank | "
          "sent GB / rank / step | extra s vs 1 rank | effective GB/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    single = {r["size"]: r for r in rows if r["nproc"] == 1}
    for r in rows:
        base = single.get(r["size"])
        extra = r["step_s"] - base["step_s"] if base and r["nproc"] > 1 else None
        bandwidth = r["comm_gb_per_rank"] / extra if extra and extra > 0 else None
        print(f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['nproc']} | {r['step_s']:.2f} | "
              f"{r['tokens_per_s_per_rank']:,.0f} | {r['state_gb']:.3f} | {r['peak_mem_gb']:.2f} | "
              f"{r['comm_gb_per_rank']:.3f} | {'-' if extra is None else f'{extra:+.2f}'} | "
              f"{'-' if bandwidth is None else f'{bandwidth:.2f}'} |")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    header = report_header(base_recipe, args, ("sizes", "nproc", "steps", "log_every"))
    Path(args.out).write_text(json.dumps({**header, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
