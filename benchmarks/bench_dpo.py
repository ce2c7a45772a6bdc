"""What a preference run's reference model costs: DPO against next-token fine-tuning on the same packed windows, with
every weight trained (the reference a frozen sharded copy) and with LoRA (the reference the policy with its adapters
off), and the reference-free kinds (SimPO, ORPO) and a reward model against DPO: training state and peak memory per
rank, and tokens/s, one training job per kind in the order given (repeat kinds to alternate them).

    python benchmarks/bench_dpo.py --recipe recipes/125m.yaml --nproc 2 --steps 4 \
        --kinds sft dpo lora_sft lora_dpo lora_dpo lora_sft dpo sft [--data.seq_len 512 --lora.rank 16 ...]
    python benchmarks/bench_dpo.py --recipe recipes/125m.yaml --nproc 2 --steps 4 --kinds dpo simpo orpo orpo simpo dpo
    python benchmarks/bench_dpo.py --recipe recipes/debug.yaml --nproc 2 --steps 8 --kinds dpo dpo_cache dpo_cache dpo
    python benchmarks/bench_dpo.py --recipe recipes/125m.yaml --nproc 2 --steps 4 --kinds dpo reward reward dpo

The data is the bundled preference set prepared with the recipe's tokenizer (data.tokenizer_path) into data.seq_len
windows; the fine-tuning baselines read the same windows as plain packed examples (the loss on both answers). Each
job trains --steps steps, the first a warmup. Prints a markdown table with each DPO kind's ratios to its baseline
and writes the numbers to --out as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from runner import launch, nearest_run, parse_kinds_args, report_header, run_ours

from fsdp_trainer.config import recipe_to_yaml
from fsdp_trainer.data.format import META_SUFFIX

REPO = Path(__file__).resolve().parents[1]
KINDS = {  # (its flags, the baseline a DPO kind is compared with)
    "sft": ([], None),
    "dpo": (["--preference.loss", "sigmoid"], "sft"),
    "lora_sft": (["--lora.rank", "{rank}"], None),
    "lora_dpo": (["--lora.rank", "{rank}", "--preference.loss", "sigmoid"], "lora_sft"),
    # the reference-free kinds, against DPO with its frozen copy
    "simpo": (["--preference.loss", "simpo", "--preference.beta", "2.0"], "dpo"),
    "orpo": (["--preference.loss", "orpo"], "dpo"),
    # DPO with its reference's log-probabilities cached before the first step (the pass is not in tokens/s)
    "dpo_cache": (["--preference.loss", "sigmoid", "--preference.reference", "cache"], "dpo"),
    # a reward model on the same pairs: a score head in place of the output layer, no reference
    "reward": (["--model.num_labels", "1"], "dpo"),
}


def prepare(recipe_path: str, tmp: Path) -> tuple[str, str]:
    """(the bundled pairs prepared for the recipe, the same windows as plain packed examples)."""
    pairs = tmp / "pairs.bin"
    cmd = [sys.executable, str(REPO / "tools" / "prepare_data.py"), "--recipe", recipe_path, "--format", "preference",
           "--data.train_path", str(pairs), "--data.val_path", "null", "--val_fraction", "0"]  # fmt: skip
    proc = launch(cmd)
    if proc.returncode:
        sys.exit(f"error: tools/prepare_data.py exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    plain = tmp / "plain.bin"
    for suffix in ("", ".flags"):
        shutil.copy(f"{pairs}{suffix}", f"{plain}{suffix}")
    meta = json.loads(Path(f"{pairs}{META_SUFFIX}").read_text())
    meta.pop("preference")
    Path(f"{plain}{META_SUFFIX}").write_text(json.dumps(meta))
    return str(pairs), str(plain)


def main(argv: list[str] | None = None) -> None:
    default = ["sft", "dpo", "lora_sft", "lora_dpo", "lora_dpo", "lora_sft", "dpo", "sft"]
    recipe, args = parse_kinds_args("benchmarks/bench_dpo.py", __doc__.split("\n\n")[0], KINDS, default,
                                    "bench_out/dpo.json", argv)  # fmt: skip
    rank = recipe.lora.rank or 16
    recipe.lora.rank, recipe.preference.loss = None, None
    data = recipe.data
    tokens_per_step = data.micro_batch_size * data.seq_len * data.grad_accum_steps * args.nproc
    results = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        recipe_path = tmp / "recipe.yaml"
        recipe_path.write_text(recipe_to_yaml(recipe))
        pairs, plain = prepare(str(recipe_path), tmp)
        for i, kind in enumerate(args.kinds):
            flags, baseline = KINDS[kind]
            flags = [flag.format(rank=rank) for flag in flags]
            out = tmp / f"{i}_{kind}"
            data_path = pairs if baseline else plain  # a kind compared with a baseline trains on pairs
            result = run_ours(str(recipe_path), data_path, data.tokenizer_path, args.nproc, args.steps - 1, 1,
                              tokens_per_step, out, flags)  # fmt: skip
            results.append({"kind": kind, **{k: result[k] for k in ("state_gb", "peak_mem_gb", "tokens_per_s")}})
            print(f"{kind}: {results[-1]}", flush=True)
    rows = ["| kind | state GB / rank | peak GB / rank | tokens/s | peak vs baseline | tokens/s vs baseline |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for i, r in enumerate(results):
        b, ratios = nearest_run(results, i, KINDS[r["kind"]][1]), " - | - |"
        if b is not None:
            ratios = f" {r['peak_mem_gb'] / b['peak_mem_gb']:.3f} | {r['tokens_per_s'] / b['tokens_per_s']:.3f} |"
        rows.append(
            f"| {r['kind']} | {r['state_gb']:.3f} | {r['peak_mem_gb']:.3f} | {r['tokens_per_s']:,.0f} |{ratios}"
        )
    print(f"CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    print("\n".join(rows))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({**report_header(recipe, args, ("nproc", "steps", "kinds")), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
