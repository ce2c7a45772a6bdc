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
from fsdp_trainer.loss import IGNORE
from fsdp_trainer.model import sample_batch
from fsdp_trainer.tokenizer import load_tokenizer


def prompts_of(batch: MicroBatch) -> list[np.ndarray]:
    """The prompt of each example of a packed micro-batch that has an answer, in row-major order: its tokens up to
    the last one before its last run of targets, which predicts the answer's first token."""
    if batch.documents is None:
        raise ValueError("distill.lmbda samples answers to the prompts of chat examples; this data is token windows")
    inputs, targets, documents = (x.cpu().numpy() for x in (batch.inputs, batch.targets, batch.documents))
    prompts = []
    for row in range(inputs.shape[0]):
        starts = np.flatnonzero(np.diff(documents[row], prepend=-1))
        for start, end in zip(starts, [*starts[1:], inputs.shape[1]], strict=True):
            trained = targets[row, start:end] != IGNORE
            if not trained.any():
                continue  # padding, or an example whose answer the window did not keep
            last = np.flatnonzero(trained)[-1]
            untrained = np.flatnonzero(~trained[:last])
            answer = 0 if len(untrained) == 0 else untrained[-1] + 1
            if answer == 0:
                raise ValueError(
                    "distill.lmbda samples answers to prompts, and an example of this data is trained from its first "
                    "token (prepared with train_on=all?): prepare it with train_on=assistant"
                )
            prompts.append(inputs[row, start : start + answer + 1])
    return prompts


def packed(examples: list[tuple[np.ndarray, list[int]]], length: int, device: torch.device) -> MicroBatch:
    """(prompt, answer) pairs packed in order into windows of `length` tokens, block-causal, trained on the answers;
    one untrained window if there are none (the step's forward still runs on every rank)."""
    rows: list[list[tuple[np.ndarray, list[int]]]] = [[]]
    used = 0
    for prompt, answer in examples:
        if used + len(prompt) + len(answer) > length:
            rows.append([])
            used = 0
        rows[-1].append((prompt, answer))
        used += len(prompt) + len(answer)
    inputs = np.zeros((len(rows), length), dtype=np.int64)
    targets = np.full((len(rows), length), IGNORE, dtype=np.int64)
    documents = np.zeros((len(rows), length), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for number, (prompt, answer) in enumerate(row, start=1):
            tokens = np.concatenate([prompt, np.asarray(answer, dtype=np.int64)])
            inputs[r, at : at + len(tokens)] = tokens
            targets[r, at + len(prompt) - 1 : at + len(tokens) - 1] = answer  # position i predicts token i + 1
            documents[r, at : at + len(tokens)] = number
            at += len(tokens)
        documents[r, at:] = len(row) + 1  # the padding after the last example is an example of its own
    return MicroBatch(*(torch.from_numpy(x).to(device) for x in (inputs, targets, documents)))


class OnPolicy:
    """Which steps sample (`due`), and their micro-batches with the model's answers (`batches`)."""

    def __init__(self, cfg: DistillConfig, seed: int, tokenizer_path: str):
        self.cfg, self.seed, self.tokenizer_path = cfg, seed, tokenizer_path

    @functools.cached_property
    def stop_ids(self) -> list[int]:
        """Where an answer ends: the chat template's end of turn (which the data's answers end with) and the EOS."""
        tokenizer = load_tokenizer(self.tokenizer_path)
        return sorted({ChatEncoder(tokenizer).end_of_turn(), *([] if tokenizer.eos_id is None else [tokenizer.eos_id])})

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
                prompts, length = prompts_of(batch), batch.inputs.shape[1]
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
