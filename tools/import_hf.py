"""Hugging Face Llama / Qwen3 weights -> a checkpoint that a recipe can start training from.

    python tools/import_hf.py HF_DIR OUT_DIR
    torchrun ... -m fsdp_trainer.train --recipe recipes/X.yaml --recipe OUT_DIR/model.yaml --checkpoint.resume OUT_DIR

HF_DIR holds config.json and model.safetensors (or shards with an index). OUT_DIR gets a weights-only DCP checkpoint
(OUT_DIR/checkpoints/step_00000000, published as latest) and model.yaml, the recipe's model section for these
weights. Resuming from it loads the weights only: fresh optimizer, data stream and step 0. A tokenizer.model in
HF_DIR (sentencepiece) is carried along.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout, uninstalled

from fsdp_trainer.checkpoint import save_model_weights  # noqa: E402
from fsdp_trainer.hf import load_safetensors, model_config_from_hf  # noqa: E402
from fsdp_trainer.model import Transformer  # noqa: E402


def import_hf(hf_dir: str, out_dir: str) -> Path:
    hf, out = Path(hf_dir), Path(out_dir)
    config_path = hf / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist")
    if (out / "checkpoints").exists():
        raise FileExistsError(f"{out}/checkpoints exists; remove it or choose another OUT_DIR")
    cfg = model_config_from_hf(json.loads(config_path.read_text()), str(config_path))
    with torch.device("meta"):
        expected = Transformer(cfg).state_dict()
    state = {name: t.float() for name, t in load_safetensors(hf).items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)  # some exporters write the tied copy; ours is the embedding
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    if missing or unexpected:
        raise ValueError(f"{hf}: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]} for {cfg.family}")
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise ValueError(
                f"{hf}: {name} has shape {tuple(state[name].shape)}, config.json implies {tuple(tensor.shape)}"
            )

    model_yaml = yaml.safe_dump({"model": asdict(cfg)}, sort_keys=False)
    attachments = {"recipe.yaml": model_yaml.encode()}
    if (hf / "tokenizer.model").is_file():
        attachments["tokenizer.model"] = (hf / "tokenizer.model").read_bytes()
    out.mkdir(parents=True, exist_ok=True)
    path = save_model_weights(state, out, attachments)
    (out / "model.yaml").write_text(model_yaml)
    print(
        f"{hf} -> {path} ({sum(t.numel() for t in expected.values()) / 1e6:.1f}M parameters) and {out / 'model.yaml'}"
    )
    return path


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(description=__doc__.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("hf_dir", help="directory with config.json and model.safetensors (or shards + index)")
    parser.add_argument("out_dir", help="where the checkpoint and model.yaml go")
    try:
        args = parser.parse_args(argv)
        import_hf(args.hf_dir, args.out_dir)
    except Exception as e:  # noqa: BLE001 -- a CLI: one line, exit 1
        sys.exit(f"error: {' '.join(str(e).split())}")


if __name__ == "__main__":
    main()
