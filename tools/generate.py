"""Sample text from a trained model: a checkpoint (or run directory) of ours, or a consolidated HF directory.

python tools/generate.py runs/debug --prompt "ROMEO." --max_new_tokens 200 --temperature 0.8 --top_k 50
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout, uninstalled

from fsdp_trainer.checkpoint import checkpoint_recipe, load_model_weights, resolve_checkpoint  # noqa: E402
from fsdp_trainer.config import load_recipe_sections  # noqa: E402
from fsdp_trainer.hf import load_safetensors, model_config_from_hf  # noqa: E402
from fsdp_trainer.model import Transformer, generate  # noqa: E402
from fsdp_trainer.tokenizer import Tokenizer  # noqa: E402


def load_model(path: str) -> tuple[Transformer, Tokenizer]:
    """Our checkpoint, run directory or checkpoints/ directory; or an HF directory with config.json."""
    path = Path(path)
    if (path / "config.json").is_file() and not (path / "checkpoints").exists():  # an HF directory
        cfg = model_config_from_hf(json.loads((path / "config.json").read_text()), str(path / "config.json"))
        model = Transformer(cfg)
        state = load_safetensors(path)
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=not cfg.tie_embeddings)
        tokenizer_path = path / "tokenizer.model"
    else:
        ckpt = resolve_checkpoint(path)
        sections = load_recipe_sections(str(checkpoint_recipe(ckpt)))
        cfg = sections["model"]
        model = Transformer(cfg)
        model.load_state_dict(load_model_weights(ckpt, {k: v.shape for k, v in model.state_dict().items()}))
        tokenizer_path = ckpt / "tokenizer.model"
        if not tokenizer_path.is_file():
            tokenizer_path = Path(sections["data"].tokenizer_path)
    return model.eval(), Tokenizer(tokenizer_path)


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(description=__doc__.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("path", help="run directory, checkpoint directory, or HF model directory")
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=int | None, default=50)
    parser.add_argument("--seed", type=int, default=0)
    try:
        args = parser.parse_args(argv)
        model, tokenizer = load_model(args.path)
        prompt = torch.tensor(tokenizer.encode(args.prompt), dtype=torch.long)
        if prompt.numel() == 0:
            raise ValueError("--prompt encodes to no tokens; give some text")
        out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k,
                       torch.Generator().manual_seed(args.seed), stop_id=tokenizer.eos_id)  # fmt: skip
    except Exception as e:  # noqa: BLE001 -- a CLI: one line, exit 1
        sys.exit(f"error: {' '.join(str(e).split())}")
    print(tokenizer.decode(out.tolist()))


if __name__ == "__main__":
    main()
