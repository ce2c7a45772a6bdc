"""Hugging Face formats: config.json <-> ModelConfig, safetensors shards (written, read and checked), tokenizer files
from sentencepiece, and the check that transformers loads what we wrote (PEFT's adapter files:
adapters/peft_format.py).

Our parameter names are HF's and RoPE uses HF's rotate-half layout (model.py), so weights move between the two
formats by name, unchanged; only the tied `lm_head.weight` is left out of HF files, as HF does.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from fsdp_trainer.config import (
    COMPUTE_DTYPES,
    ModelConfig,
    MoEConfig,
    RopeScaling,
    compute_dtype,
    local_layers,
)
from fsdp_trainer.hf_experts import stacked_experts
from fsdp_trainer.tokenizer import FILE_NAME as TOKENIZER_FILE
from fsdp_trainer.tokenizer import Tokenizer

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
MODEL_TYPES = {"gemma3": "gemma3_text"}
"""config.json's model_type where it is not the family's name (Gemma 3's text model)."""
FAMILIES = {MODEL_TYPES.get(family, family): family for family in ARCHITECTURES}
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}
"""transformers' Gemma3TextConfig defaults: the published multimodal checkpoints (4B-27B) spell only the fields of
their text_config that differ from them."""
MULTIMODAL = "gemma3"
"""model_type of Gemma 3's image-text checkpoints (Gemma3ForConditionalGeneration, 4B-27B): their text_config and
language model's weights are a Gemma3ForCausalLM; the vision tower and its projector are left out."""
LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.", "language_model.": ""}
"""Where a multimodal checkpoint keeps the language model's tensors (the Hub's layout; transformers 5's in memory)."""
CLASSIFIER = "ForSequenceClassification"
"""What a reward model's architecture ends with (Qwen3ForSequenceClassification), in place of ForCausalLM."""


def architecture(cfg: ModelConfig) -> str:
    """The transformers class of a model: its family's causal LM, or with num_labels its sequence classifier."""
    causal_lm = ARCHITECTURES[cfg.family]
    return causal_lm if cfg.num_labels is None else causal_lm.replace("ForCausalLM", CLASSIFIER)


def hf_config(cfg: ModelConfig, dtype: str, tokenizer: Tokenizer | None = None) -> dict:
    """config.json for LlamaForCausalLM / Qwen3ForCausalLM / MistralForCausalLM, or a reward model's
    *ForSequenceClassification (one label, and the tokenizer's pad id, by which transformers finds each padded
    sequence's last token), with the `tokenizer`'s special ids. Every field HF would otherwise default is spelled out:
    a missing head_dim, rms_norm_eps, rope_theta or tie_word_embeddings loads without error and gives wrong logits."""
    scaling = asdict(cfg.rope_scaling) if cfg.rope_scaling else {}
    if scaling.get("rope_type") == "linear":
        scaling = {"rope_type": "linear", "factor": scaling["factor"]}
    config = {
        "architectures": [architecture(cfg)],
        "model_type": MODEL_TYPES.get(cfg.family, cfg.family),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        # transformers >= 5 reads `rope_parameters`, 4.x `rope_scaling` and `rope_theta`: both are written.
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, **scaling},
        "rope_scaling": scaling or None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tied_output,
        "torch_dtype": COMPUTE_DTYPES[dtype],
        "initializer_range": cfg.init_std,
        "use_cache": True,
    }
    if cfg.family in ("qwen3", "qwen3_moe"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    if cfg.moe is not None:
        moe = cfg.moe
        config.update(num_experts=moe.experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.ffn_dim,
                      norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=moe.sparse_step,
                      mlp_only_layers=list(moe.dense_layers), router_aux_loss_coef=moe.aux_loss_coef)  # fmt: skip
    if cfg.family == "mistral":
        config["sliding_window"] = cfg.sliding_window
    if cfg.family == "gemma3":
        config.update(gemma3_fields(cfg, scaling))
    if tokenizer is not None and tokenizer.bos_id is not None:
        config["bos_token_id"] = tokenizer.bos_id
    if tokenizer is not None and tokenizer.eos_id is not None:
        config["eos_token_id"] = tokenizer.eos_id
    if tokenizer is not None and tokenizer.pad_id is not None:  # what batched generation and a score head pad with
        config["pad_token_id"] = tokenizer.pad_id
    if cfg.num_labels is not None:
        config.update(id2label={str(i): f"LABEL_{i}" for i in range(cfg.num_labels)})
        config.setdefault("pad_token_id", None)
        config["label2id"] = {label: int(i) for i, label in config["id2label"].items()}
    return config


def gemma3_fields(cfg: ModelConfig, scaling: dict) -> dict:
    """What Gemma 3's config.json says beyond Llama's: its activation, attention scale, local and global layers and
    their rotary bases, for transformers 5 (`rope_parameters` per layer type, `layer_types`) and 4.x."""
    local_theta = cfg.rope_local_theta or cfg.rope_theta
    types = ["sliding_attention" if i in local_layers(cfg) else "full_attention" for i in range(cfg.n_layers)]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.resolved_head_dim,
        "sliding_window": cfg.sliding_window,
        "sliding_window_pattern": cfg.sliding_window_pattern,
        "layer_types": types,
        "rope_local_base_freq": local_theta,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta, **scaling},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def gemma3_config(config: dict, source: str) -> dict:
    """ModelConfig's Gemma 3 keys from its config.json; ValueError for what our model lacks (soft-capping, layer types
    that do not repeat)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            raise ValueError(f"{source}: {key}={config[key]} is not supported (Gemma 3 has none; Gemma 2 does)")
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention is not supported (a causal language model only)")
    n_layers, window = config["num_hidden_layers"], config.get("sliding_window")
    pattern = config.get("sliding_window_pattern", 6)
    types = config.get("layer_types")
    if types is not None:
        full = [i for i, kind in enumerate(types) if kind == "full_attention"]
        pattern = full[0] + 1 if full else n_layers + 1
        wanted = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
        if types != wanted:
            raise ValueError(f"{source}: layer_types do not repeat one local:global pattern, which this model needs")
    rope = config.get("rope_parameters") or {}
    local = (rope.get("sliding_attention") or {}).get("rope_theta", config.get("rope_local_base_freq", 10000.0))
    return {
        "sliding_window_pattern": pattern if window else None,
        "rope_local_theta": local,
        "query_pre_attn_scalar": config.get("query_pre_attn_scalar", 256),
    }


def model_config_from_hf(config: dict, source: str = "config.json") -> ModelConfig:
    """ModelConfig for an HF Llama / Qwen3 / Mistral config.json; refuses (ValueError naming the field) what our model
    lacks."""
    if config.get("model_type") == MULTIMODAL and "text_config" in config:
        config = {**config["text_config"], "model_type": MODEL_TYPES["gemma3"]}
    family = FAMILIES.get(config.get("model_type"))
    if family == "gemma3":
        config = {**GEMMA3_TEXT_DEFAULTS, **config}
    if family is None:
        raise ValueError(
            f"{source}: model_type {config.get('model_type')!r} is not supported (only {sorted(FAMILIES)})"
        )
    # transformers 4.x writes `rope_scaling` (rope_type, or `type` before 4.45) and `rope_theta`; 5.x writes
    # `rope_parameters`, with the theta inside (Gemma 3: per layer type, the global layers' scaled).
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope) if family == "gemma3" else rope
    scaling = rope_scaling_from_hf(rope, source)
    for key, unsupported in (("attention_bias", True), ("mlp_bias", True), ("use_sliding_window", True)):
        if config.get(key) == unsupported:
            raise ValueError(f"{source}: {key}={unsupported} is not supported")
    activation = "gelu_pytorch_tanh" if family == "gemma3" else "silu"
    for key in ("hidden_act", "hidden_activation"):
        if config.get(key, activation) != activation:
            raise ValueError(f"{source}: {key}={config[key]!r} is not supported ({family}: {activation})")
    n_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    num_labels = None
    if any(name.endswith(CLASSIFIER) for name in config.get("architectures") or []):
        num_labels = len(config.get("id2label") or {"0": "LABEL_0"})
        if num_labels != 1:
            raise ValueError(f"{source}: a classifier of {num_labels} labels; only reward models (1) are supported")
    return ModelConfig(
        family=family,
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=None if head_dim * n_heads == config["hidden_size"] else head_dim,
        ffn_dim=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        max_seq_len=config.get("max_position_embeddings", 2048),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=config.get("sliding_window") if family in ("mistral", "gemma3") else None,
        num_labels=num_labels,
        **(gemma3_config(config, source) if family == "gemma3" else {}),
        moe=moe_config(config) if family == "qwen3_moe" else None,
    )


def moe_config(config: dict) -> MoEConfig:
    """A Qwen3-MoE config.json's mixture of experts (transformers' defaults for what it omits)."""
    return MoEConfig(
        experts=config.get("num_experts", config.get("num_local_experts", 128)),  # transformers 5 writes the second
        top_k=config.get("num_experts_per_tok", 8),
        ffn_dim=config.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        sparse_step=config.get("decoder_sparse_step", 1),
        dense_layers=list(config.get("mlp_only_layers") or []),
        aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
    )


def rope_scaling_from_hf(rope: dict, source: str) -> RopeScaling | None:
    """RopeScaling from config.json's rope_scaling / rope_parameters: llama3, linear, or none (default)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=rope["factor"])
    if rope_type != "llama3":
        raise ValueError(f"{source}: rope_scaling.rope_type={rope_type!r} is not supported (llama3, linear or none)")
    try:
        return RopeScaling(**{f.name: rope[f.name] for f in fields(RopeScaling) if f.name != "rope_type"})
    except KeyError as e:
        raise ValueError(f"{source}: llama3 rope scaling lacks {e.args[0]}") from None


SCORE_HEAD = "score.weight"
"""A reward model's score head, which a LoRA run trains whole beside its adapters, as PEFT's modules_to_save: its
adapter file holds it under this name (after adapters.peft_format.PEFT_PREFIX)."""


def save_file_named(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, with an I/O error raised as the OSError it is ("... I/O error: No space left on device
    (os error 28)" comes as a SafetensorError from Rust), naming the file."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from e


def _tensor_crc(tensor: torch.Tensor) -> int:
    """CRC-32 of a (contiguous) tensor's bytes."""
    return zlib.crc32(tensor.view(torch.uint8).numpy() if tensor.numel() else b"")


def save_safetensors(
    shapes: dict[str, torch.Size],
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    dtype: str,
    max_shard_bytes: int,
) -> dict[str, int]:
    """Write the model whose tensors have `shapes` as model.safetensors, or as model-0000i-of-0000n.safetensors + index
    above max_shard_bytes, taking `tensors` (name, values) one at a time in the order of `shapes`: only one shard's
    tensors, in `dtype`, are held at a time. Returns each tensor's CRC-32 as written, for check_safetensors."""
    out_dir = Path(out_dir)
    torch_dtype = compute_dtype(dtype)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = shape.numel() * torch_dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip
    weight_map, crcs = {}, {}
    tensors = iter(tensors)
    for file, names in zip(files, shards, strict=True):
        shard = {}
        for expected in names:
            name, values = next(tensors)
            if name != expected:
                raise ValueError(f"tensors came out of order: {name} where {expected} was due")
            shard[name] = values.to(torch_dtype).contiguous()
            crcs[name] = _tensor_crc(shard[name])
        save_file_named(shard, out_dir / file)
        weight_map.update(dict.fromkeys(names, file))
        del shard
    if len(files) > 1:
        total = sum(shape.numel() * torch_dtype.itemsize for shape in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return crcs


def _safetensors_files(hf_dir: Path) -> list[Path]:
    """The safetensors files of an HF directory: the shards its index names, or model.safetensors."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return [hf_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (hf_dir / "model.safetensors").is_file():
        return [hf_dir / "model.safetensors"]
    raise FileNotFoundError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json")


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor of a safetensors file is, read from the file's header alone."""

    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size

    def read(self) -> torch.Tensor:
        """The tensor as stored, read with plain reads: memory-mapping the file (safe_open) would count the whole
        file in the process's resident memory."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = bytearray(f.read(self.nbytes))
        return torch.frombuffer(data, dtype=self.dtype).reshape(self.shape)


def stored_tensors(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of one safetensors file, by name, from its header; ValueError for a dtype we do not read."""
    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_size))
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: {name} is stored as {info['dtype']}, not one of {sorted(_SAFETENSORS_DTYPES)}")
        start, end = info["data_offsets"]
        entries[name] = StoredTensor(
            path, 8 + header_size + start, end - start, _SAFETENSORS_DTYPES[info["dtype"]], torch.Size(info["shape"])
        )
    return entries


def hf_stored_tensors(hf_dir: str | os.PathLike) -> dict[str, StoredTensor]:
    """Every tensor of an HF directory (single file or index + shards), by name, without reading any; of a multimodal
    Gemma 3, its language model's, under a causal LM's names."""
    hf_dir = Path(hf_dir)
    stored = {name: entry for file in _safetensors_files(hf_dir) for name, entry in stored_tensors(file).items()}
    stored = stacked_experts(stored, str(hf_dir))  # the Hub's per-expert tensors of an MoE, stacked as ours
    config = hf_dir / "config.json"
    if not config.is_file() or json.loads(config.read_text()).get("model_type") != MULTIMODAL:
        return stored
    language_model = {}
    for name, entry in stored.items():
        prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if name.startswith(p)), None)
        if prefix is not None:  # the vision tower and the projector stay behind
            language_model[LANGUAGE_MODEL_PREFIXES[prefix] + name.removeprefix(prefix)] = entry
    return language_model


def load_safetensors(hf_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory in fp32, read one tensor at a time and converted as it comes, so the memory it
    takes is the fp32 model plus one tensor as stored."""
    return {name: entry.read().float() for name, entry in hf_stored_tensors(hf_dir).items()}


def read_safetensors_one_by_one(path: Path):
    """Yield (name, tensor) from a safetensors file, one tensor read at a time."""
    for name, entry in stored_tensors(path).items():
        yield name, entry.read()


def check_safetensors(out_dir: Path, shapes: dict[str, torch.Size], crcs: dict[str, int]) -> None:
    """Every expected tensor is in the directory's files, with its shape and the bytes save_safetensors wrote (its
    CRC-32), read back one tensor at a time; nothing else is."""
    found = set()
    for file in sorted(out_dir.glob("*.safetensors")):
        for name, tensor in read_safetensors_one_by_one(file):
            if name not in shapes:
                raise ValueError(f"{file.name} holds {name}, which the model does not have")
            if tuple(tensor.shape) != tuple(shapes[name]) or _tensor_crc(tensor) != crcs[name]:
                raise ValueError(f"{name} in {file.name} differs from the checkpoint")
            found.add(name)
    if found != set(shapes):
        raise ValueError(f"the written files lack {sorted(set(shapes) - found)[:3]}")


def check_with_transformers(out_dir: Path, model: torch.nn.Module | None, dtype: torch.dtype) -> float | None:
    """Load with transformers and fail on any loading problem (transformers only warns, and fills missing weights
    with random values); with our `model`, return the largest logit difference on random tokens (a reward model's:
    of the scores, each at its sequence's last token)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    classifier = any(name.endswith(CLASSIFIER) for name in AutoConfig.from_pretrained(str(out_dir)).architectures)
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    hf, info = auto.from_pretrained(str(out_dir), output_loading_info=True, dtype=dtype)
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
        if classifier:  # no pad token in the batch: each row's score is read at its last position
            tokens[tokens == hf.config.pad_token_id] = (hf.config.pad_token_id + 1) % model.cfg.vocab_size
            return (hf.eval()(tokens).logits.float() - model(tokens)[:, -1].float()).abs().max().item()
        return (hf.eval()(tokens).logits.float() - model(tokens).float()).abs().max().item()


def write_tokenizer_files(sp_model_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """tokenizer.model (the sentencepiece file), tokenizer.json and tokenizer_config.json for PreTrainedTokenizerFast,
    giving the same ids as sentencepiece.

    tokenizer.json is a byte-fallback BPE whose merges are read off the sentencepiece vocabulary: every split of a
    piece into two pieces, ranked by the merged piece's score. Spaces become `▁` without a prefix (the model is
    trained with add_dummy_prefix off), and user-defined pieces such as the newline are added tokens.
    """
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(sp_model_path).read_bytes())
    Piece = sentencepiece_model_pb2.ModelProto.SentencePiece
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
    merges = []
    for i, (piece, _, kind) in enumerate(pieces):
        if kind != Piece.NORMAL:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((-pieces[i][1], i, vocab[left], vocab[right], left, right))
    merges.sort()
    unk = proto.trainer_spec.unk_piece
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=[m[4:] for m in merges], unk_token=unk, fuse_unk=True,
                              byte_fallback=True))  # fmt: skip
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    special = [p for p, _, kind in pieces if kind in (Piece.UNKNOWN, Piece.CONTROL)]
    tokenizer.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in special])
    tokenizer.add_tokens([AddedToken(p, normalized=False) for p, _, kind in pieces if kind == Piece.USER_DEFINED])

    out_dir = Path(out_dir)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / TOKENIZER_FILE).write_bytes(Path(sp_model_path).read_bytes())
    by_id = {i: p for i, (p, _, _) in enumerate(pieces)}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": by_id.get(proto.trainer_spec.bos_id),
        "eos_token": by_id.get(proto.trainer_spec.eos_id),
        "unk_token": unk,
        "pad_token": by_id[proto.trainer_spec.pad_id] if proto.trainer_spec.pad_id >= 0 else unk,  # as .pad_id says
        "add_bos_token": False,  # the training data has no BOS; documents end with EOS
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,  # like sentencepiece, read "<s>" in text as text
        "model_max_length": 1_000_000,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
