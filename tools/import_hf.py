"""Hugging Face Llama / Qwen3 weights -> a checkpoint that a recipe can start training from.

    python tools/import_hf.py HF_DIR OUT_DIR
    torchrun ... -m fsdp_trainer.train --recipe recipes/X.yaml --recipe OUT_DIR/model.yaml --checkpoint.resume OUT_DIR

HF_DIR holds config.json and model.safetensors (or shards with an index). OUT_DIR gets a weights-only DCP checkpoint
(OUT_DIR/checkpoints/step_00000000, published as latest) and model.yaml, the recipe's model section for these
weights. Resuming from it loads the weights only: fresh optimizer, data stream and step 0. A tokenizer.model in
HF_DIR (sentencepiece) is carried along.
"""

from __future__ import annotations

from jsonargparse import ArgumentParser

from fsdp_trainer.config import one_line_errors
from fsdp_trainer.convert import import_hf


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="tools/import_hf.py", description=__doc__.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("hf_dir", help="directory with config.json and model.safetensors (or shards + index)")
    parser.add_argument("out_dir", help="where the checkpoint and model.yaml go")
    with one_line_errors():
        args = parser.parse_args(argv)
        import_hf(args.hf_dir, args.out_dir)


if __name__ == "__main__":
    main()
