"""A packed micro-batch's examples taken apart into prompts and answers, and new (prompt, answer) examples packed
into windows: for the kinds that train on sequences the data holds only in parts (on-policy distillation's sampled
answers, KTO's prompts with other examples' answers)."""

from __future__ import annotations

import numpy as np
import torch

from fsdp_trainer.data.loader import MicroBatch, trained_positions
from fsdp_trainer.loss import IGNORE


def examples_of(batch: MicroBatch, last_answer: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, answer) of each example of a packed micro-batch that has targets, in row-major order. The answer is
    its last run of targets (`last_answer`: a multi-turn conversation's last answer), or everything from its first
    target to its last; the prompt is its tokens before that (through the one that predicts the answer's first)."""
    if batch.documents is None:
        raise ValueError("this kind takes chat examples apart into prompts and answers; this data is token windows")
    inputs, targets, documents = (x.cpu().numpy() for x in (batch.inputs, batch.targets, batch.documents))
    examples = []
    for row in range(inputs.shape[0]):
        starts = np.flatnonzero(np.diff(documents[row], prepend=-1))
        for start, end in zip(starts, [*starts[1:], inputs.shape[1]], strict=True):
            trained = targets[row, start:end] != IGNORE
            if not trained.any():
                continue  # padding, or an example whose answer the window did not keep
            where = np.flatnonzero(trained)
            first = where[0]
            if last_answer:
                untrained = np.flatnonzero(~trained[: where[-1]])
                first = 0 if len(untrained) == 0 else untrained[-1] + 1
            if first == 0:
                raise ValueError(
                    "an example of this data is trained from its first token (prepared with train_on=all?), so it "
                    "has no prompt: prepare it with train_on=assistant"
                )
            answer = targets[row, start + first : start + where[-1] + 1]
            answer = np.where(answer == IGNORE, inputs[row, start + first + 1 : start + where[-1] + 2], answer)
            examples.append((inputs[row, start : start + first + 1], answer))
    return examples


def packed(examples: list[tuple[np.ndarray, list[int] | np.ndarray]], length: int, device: torch.device) -> MicroBatch:
    """(prompt, answer) pairs packed in order into windows of `length` tokens, block-causal, trained on the answers,
    each answer's targets numbered in `sequences` by its example's place in `examples`; one untrained window if there
    are none (the step's forward still runs on every rank)."""
    rows: list[list[tuple[int, np.ndarray, np.ndarray]]] = [[]]
    used = 0
    for k, (prompt, answer) in enumerate(examples):
        if used + len(prompt) + len(answer) > length:
            rows.append([])
            used = 0
        rows[-1].append((k, prompt, np.asarray(answer, dtype=np.int64)))
        used += len(prompt) + len(answer)
    inputs = np.zeros((len(rows), length), dtype=np.int64)
    targets = np.full((len(rows), length), IGNORE, dtype=np.int64)
    documents = np.zeros((len(rows), length), dtype=np.int64)
    sequences = np.full((len(rows), length), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for number, (k, prompt, answer) in enumerate(row, start=1):
            tokens = np.concatenate([prompt, answer])
            inputs[r, at : at + len(tokens)] = tokens
            predicting = slice(at + len(prompt) - 1, at + len(tokens) - 1)  # position i predicts token i + 1
            targets[r, predicting] = answer
            sequences[r, predicting] = k
            documents[r, at : at + len(tokens)] = number
            at += len(tokens)
        documents[r, at:] = len(row) + 1  # the padding after the last example is an example of its own
    tensors = (torch.from_numpy(x).to(device) for x in (inputs, targets, documents, sequences))
    return MicroBatch(*tensors, trained=trained_positions(targets, device))
