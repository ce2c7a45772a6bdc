"""On-policy batches (GKD; Agarwal et al. 2024): a micro-batch of chat examples in which each example's last answer
is replaced by one the model being trained samples from the example's prompt, so a step learns from the teacher on
what the model itself says.

An example's prompt is its tokens up to its last answer: the untrained tokens that end where its last run of
targets starts (the template's generation prompt included). The answers are sampled in one batch per micro-batch
through a KV cache, with the model's weights gathered once for all of a step's sampling (held_gathered), so the ranks
need not sample the same number of tokens. Each example draws from a generator seeded by (train.seed, step, its
prompt), so its answer does not depend on the rank, micro-batch or neighbours it was given: 2 ranks sample what 1
process does. The new examples are packed in order into windows of the same length, one after the other (a window
that cannot take the next starts a new one), and trained on their answers only.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch
import torch.nn as nn

from fsdp_trainer.config import DistillConfig
from fsdp_trainer.data.chat import ChatEncoder
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import ShardingPlan, held_gathered
from fsdp_trainer.generation import last_logits, sample_batch
from fsdp_trainer.model import KVCache
from fsdp_trainer.steps.examples import examples_of, packed
from fsdp_trainer.tokenizer import Tokenizer, load_tokenizer


def stop_ids(tokenizer: Tokenizer) -> list[int]:
    """Where a sampled answer ends: the chat template's end of turn (which chat data's answers end with) and the
    tokenizer's EOS."""
    return sorted({ChatEncoder(tokenizer).end_of_turn(), *([] if tokenizer.eos_id is None else [tokenizer.eos_id])})


class OnPolicy:
    """Which steps sample (`due`), and their micro-batches with the model's answers (`batches`)."""

    def __init__(self, cfg: DistillConfig, seed: int, tokenizer_path: str):
        self.cfg, self.seed, self.tokenizer_path = cfg, seed, tokenizer_path

    @functools.cached_property
    def stop_ids(self) -> list[int]:
        return stop_ids(load_tokenizer(self.tokenizer_path))

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` trains on sampled answers: with probability lmbda, drawn from (seed, step)."""
        return self.cfg.lmbda > 0 and np.random.default_rng([self.seed, step]).random() < self.cfg.lmbda

    @torch.no_grad()
    def batches(self, model: nn.Module, micro_batches: list[MicroBatch], plan: ShardingPlan, step: int):
        """The micro-batches with each example's last answer sampled from `model` (sharded; every rank calls this)."""
        device = micro_batches[0].inputs.device
        stop_ids = torch.tensor(self.stop_ids, device=device)
        out = []
        with held_gathered(model, plan):
            for batch in micro_batches:
                prompts, length = [prompt for prompt, _ in examples_of(batch)], batch.inputs.shape[1]
                if not prompts:
                    model(torch.zeros(1, 1, dtype=torch.long, device=device))  # the gathers every rank takes part in
                    out.append(packed([], length, device))
                    continue
                limits = [min(self.cfg.max_new_tokens, length - len(prompt)) for prompt in prompts]
                answers = sample_batch(
                    model,
                    [torch.from_numpy(prompt).to(device) for prompt in prompts],
                    limits,
                    self.cfg.sample_temperature,
                    stop_ids,
                    [self.generator(step, prompt, device) for prompt in prompts],
                )
                out.append(packed(list(zip(prompts, answers, strict=True)), length, device))
        return out

    def generator(self, step: int, prompt: np.ndarray, device: torch.device) -> torch.Generator:
        seed = zlib.crc32(prompt.astype(np.int64).tobytes(), zlib.crc32(f"{self.seed}:{step}".encode()))
        return torch.Generator(device=device).manual_seed(seed)


@torch.no_grad()
def rehearse(model: nn.Module, plan: ShardingPlan, prompts: torch.Tensor, n: int, positions: int) -> None:
    """What sampling `n` continuations of each of `prompts` (B, T) allocates, without drawing a token (the planner's
    step on fake tensors, where nothing can be drawn): the model gathered whole, the prompts read into a KV cache of
    `positions` and copied to their samples' rows, and one decode pass's logits with their log-softmax."""
    with held_gathered(model, plan):
        cache = KVCache(model.cfg, positions)
        model(prompts, cache=cache, loss=last_logits)
        cache.repeat_rows(n)
        model(prompts[:, -1:].repeat_interleave(n, 0), cache=cache)[:, -1].float().log_softmax(-1)
