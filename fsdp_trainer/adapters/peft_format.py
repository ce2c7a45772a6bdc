"""PEFT's LoRA adapter directory (adapter_model.safetensors and adapter_config.json): our adapters' names and layouts
in and out of it, and the check of one against a recipe's lora section before any tensor is read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fsdp_trainer.config import LoraConfig, compute_dtype
from fsdp_trainer.hf import SCORE_HEAD, read_safetensors_one_by_one, save_file_named

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module's name in an adapter file (`base_model.model.model.layers.0.self_attn.q_proj.lora_A
.weight`); the rest of the name is ours, which is HF's."""


EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
"""PEFT's target_parameters for lora.targets `experts`, in this order: PEFT nests a wrapper per parameter, the first
innermost, so gate_up_proj's adapter is `mlp.experts.base_layer.lora_A` and down_proj's `mlp.experts.lora_A`."""
EXPERT_ADAPTERS = {".experts.gate_up_lora.": ".experts.base_layer.", ".experts.down_lora.": ".experts."}
"""Our names of an MoE's experts' adapters (adapters/lora.py: LoRAExperts) and PEFT's."""


def peft_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An adapter tensor (by our name) in PEFT's layout. An expert adapter's factors are ours stacked experts first
    (lora.ExpertsAdapter): A (experts, rank, in) is PEFT's (rank x experts, in), expert e's rows e x rank ...; B
    (experts, out, rank) is PEFT's (out, rank x experts), expert e's columns e, e + experts, ..."""
    if ".experts." not in name:
        return tensor
    if name.endswith("lora_A.weight"):
        return tensor.reshape(-1, tensor.shape[-1])
    return tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1)


def our_layout(name: str, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """peft_layout's inverse: an adapter tensor (by our name) of a PEFT file in our layout."""
    if ".experts." not in name:
        return tensor
    if name.endswith("lora_A.weight"):
        return tensor.reshape(-1, rank, tensor.shape[-1])
    return tensor.reshape(tensor.shape[0], rank, -1).permute(2, 0, 1).contiguous()


def peft_name(name: str) -> str:
    """An adapter tensor's name in a PEFT adapter file, from ours."""
    for ours, theirs in EXPERT_ADAPTERS.items():
        name = name.replace(ours, theirs)
    return PEFT_PREFIX + name


def our_name(peft: str) -> str:
    """An adapter tensor's name here, from a PEFT adapter file's."""
    name = peft.removeprefix(PEFT_PREFIX).replace(".default.", ".")
    if ".experts.base_layer." in name:
        return name.replace(".experts.base_layer.", ".experts.gate_up_lora.")
    return name.replace(".experts.lora_", ".experts.down_lora.lora_")


def save_peft_adapter(adapters: dict[str, torch.Tensor], lora: LoraConfig, out_dir: Path, dtype: str) -> None:
    """A PEFT LoRA adapter directory: adapter_model.safetensors under PEFT's names and adapter_config.json, which
    `peft.PeftModel.from_pretrained(base_model, out_dir)` loads."""
    torch_dtype = compute_dtype(dtype)
    tensors = {peft_name(name): peft_layout(name, t).to(torch_dtype).contiguous() for name, t in adapters.items()}
    save_file_named(tensors, out_dir / "adapter_model.safetensors")
    classifier = SCORE_HEAD in adapters
    config = {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if classifier else "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(set(lora.targets) - {"experts"}),
        "target_parameters": EXPERT_PARAMETERS if "experts" in lora.targets else None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": ["score"] if classifier else None,  # a reward model's head, trained whole
        "inference_mode": True,
        "base_model_name_or_path": None,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))


def check_peft_adapter(adapter_dir: str | os.PathLike, lora: LoraConfig) -> Path:
    """A PEFT LoRA adapter directory's adapter_model.safetensors, once its adapter_config.json is checked against the
    recipe's `lora` section (reading no tensor): an adapter of another rank, scale or set of targets would train as
    something else than it was."""
    adapter_dir = Path(adapter_dir)
    config_path, weights = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    for path in (config_path, weights):
        if not path.is_file():
            raise FileNotFoundError(f"lora.adapter={adapter_dir} has no {path.name}: not a PEFT adapter directory")
    config = json.loads(config_path.read_text())
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets or []
    if config.get("target_parameters"):
        if sorted(config["target_parameters"]) != sorted(EXPERT_PARAMETERS):
            raise ValueError(f"{config_path} adapts the parameters {config['target_parameters']}: only a mixture of "
                             f"experts' {EXPERT_PARAMETERS} together (lora.targets experts)")  # fmt: skip
        if config["target_parameters"] != EXPERT_PARAMETERS:
            raise ValueError(f"{config_path} nests its experts' adapters in another order than {EXPERT_PARAMETERS}")
        targets.append("experts")
    targets = sorted(targets)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{config_path} is a {config.get('peft_type')} adapter, not LoRA")
    for theirs, ours in (("r", "rank"), ("lora_alpha", "alpha")):
        found, wanted = config.get(theirs), getattr(lora, ours)
        if found != wanted:
            raise ValueError(f"{config_path} has {theirs}={found}, the recipe lora.{ours}={wanted}; make them agree")
    if targets != sorted(lora.targets):
        raise ValueError(f"{config_path} adapts {targets}, the recipe's lora.targets {sorted(lora.targets)}")
    if config.get("use_dora") or config.get("use_rslora") or config.get("bias", "none") != "none":
        raise ValueError(f"{config_path} uses DoRA, rsLoRA or trained biases, which this trainer's LoRA does not")
    return weights


def load_peft_adapter(adapter_dir: str | os.PathLike, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The fp32 tensors of a PEFT LoRA adapter directory under our names, checked as check_peft_adapter does."""
    weights = check_peft_adapter(adapter_dir, lora)
    tensors = {}
    for name, tensor in read_safetensors_one_by_one(weights):
        if not name.startswith(PEFT_PREFIX) or (".lora_" not in name and name != PEFT_PREFIX + SCORE_HEAD):
            raise ValueError(f"{weights} holds {name}, not a LoRA matrix or a reward model's head under PEFT's names")
        ours = our_name(name)
        tensors[ours] = our_layout(ours, tensor.float(), lora.rank)
    return tensors
