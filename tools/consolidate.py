"""A DCP checkpoint (any world size) -> a Hugging Face model directory.

    python tools/consolidate.py runs/debug/checkpoints/step_00000150 hf_out [--dtype bf16] [--max_shard_gb 5]
    python tools/consolidate.py runs/debug hf_out          # the run's latest checkpoint
    python tools/consolidate.py runs/lora adapter_out --lora adapter     # a LoRA run's adapters, for PEFT

Writes model.safetensors (or shards + model.safetensors.index.json), config.json, tokenizer.model, tokenizer.json
and tokenizer_config.json, loadable offline by transformers' AutoModelForCausalLM / AutoTokenizer.from_pretrained.
Needs no process group. Memory: one shard of the output plus one tensor, not the model: the weights pass one
tensor at a time. `--verify hf` loads the written model into transformers to check it, which takes the whole
model; `auto` does so when transformers is installed and the model takes at most half the memory available.

A LoRA run's adapters are merged into the weights they adapt (`--lora merge`, the default), or written alone as a
PEFT adapter directory (`--lora adapter`: adapter_model.safetensors and adapter_config.json, which
peft.PeftModel.from_pretrained loads onto the base model).

The output appears only once complete and checked: it is written to a temporary directory beside OUT_DIR and
renamed. What is checked: every tensor name, shape and value in the files, and with `--verify hf` that
transformers loads it with no missing, unexpected or mis-shaped key (it only warns, and fills missing weights with
random values) and, with `--check_logits`, gives our model's logits.
"""

from __future__ import annotations

from typing import Literal

from jsonargparse import ArgumentParser

from fsdp_trainer.checkpoint.holds import reading
from fsdp_trainer.config import one_line_errors
from fsdp_trainer.convert import consolidate, export_adapter


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="tools/consolidate.py", description=__doc__.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("ckpt_dir", help="a step_NNNNNNNN directory, a checkpoints/ directory or a run directory")
    parser.add_argument("out_dir", help="where the HF model goes (must not exist or be empty)")
    parser.add_argument("--dtype", type=Literal["fp32", "bf16"], default="fp32", help="dtype of the written weights")
    parser.add_argument("--max_shard_gb", type=float, default=5.0, help="split the weights above this size")
    parser.add_argument(
        "--verify",
        type=Literal["auto", "hf", "files"],
        default="auto",
        help="hf: load with transformers too; files: check the written tensors only",
    )
    parser.add_argument(
        "--check_logits", type=bool, nargs="?", const=True, default=False, help="compare transformers' logits with ours"
    )
    parser.add_argument(
        "--lora",
        type=Literal["merge", "adapter"],
        default="merge",
        help="a LoRA run: merge the adapters into an HF model, or write them alone as a PEFT adapter directory",
    )
    with one_line_errors():
        args = parser.parse_args(argv)
        with reading(args.ckpt_dir, "tools/consolidate.py") as path:
            if args.lora == "adapter":
                export_adapter(path, args.out_dir, args.dtype)
            else:
                consolidate(path, args.out_dir, args.dtype, args.max_shard_gb, args.verify, args.check_logits)


if __name__ == "__main__":
    main()
