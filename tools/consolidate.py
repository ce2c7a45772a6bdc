"""A DCP checkpoint (any world size) -> a Hugging Face model directory.

    python tools/consolidate.py runs/debug/checkpoints/step_00000150 hf_out [--dtype bf16] [--max_shard_gb 5]
    python tools/consolidate.py runs/debug hf_out          # the run's latest checkpoint

Writes model.safetensors (or shards + model.safetensors.index.json), config.json, tokenizer.model, tokenizer.json
and tokenizer_config.json, loadable offline by transformers' AutoModelForCausalLM / AutoTokenizer.from_pretrained.
Needs no process group. Memory: the fp32 model plus one shard; `--verify hf` (the default when transformers is
installed) loads the written model once more to check it.

The output appears only once complete and checked: it is written to a temporary directory beside OUT_DIR and
renamed. What is checked: every tensor name, shape and value in the files, and with `--verify hf` that
transformers loads it with no missing, unexpected or mis-shaped key (it only warns, and fills missing weights with
random values) and, with `--check_logits`, gives our model's logits.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout, uninstalled

from fsdp_trainer.checkpoint import checkpoint_recipe, load_model_weights, resolve_checkpoint  # noqa: E402
from fsdp_trainer.config import load_recipe_sections  # noqa: E402
from fsdp_trainer.hf import DTYPES, hf_config, save_safetensors, write_tokenizer_files  # noqa: E402
from fsdp_trainer.model import Transformer  # noqa: E402
from fsdp_trainer.tokenizer import Tokenizer  # noqa: E402


def read_safetensors_one_by_one(path: Path):
    """Yield (name, tensor) from a safetensors file, reading one tensor at a time with plain reads: memory-mapping
    the file (safe_open) would count the whole file in the process's resident memory."""
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            f.seek(8 + header_size + start)
            data = bytearray(f.read(end - start))
            yield name, torch.frombuffer(data, dtype=dtypes[info["dtype"]]).reshape(info["shape"])


def check_files(out_dir: Path, expected: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Every expected tensor is in the files, with its shape and (cast) value; nothing else is."""
    found = set()
    for file in sorted(out_dir.glob("*.safetensors")):
        for name, tensor in read_safetensors_one_by_one(file):
            if name not in expected:
                raise ValueError(f"{file.name} holds {name}, which the model does not have")
            if tensor.shape != expected[name].shape or not torch.equal(tensor, expected[name].to(dtype)):
                raise ValueError(f"{name} in {file.name} differs from the checkpoint")
            found.add(name)
    if found != set(expected):
        raise ValueError(f"the written files lack {sorted(set(expected) - found)[:3]}")


def check_with_transformers(out_dir: Path, model: Transformer | None, dtype: torch.dtype) -> float | None:
    """Load with transformers and fail on any loading problem; with `model`, return the max logit difference."""
    from transformers import AutoModelForCausalLM

    hf, info = AutoModelForCausalLM.from_pretrained(str(out_dir), output_loading_info=True, dtype=dtype)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {}
    )
    if problems:
        raise ValueError(f"transformers loaded {out_dir} with {problems}")
    if model is None:
        return None
    tokens = torch.randint(
        0, model.cfg.vocab_size, (2, min(32, model.cfg.max_seq_len)), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        return (hf.eval()(tokens).logits.float() - model(tokens).float()).abs().max().item()


def consolidate(ckpt_dir: str, out_dir: str, dtype: str = "fp32", max_shard_gb: float = 5.0, verify: str = "auto",
                check_logits: bool = False) -> Path:  # fmt: skip
    ckpt = resolve_checkpoint(ckpt_dir)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; remove it or choose another OUT_DIR")
    sections = load_recipe_sections(str(checkpoint_recipe(ckpt)))
    cfg = sections["model"]
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Transformer(cfg).state_dict().items()}
    if cfg.tie_embeddings:
        shapes.pop("lm_head.weight")  # the same tensor as embed_tokens; HF ties them again on load
    state = load_model_weights(ckpt, shapes)
    tokenizer_path = ckpt / "tokenizer.model"
    if not tokenizer_path.is_file():
        tokenizer_path = Path(sections["data"].tokenizer_path)
    tokenizer = Tokenizer(tokenizer_path) if tokenizer_path.is_file() else None

    if verify == "auto":
        try:
            import transformers  # noqa: F401

            verify = "hf"
        except ImportError:
            verify = "files"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_safetensors(state, tmp, dtype, int(max_shard_gb * 1e9))
        config = hf_config(cfg, dtype, tokenizer and tokenizer.bos_id, tokenizer and tokenizer.eos_id)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer is not None:
            write_tokenizer_files(tokenizer.path, tmp)
        check_files(tmp, state, DTYPES[dtype])
        if verify == "hf":
            model = None
            if check_logits:
                model = Transformer(cfg)
                model.load_state_dict(state, strict=not cfg.tie_embeddings)
                model.to(DTYPES[dtype])
            diff = check_with_transformers(tmp, model, DTYPES[dtype])
            if diff is not None:
                print(f"max |logits(transformers) - logits(ours)| = {diff:.2e}")
                if diff > (1e-4 if dtype == "fp32" else 5e-2):
                    raise ValueError(f"transformers' logits differ from ours by {diff:.2e}")
        umask = os.umask(0)
        os.umask(umask)
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp made it private; give it the user's usual permissions
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"{ckpt} -> {out} ({sum(t.numel() for t in state.values()) / 1e6:.1f}M parameters, {dtype}, verified: {verify})"
    )
    return out


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(description=__doc__.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("ckpt_dir", help="a step_NNNNNNNN directory, a checkpoints/ directory or a run directory")
    parser.add_argument("out_dir", help="where the HF model goes (must not exist or be empty)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the written weights")
    parser.add_argument("--max_shard_gb", type=float, default=5.0, help="split the weights above this size")
    parser.add_argument("--verify", choices=["auto", "hf", "files"], default="auto",
                        help="hf: load with transformers too; files: check the written tensors only")  # fmt: skip
    parser.add_argument("--check_logits", type=bool, default=False, help="compare transformers' logits with ours")
    try:
        args = parser.parse_args(argv)
        consolidate(args.ckpt_dir, args.out_dir, args.dtype, args.max_shard_gb, args.verify, args.check_logits)
    except Exception as e:  # noqa: BLE001 -- a CLI: one line, exit 1
        sys.exit(f"error: {' '.join(str(e).split())}")


if __name__ == "__main__":
    main()
