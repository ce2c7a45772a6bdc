"""Every shipped recipe parses, validates and builds on the meta device with the parameter count of its model."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_trainer.config import parse_recipe
from fsdp_trainer.model import count_params

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

# Published sizes: Llama-3.2-1B 1,235,814,400; Llama-3-8B 8,030,261,248; Qwen3-0.6B 596,049,920 (tied).
EXPECTED_PARAMS = {
    "debug.yaml": 4_196_608,  # 4096*256 + 4*(196_608 + 589_824 + 512) + 256
    "125m.yaml": 123_685_632,  # 32000*768 + 12*(2_359_296 + 5_898_240 + 1536) + 768
    "1b.yaml": 1_235_814_400,
    "8b.yaml": 8_030_261_248,
    "long_context_llama3_1_8b.yaml": 8_030_261_248,
    "qwen3_0.6b.yaml": 596_049_920,
    "llama3_2_1b_finetune.yaml": 1_235_814_400,
    "qwen3_0.6b_finetune.yaml": 596_049_920,
    "sft_llama3_2_1b.yaml": 1_235_814_400,
    "sft_qwen3_0.6b.yaml": 596_049_920,
    "lora_llama3_2_1b.yaml": 1_235_814_400,
    "lora_qwen3_0.6b.yaml": 596_049_920,
    "qlora_llama3_8b.yaml": 8_030_261_248,
    "dpo_qwen3_0.6b.yaml": 596_049_920,
    "grpo_qwen3_0.6b.yaml": 596_049_920,
    "dpo_lora_llama3_2_1b.yaml": 1_235_814_400,
    "simpo_qwen3_0.6b.yaml": 596_049_920,
    "orpo_qwen3_0.6b.yaml": 596_049_920,
    "kto_qwen3_0.6b.yaml": 596_049_920,
    "reward_qwen3_0.6b.yaml": 596_050_944,  # no output layer (it was the embedding), a score head of 1024
    "mistral_nemo_lora.yaml": 12_247_782_400,  # Mistral-Nemo-Base-2407
    "gemma3_1b_sft.yaml": 999_885_952,  # gemma-3-1b-pt
    "qwen3_30b_a3b_lora.yaml": 30_532_122_624,  # Qwen3-30B-A3B: 30.5B in all, 3.3B active
    "gemma3_12b_lora.yaml": 11_766_034_176,  # gemma-3-12b-it's language model (its text_config), tied output
    "distill_qwen3_8b_to_0.6b.yaml": 596_049_920,
    "distill_llama3_1_8b_to_3_2_1b.yaml": 1_235_814_400,
    "tiny_sft.yaml": 4_196_608,  # the debug model
    "tiny_dpo.yaml": 4_196_608,
    "tiny_reverse_sft.yaml": 4_196_608,
    "tiny_grpo.yaml": 4_196_608,
}


def test_every_recipe_is_listed():
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == sorted(EXPECTED_PARAMS)


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_recipe_parses_and_builds(name):
    recipe = parse_recipe(["--recipe", str(RECIPES / name)])
    assert count_params(recipe.model) == EXPECTED_PARAMS[name]
    text = (RECIPES / name).read_text()
    assert text.startswith("#") and "fsdp-train" in text.split("\nmodel:")[0]  # opens with how to launch it


def test_qwen3_recipe_has_qk_norm():
    recipe = parse_recipe(["--recipe", str(RECIPES / "qwen3_0.6b.yaml")])
    assert recipe.model.qk_norm and recipe.model.resolved_head_dim == 128
