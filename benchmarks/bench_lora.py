"""LoRA and QLoRA against full fine-tuning of the same recipe: the training state and peak memory per rank, the
checkpoint's size and save time, and tokens/s, one training job per kind, in the order given (repeat kinds to
alternate them; ratios are taken against the full run nearest in the order).

    python benchmarks/bench_lora.py --recipe recipes/125m.yaml --nproc 2 --steps 4 \
        --kinds full lora qlora qlora lora full [--lora.rank 16 --data.seq_len 512 ...]

Each job trains --steps steps (the first a warmup) on random tokens under torchrun and saves a checkpoint after the
last; `lora` and `qlora` train adapters of rank lora.rank (default 16) on every projection, `qlora` with the frozen
projections in NF4. Prints a markdown table and writes the numbers to --out as JSON. Any recipe key can be overridden
as in training.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import torch
from runner import job_inputs, nearest_run, parse_kinds_args, report_header, run_ours

from fsdp_trainer.model import count_params

KINDS = {
    "full": [],
    "lora": ["--lora.quantize_base", "null"],
    "qlora": ["--lora.quantize_base", "nf4"],
}


def measure(kind: str, rank: int, recipe_path: str, data: tuple[str, str], args, tokens_per_step: int, tmp: Path):
    flags = ["--lora.rank", "null"] if kind == "full" else ["--lora.rank", str(rank), *KINDS[kind]]
    flags += ["--checkpoint.every", str(args.steps), "--checkpoint.keep_last", "1"]
    out = tmp / kind
    result = run_ours(recipe_path, *data, args.nproc, args.steps - 1, 1, tokens_per_step, out, flags, keep_log=True)
    step = out / "ours_run" / "checkpoints" / f"step_{args.steps:08d}"
    saved = re.findall(r"saved checkpoint \S+ \(([\d.]+) s", result.pop("log"))
    return {
        "kind": kind,
        **{k: result[k] for k in ("params_gb", "grads_gb", "optimizer_gb", "state_gb", "peak_mem_gb")},
        "tokens_per_s": result["tokens_per_s"],
        "checkpoint_gb": sum(f.stat().st_size for f in step.iterdir()) / 1e9,
        "save_s": float(saved[-1]),
    }


def main(argv: list[str] | None = None) -> None:
    default = ["full", "lora", "qlora", "qlora", "lora", "full"]
    recipe, args = parse_kinds_args("benchmarks/bench_lora.py", __doc__.split("\n\n")[0], KINDS, default,
                                    "bench_out/lora.json", argv)  # fmt: skip
    rank = recipe.lora.rank or 16
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        recipe_path, tokens_per_step, data = job_inputs(recipe, Path(tmp), args.nproc, args.steps)
        tmp = Path(tmp)
        for i, kind in enumerate(args.kinds):
            rows.append(measure(kind, rank, recipe_path, data, args, tokens_per_step, tmp / f"{i}"))
            print(json.dumps(rows[-1]), flush=True)

    m, d = recipe.model, recipe.data
    print(f"\n{count_params(m) / 1e6:.1f}M params (dim {m.dim} x {m.n_layers} layers, vocab {m.vocab_size}), "
          f"micro-batch {d.micro_batch_size} x seq {d.seq_len}, {args.nproc} ranks, LoRA rank {rank}, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")  # fmt: skip
    print("| run | kind | state GB / rank | peak GB / rank | checkpoint GB | save s | tokens/s "
          "| vs the nearest full run: state, peak, checkpoint, save, tokens/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        ratios, f = "-", nearest_run(rows, i, "full")
        if f is not None and r["kind"] != "full":
            keys = ("state_gb", "peak_mem_gb", "checkpoint_gb", "save_s", "tokens_per_s")
            ratios = ", ".join(f"{r[k] / f[k]:.3f}" for k in keys)
        print(f"| {i + 1} | {r['kind']} | {r['state_gb']:.3f} | {r['peak_mem_gb']:.2f} | {r['checkpoint_gb']:.3f} | "
              f"{r['save_s']:.2f} | {r['tokens_per_s']:,.0f} | {ratios} |")  # fmt: skip
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**report_header(recipe, args, ("nproc", "steps", "kinds")), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
