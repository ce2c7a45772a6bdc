"""A packed micro-batch's examples taken apart into prompts and answers, and new (prompt, answer) examples packed
into windows: for the kinds that train on sequences the data holds only in parts (on-policy distillation's sampled
answers, KTO's prompts with other examples' answers)."""

from __future__ import annotations

from collections.abc import Callable

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


WIDTH_STEP = 16
"""Packed windows are cut to a multiple of this many tokens: few distinct shapes (a compiled block's graphs), whole
tiles on a GPU."""


def tightest(layout: Callable[[int], list], length: int, longest: int) -> tuple[list, int]:
    """(the rows `layout(window)` packs a micro-batch's examples into, the window): the shortest window, a multiple of
    WIDTH_STEP no shorter than the `longest` example (or `length`), that packs them into no more rows than `length`
    does. Rows filled greedily leave the last nearly empty, and the window is every row's length: GRPO's bench packed
    rows of about 345 and 100 tokens into 2 x 352 positions, now 2 x 224. Filling rows in order takes no fewer of them
    in a shorter window, so a binary search finds it."""
    rows = layout(length)
    best = rows, length
    windows = range(WIDTH_STEP * -(-max(longest, 1) // WIDTH_STEP), length, WIDTH_STEP)
    lo, hi = 0, len(windows)
    while lo < hi:
        mid = (lo + hi) // 2
        fitted = layout(windows[mid])
        if len(fitted) <= len(rows):
            best, hi = (fitted, windows[mid]), mid
        else:
            lo = mid + 1
    return best


def example_rows(examples: list[tuple[np.ndarray, list[int] | np.ndarray]], length: int) -> list[list[tuple]]:
    """`packed`'s rows at a window of `length`: (k, prompt, answer) of the examples each holds, filled in order."""
    rows: list[list[tuple[int, np.ndarray, np.ndarray]]] = [[]]
    used = 0
    for k, (prompt, answer) in enumerate(examples):
        if used + len(prompt) + len(answer) > length:
            rows.append([])
            used = 0
        rows[-1].append((k, prompt, np.asarray(answer, dtype=np.int64)))
        used += len(prompt) + len(answer)
    return rows


def packed(examples: list[tuple[np.ndarray, list[int] | np.ndarray]], length: int, device: torch.device) -> MicroBatch:
    """(prompt, answer) pairs packed in order into windows of `length` tokens at most (as short as keeps their
    number: `tightest`), block-causal, trained on the answers, each answer's targets numbered in `sequences` by its
    example's place in `examples`; one untrained window if there are none (the step's forward still runs on every
    rank)."""
    longest = max((len(prompt) + len(answer) for prompt, answer in examples), default=0)
    rows, length = tightest(lambda window: example_rows(examples, window), length, longest)
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


def tree_rows(groups: list[tuple[np.ndarray, list[np.ndarray]]], length: int) -> list[list[tuple]]:
    """`packed_tree`'s rows at a window of `length`: (prompt, [(number, answer), ...]) of the trees each holds."""
    rows: list[list[tuple[np.ndarray, list[tuple[int, np.ndarray]]]]] = [[]]
    used, number = 0, 0
    for prompt, answers in groups:
        opened = False  # whether this prompt is the current row's last
        for answer in answers:
            branch = 1 + len(answer)
            if not opened or used + branch > length:
                if used + len(prompt) - 1 + branch > length:
                    rows.append([])
                    used = 0
                rows[-1].append((prompt, []))
                used, opened = used + len(prompt) - 1, True
            rows[-1][-1][1].append((number, np.asarray(answer, dtype=np.int64)))
            used, number = used + branch, number + 1
    return rows


def packed_tree(groups: list[tuple[np.ndarray, list[np.ndarray]]], length: int, device: torch.device) -> MicroBatch:
    """Prompts each with several answers, packed in order into windows of `length` tokens as trees: a prompt's
    tokens but its last once, then each answer after a copy of that last token (which predicts the answer's first),
    seeing the prompt through `shared` (model.block_causal): the logits `packed` gives each (prompt, answer) alone,
    for the prompt's tokens once instead of once an answer. Answers are numbered in `sequences` in order; a group too
    long for one window goes on in the next after its prompt again. Windows as short as keeps their number
    (`tightest`)."""
    longest = max((len(prompt) + len(answer) for prompt, answers in groups for answer in answers), default=0)
    rows, length = tightest(lambda window: tree_rows(groups, window), length, longest)
    inputs = np.zeros((len(rows), length), dtype=np.int64)
    targets = np.full((len(rows), length), IGNORE, dtype=np.int64)
    documents = np.zeros((len(rows), length), dtype=np.int64)
    shared = np.zeros((len(rows), length), dtype=np.int64)
    sequences = np.full((len(rows), length), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        at, document = 0, 0
        for prompt, branches in row:
            document += 1
            head = document
            inputs[r, at : at + len(prompt) - 1] = prompt[:-1]
            documents[r, at : at + len(prompt) - 1] = shared[r, at : at + len(prompt) - 1] = head
            at += len(prompt) - 1
            for number, answer in branches:
                document += 1
                tokens = np.concatenate([prompt[-1:], answer])
                inputs[r, at : at + len(tokens)] = tokens
                targets[r, at : at + len(answer)] = answer  # the prompt's last token predicts the answer's first
                sequences[r, at : at + len(answer)] = number
                documents[r, at : at + len(tokens)] = document
                shared[r, at : at + len(tokens)] = head if len(prompt) > 1 else document
                at += len(tokens)
        documents[r, at:] = shared[r, at:] = document + 1  # the padding is an example of its own
    tensors = [torch.from_numpy(x).to(device) for x in (inputs, targets, documents, sequences, shared)]
    return MicroBatch(*tensors[:4], trained=trained_positions(targets, device), shared=tensors[4])
