"""Models in and out: our checkpoint -> an HF directory (consolidate), an HF directory -> a checkpoint a recipe can
start from (import_hf), and either -> a model and its tokenizer in this process (load_model).

Our parameter names are HF's and RoPE uses HF's layout, so weights cross by name, unchanged (see hf.py). Nothing here
needs a process group: checkpoints of any world size are read whole.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from fsdp_trainer.adapters.peft_format import save_peft_adapter
from fsdp_trainer.checkpoint.storage import RECIPE_FILE
from fsdp_trainer.checkpoint.weights import (
    SavedModel,
    export_shapes,
    load_model_weights,
    read_saved_model,
    save_model_weights,
    weight_stream,
)
from fsdp_trainer.config import ModelConfig, Recipe, compute_dtype, sections_to_yaml
from fsdp_trainer.files import CHECKPOINTS_DIR, write_failure
from fsdp_trainer.hf import (
    check_safetensors,
    check_with_transformers,
    hf_config,
    hf_stored_tensors,
    load_safetensors,
    model_config_from_hf,
    save_safetensors,
    write_tokenizer_files,
)
from fsdp_trainer.hf_experts import per_expert
from fsdp_trainer.model import Transformer, count_params, on_meta
from fsdp_trainer.tokenizer import (
    HF_GENERATION_CONFIG,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
    tokenizer_files,
)


def _shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    with on_meta():
        return {name: t.shape for name, t in Transformer(cfg).state_dict().items()}


def _model_weights(ckpt: SavedModel, adapters_only: bool = False) -> dict[str, torch.Tensor]:
    """The full fp32 weights of a checkpoint, with a LoRA run's adapters merged into the weights they adapt (HF's
    model has no place for them), or with `adapters_only` the adapters alone."""
    if adapters_only:
        return load_model_weights(ckpt.path, export_shapes(ckpt)[1])
    return dict(weight_stream(ckpt)[1])


def export_adapter(ckpt_dir: str, out_dir: str, dtype: str = "fp32") -> Path:
    """A LoRA run's adapters as a PEFT adapter directory, which appears only once complete (tools/consolidate.py
    --lora adapter)."""
    ckpt = read_saved_model(ckpt_dir)
    if ckpt.lora is None:
        raise ValueError(f"{ckpt.path} was trained without LoRA (lora.rank null), so it has no adapters; drop --lora")
    out = _new_output_dir(out_dir)
    adapters = _model_weights(ckpt, adapters_only=True)
    with _written_whole(out) as tmp:
        save_peft_adapter(adapters, ckpt.lora, tmp, dtype)
    print(f"{ckpt.path} -> {out} (PEFT LoRA adapter: rank {ckpt.lora.rank}, {len(adapters)} tensors, {dtype})")
    return out


def _new_output_dir(out_dir: str | os.PathLike) -> Path:
    """An output directory a tool may write: absent or empty (checked before any work)."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; remove it or choose another OUT_DIR")
    return out


@contextmanager
def _written_whole(out: Path) -> Iterator[Path]:
    """A temporary directory beside `out` to write into, renamed to `out` (with the user's usual permissions:
    mkdtemp made it private) once the block has finished, and removed otherwise: `out` appears only complete. A write
    that fails (a full disk) is one line naming the file and the room left."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        for path in [tmp, *tmp.iterdir()]:
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except OSError as e:
        raise OSError(f"{write_failure(e, out.parent)}; nothing was written to {out}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def is_hf_dir(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and not (path / CHECKPOINTS_DIR).exists()


def load_model(path: str | os.PathLike) -> tuple[Transformer, Tokenizer]:
    """A model in eval mode (fp32, CPU) and its tokenizer, from a run directory, a checkpoint (any world size) or a
    consolidated HF directory."""
    path = Path(path)
    if is_hf_dir(path):
        cfg = model_config_from_hf(json.loads((path / "config.json").read_text()), str(path / "config.json"))
        state = load_safetensors(path)
        tokenizer_path = path
    else:
        ckpt = read_saved_model(path)
        cfg, tokenizer_path, state = ckpt.model, ckpt.tokenizer, _model_weights(ckpt)
        if tokenizer_path is None:
            raise FileNotFoundError(f"{ckpt.path} carries no tokenizer, and its recipe's data.tokenizer_path is gone")
    model = Transformer(cfg)
    model.load_state_dict(state, strict=not cfg.tied_output)
    return model.eval(), load_tokenizer(tokenizer_path)


def write_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """The tokenizer's files for transformers' AutoTokenizer: an HF tokenizer's own (chat template included), or for
    a sentencepiece model the model plus a tokenizer.json built from it that gives the same ids."""
    if isinstance(tokenizer, SentencePieceTokenizer):
        write_tokenizer_files(tokenizer.path, out_dir)
        return
    for name, path in tokenizer_files(tokenizer.path).items():
        shutil.copyfile(path, out_dir / name)


HF_EXPORT_DIR = "hf"
"""Under train.out_dir: the HF directory checkpoint.export_hf writes at the end of a run."""


def export_hf_sharded(model: torch.nn.Module, recipe: Recipe, is_main: bool) -> Path:
    """Every rank's shards of the model's weights as one HF directory train.out_dir/hf (fp32), written by DCP's
    HuggingFaceStorageWriter and consolidated into model safetensors by the coordinator, so no process gathers the
    whole model; rank 0 adds config.json, the tokenizer and the sampling defaults. Collective: call it on every rank.
    The directory is written beside its place and renamed, so a reader never sees half of it."""
    cfg = recipe.model
    out = Path(recipe.train.out_dir) / HF_EXPORT_DIR
    tmp = out.with_name(f".{out.name}.partial")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # an earlier attempt cut short
    dist.barrier()  # no rank writes into the directory before it is clean
    state = get_model_state_dict(model)
    if cfg.tied_output:
        state.pop("lm_head.weight")  # the same tensor as embed_tokens; HF ties them again on load
    writer = HuggingFaceStorageWriter(
        str(tmp), fqn_to_index_mapping=dict.fromkeys(state, 1), save_distributed=True, enable_consolidation=True
    )
    dcp.save(state, storage_writer=writer)
    if is_main:
        shutil.rmtree(tmp / "sharded", ignore_errors=True)  # each rank's part, now consolidated
        tokenizer = load_tokenizer(recipe.data.tokenizer_path) if recipe.data.tokenizer_path else None
        config = hf_config(cfg, "fp32", tokenizer)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer is not None:
            write_tokenizer(tokenizer, tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    dist.barrier()  # every rank returns once the directory is in place
    return out


def _available_memory() -> float:
    """Bytes of memory this machine can give a process now (Linux's MemAvailable; else all of it)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def consolidate(
    ckpt_dir: str,
    out_dir: str,
    dtype: str = "fp32",
    max_shard_gb: float = 5.0,
    verify: str = "auto",
    check_logits: bool = False,
) -> Path:
    """Write a checkpoint as an HF directory, which appears only once complete and checked (tools/consolidate.py). The
    weights pass one tensor at a time (a shard's worth in memory); `verify="hf"` then loads the whole model into
    transformers, which `auto` does only where it takes at most half the memory available."""
    read = read_saved_model(ckpt_dir)
    ckpt, cfg, tokenizer_path = read.path, read.model, read.tokenizer
    out = _new_output_dir(out_dir)
    shapes, tensors = per_expert(*weight_stream(read))  # an MoE's experts in the Hub's layout
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path is not None else None
    torch_dtype = compute_dtype(dtype)
    model_bytes = sum(shape.numel() for shape in shapes.values()) * torch_dtype.itemsize

    if verify == "auto":
        try:
            import transformers  # noqa: F401

            # transformers loads the whole model: only where it takes at most half the memory available
            verify = "hf" if model_bytes <= _available_memory() / 2 else "files"
        except ImportError:
            verify = "files"
    with _written_whole(out) as tmp:
        crcs = save_safetensors(shapes, tensors, tmp, dtype, int(max_shard_gb * 1e9))
        config = hf_config(cfg, dtype, tokenizer)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer is not None:
            write_tokenizer(tokenizer, tmp)
        if (ckpt / HF_GENERATION_CONFIG).is_file():  # an imported model's sampling defaults, carried through
            shutil.copyfile(ckpt / HF_GENERATION_CONFIG, tmp / HF_GENERATION_CONFIG)
        check_safetensors(tmp, shapes, crcs)
        if verify == "hf":
            model = None
            if check_logits:  # our model beside transformers': both whole, by what is asked
                model = Transformer(cfg)
                model.load_state_dict(_model_weights(read), strict=not cfg.tied_output)
                model.to(torch_dtype)
            diff = check_with_transformers(tmp, model, torch_dtype)
            if diff is not None:
                print(f"max |logits(transformers) - logits(ours)| = {diff:.2e}")
                if diff > (1e-4 if dtype == "fp32" else 5e-2):
                    raise ValueError(f"transformers' logits differ from ours by {diff:.2e}")
    n_params = sum(shape.numel() for shape in shapes.values())
    print(f"{ckpt} -> {out} ({n_params / 1e6:.1f}M parameters, {dtype}, verified: {verify})")
    return out


def import_hf(hf_dir: str, out_dir: str) -> Path:
    """An HF Llama / Qwen3 directory -> a weights-only checkpoint under out_dir and out_dir/model.yaml, the recipe's
    model section for it (see tools/import_hf.py)."""
    hf, out = Path(hf_dir), Path(out_dir)
    config_path = hf / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist")
    if (out / CHECKPOINTS_DIR).exists():
        raise FileExistsError(f"{out}/{CHECKPOINTS_DIR} exists; remove it or choose another OUT_DIR")
    cfg = model_config_from_hf(json.loads(config_path.read_text()), str(config_path))
    expected = _shapes(cfg)
    stored = hf_stored_tensors(hf)  # where each tensor is: checked from the headers, read only as it is written
    if cfg.tied_output:
        stored.pop("lm_head.weight", None)  # some exporters write the tied copy; ours is the embedding
        if "model.embed_tokens.weight" in stored:
            stored["lm_head.weight"] = stored["model.embed_tokens.weight"]
    missing, unexpected = set(expected) - set(stored), set(stored) - set(expected)
    if missing or unexpected:
        raise ValueError(f"{hf}: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]} for {cfg.family}")
    for name, shape in expected.items():
        if stored[name].shape != shape:
            raise ValueError(f"{hf}: {name} has shape {tuple(stored[name].shape)}, config.json implies {tuple(shape)}")
    state = {name: torch.empty(shape, device="meta") for name, shape in expected.items()}  # fp32, as trained

    model_yaml = sections_to_yaml({"model": cfg})
    try:  # the tokenizer comes along, so that OUT_DIR serves as data.tokenizer_path
        tokenizer = {name: path.read_bytes() for name, path in tokenizer_files(hf).items()}
    except FileNotFoundError:
        tokenizer = {}
    if (hf / HF_GENERATION_CONFIG).is_file():  # and the sampling defaults, back out at export
        tokenizer[HF_GENERATION_CONFIG] = (hf / HF_GENERATION_CONFIG).read_bytes()
    out.mkdir(parents=True, exist_ok=True)
    attachments = {RECIPE_FILE: model_yaml.encode(), **tokenizer}
    path = save_model_weights(state, out, attachments, read=lambda name: stored[name].read().float())
    for name, content in tokenizer.items():
        (out / name).write_bytes(content)
    (out / "model.yaml").write_text(model_yaml)
    print(f"{hf} -> {path} ({count_params(cfg) / 1e6:.1f}M parameters) and {out / 'model.yaml'}")
    return path
