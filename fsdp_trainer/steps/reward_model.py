"""A reward model of ours as one of online RL's rewards (grpo.reward_model): a checkpoint of the reward kind, held
frozen and sharded beside the policy as a teacher is, scoring each completion as tools/score.py scores an answer.

A completion is scored as the conversation its prompt and its text make, rendered with the reward model's own
tokenizer and chat template (the one it was trained with, carried in its checkpoint) and read at the last token by
its score head (steps/reward.py); a text prompt is the user's turn. The text is re-tokenized, as TRL's GRPOTrainer
does for a reward model, so the reward model need not share the policy's tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from fsdp_trainer.checkpoint.starts import Start
from fsdp_trainer.checkpoint.storage import checkpoint_tokenizer, resolve_checkpoint, saved_sections
from fsdp_trainer.data.chat import ChatEncoder
from fsdp_trainer.distributed.parallelize import reshard, uses_flex_attention
from fsdp_trainer.distributed.runtime import DistEnv
from fsdp_trainer.model import count_params
from fsdp_trainer.steps.base import frozen_copy
from fsdp_trainer.steps.examples import packed
from fsdp_trainer.steps.reward import LastTokenScores
from fsdp_trainer.tokenizer import load_tokenizer

REWARD_MODEL_FILE = "reward_model.json"
"""In an online-RL run's step directory: where its reward model's weights came from (checkpoint/starts.py)."""


def reward_model_sections(path: str) -> tuple[Path, dict]:
    """(the reward model's step directory, the recipe sections it was saved with), read without its weights."""
    step = resolve_checkpoint(path, "grpo.reward_model")
    return step, saved_sections(step)


def check_reward_model(path: str) -> None:
    """A complete checkpoint of a reward model that carries its tokenizer: ValueError naming what it lacks."""
    step, sections = reward_model_sections(path)
    if sections["model"].num_labels != 1:
        raise ValueError(
            f"grpo.reward_model {step} is not a reward model (its model.num_labels is {sections['model'].num_labels}, "
            "a reward model's is 1): train one with a reward recipe (docs/reward_models.md)"
        )
    if checkpoint_tokenizer(step, sections["data"].tokenizer_path) is None:
        raise ValueError(f"grpo.reward_model {step} carries no tokenizer to render the completions with")


def reward_model_params(recipe: Any) -> int:
    """The reward model's parameters (0 without one), for the planner."""
    path = recipe.grpo.reward_model
    return 0 if path is None else count_params(reward_model_sections(path)[1]["model"])


class RewardModel:
    """A frozen reward model scoring completions (`__call__`), as a reward named `reward_model`."""

    name = "reward_model"

    def __init__(self, model: nn.Module, tokenizer_path: str | Path, weight: float = 1.0, source=None, device="cpu"):
        self.model, self.weight, self.source, self.device = model, weight, source, torch.device(device)
        self.encoder = ChatEncoder(load_tokenizer(tokenizer_path))

    @classmethod
    def build(cls, recipe: Any, env: DistEnv) -> RewardModel:
        """Built on the meta device from its checkpoint's model section, parallelized as the policy is
        (build.build_step materializes it; the checkpointer loads its weights: `start`)."""
        step, sections = reward_model_sections(recipe.grpo.reward_model)
        flex = uses_flex_attention(recipe.parallel, env.device)
        model = frozen_copy(sections["model"], recipe.parallel, env.mesh, flex)
        tokenizer = checkpoint_tokenizer(step, sections["data"].tokenizer_path)
        return cls(model, tokenizer, recipe.grpo.reward_model_weight, step, env.device)

    def start(self) -> Start:
        return Start(REWARD_MODEL_FILE, self.model, "reward model is", source=self.source)

    def conversation(self, prompt: str | list[dict], text: str) -> np.ndarray:
        """The token ids the reward model reads of a prompt and a completion's text (its last max_seq_len)."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        ids = self.encoder.encode_messages([*messages, {"role": "assistant", "content": text}])[0]
        return ids[-self.model.cfg.max_seq_len :]

    @torch.no_grad()
    def __call__(self, prompts: list, texts: list[str]) -> np.ndarray:
        """Each completion's score (n,), from its prompt (text or messages) and text: one forward of them packed."""
        conversations = [self.conversation(prompt, text) for prompt, text in zip(prompts, texts, strict=True)]
        longest = max(len(ids) for ids in conversations)
        window = max(longest, min(self.model.cfg.max_seq_len, 4 * longest))
        batch = packed([(ids[:-1], ids[-1:]) for ids in conversations], window, self.device)
        objective = LastTokenScores(batch.sequences, len(texts), batch.documents)
        scores = self.model(batch.inputs, batch.documents, loss=objective)
        reshard(self.model)
        return scores.float().cpu().numpy()
