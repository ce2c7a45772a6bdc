"""The loader that cuts token files (data/format.py: one file or a directory of shards) into batches, and
mixtures of several.

The loader's sample order is a pure function of (seed, global sample index): sample k is the window
tokens[k * seq_len : (k + 1) * seq_len + 1], and epoch e visits the windows in a permutation drawn from (seed, e).
Step t uses global samples [t * B, (t + 1) * B) with B = micro_batch_size * grad_accum_steps * world_size, and rank r
takes its micro-batches from that range. So the batch at step t is the same set of sequences whatever the world size
and the micro-batch / accumulation split, and the loader's whole state is one integer plus a fingerprint. A shard
directory reads as the concatenation of its shards, so all of this holds for it unchanged.

Packed fine-tuning data (format.py) is cut the same way, except that a sample is one of its windows of exactly seq_len
tokens, read with its flags: the targets are the next tokens where trained on and IGNORE elsewhere, and `documents`
numbers each token's example, for block-causal attention.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from fsdp_trainer.config import Recipe
from fsdp_trainer.data.chat import RECORDS
from fsdp_trainer.data.format import DESIRABLE, START, TARGET, Tokens, open_tokens
from fsdp_trainer.loss import IGNORE
from fsdp_trainer.tokenizer import fingerprint


class MicroBatch(NamedTuple):
    inputs: torch.Tensor
    """(B, T) token ids."""
    targets: torch.Tensor
    """(B, T) the next token of each, or IGNORE where it is not trained on."""
    documents: torch.Tensor | None = None
    """(B, T) packed data only: the example each token belongs to (block-causal attention; see model.block_causal)."""
    sequences: torch.Tensor | None = None
    """(B, T) preference pairs and unpaired answers: the response each target belongs to, numbered through the
    micro-batch in row-major order (pairs: chosen, rejected of each pair), -1 where there is no target."""
    pairs: int = 0
    """Preference pairs only: how many the micro-batch holds."""
    desirable: torch.Tensor | None = None
    """(responses,) unpaired answers only: whether each response (numbered as in `sequences`) is labelled good."""
    windows: torch.Tensor | None = None
    """(B,) on the host, packed data of one file: the window of that file each row is (a cache's key)."""
    margins: torch.Tensor | None = None
    """(pairs,) preference pairs whose file has margins (TRL's margin column): each pair's, in `sequences` order."""
    trained: torch.Tensor | None = None
    """(N,) packed data: the positions (row-major over B x T) whose target is trained, found on the host from the
    flags: the output layer and the loss run on them alone (a prompt's logits are never made)."""
    shared: torch.Tensor | None = None
    """(B, T) several answers to one prompt packed after one copy of it: the example each position continues
    (model.block_causal; steps/examples.py's packed_tree)."""
    context: Any = None
    """Context parallelism: the window's positions the rows above hold (distributed/context_parallel.py's cut)."""


def trained_positions(targets: np.ndarray, device: torch.device) -> torch.Tensor:
    """MicroBatch.trained of packed targets (B, T): the row-major positions whose target is not IGNORE."""
    return torch.from_numpy(np.flatnonzero(targets != IGNORE)).to(device, non_blocking=True)


def open_data(recipe: Recipe) -> tuple[Tokens | Mixture, Tokens | None]:
    """Open the recipe's token files (the validation file only when the run evaluates) and check them against the
    tokenizer and the model; raises ValueError / FileNotFoundError naming the file."""
    data = recipe.data
    if data.mixture:
        sources = [open_tokens(source.path) for source in data.mixture]
        names = [Path(source.path).name.removesuffix(".bin") or source.path for source in data.mixture]
        names = [name if names.count(name) == 1 else f"{i}:{name}" for i, name in enumerate(names)]
        train_file = Mixture(sources, [s.weight for s in data.mixture], names, recipe.train.seed)
    else:
        sources = [train_file := open_tokens(data.train_path)]
    val_file = open_tokens(data.val_path) if data.val_path and recipe.train.eval_every else None
    if not os.path.exists(data.tokenizer_path):
        raise FileNotFoundError(f"data.tokenizer_path={data.tokenizer_path} does not exist")
    tokenizer_sha = fingerprint(data.tokenizer_path)
    for f in filter(None, (*sources, val_file)):
        recipe.model.check_vocab(f"token file {f.path}", f.vocab_size)
        if f.tokenizer_sha256 != tokenizer_sha:
            raise ValueError(f"{f.path} was not made with data.tokenizer_path={data.tokenizer_path}; prepare it again")
        if f.packed_seq_len not in (None, data.seq_len):
            raise ValueError(
                f"{f.path} holds examples packed into windows of {f.packed_seq_len} tokens, not data.seq_len="
                f"{data.seq_len}: set data.seq_len {f.packed_seq_len}, or prepare the data again with this seq_len"
            )
    if len({f.packed_seq_len is None for f in sources}) > 1:
        raise ValueError("data.mixture mixes packed fine-tuning data with plain token files; use one kind")
    kinds = {f.path: holds(f) for f in filter(None, (*sources, val_file))}
    if len(set(kinds.values())) > 1:
        (first, held), (other, other_held) = next(
            ((a, kinds[a]), (b, kinds[b])) for a in kinds for b in kinds if kinds[a] != kinds[b]
        )
        raise ValueError(
            f"{first} holds {held} and {other} {other_held}: a run trains on one kind (prepare both with the same "
            "--format)"
        )
    return train_file, val_file


def eval_batches(val_file: Tokens, seq_len: int, micro_batch_size: int, world_size: int, eval_steps: int):
    """(global micro-batches an evaluation reads, a note or None): train.eval_steps, or as many whole ones as the
    validation file holds, so that no window is scored twice (the note says so, once a run)."""
    windows, per_batch = _Epochs(val_file, seq_len, [0], shuffle=False).n_samples, micro_batch_size * world_size
    whole = windows // per_batch
    if eval_steps <= whole:
        return eval_steps, None
    if not whole:
        return 1, (
            f"{val_file.path} holds {windows} windows of {seq_len}, fewer than one global micro-batch ({per_batch}): "
            "each evaluation scores some of them twice; prepare more validation data (--val_fraction)"
        )
    return whole, (
        f"train.eval_steps={eval_steps} is more than {val_file.path} holds ({windows} windows, {whole} global "
        f"micro-batches of {per_batch}): each evaluation scores those {whole}, each window once"
    )


def holds(tokens: Tokens) -> str:
    """What a token file holds, in words."""
    return RECORDS[tokens.records] if tokens.records else "token windows or examples"


class Mixture:
    """Several token sources, each drawn with its weight. Global samples fall into blocks of BLOCK; in each, every
    source gets its share of the slots (largest remainder), in an order drawn from (seed, block). So the source of
    global sample i, and which of that source's samples it is, are a function of (seed, i), and over any window of
    samples each source's share is its weight's to within one sample per block."""

    BLOCK = 1024

    def __init__(self, sources: list[Tokens], weights: list[float], names: list[str], seed: int):
        self.sources, self.weights, self.names, self.seed = sources, weights, names, seed
        shares = np.array(weights) / sum(weights) * self.BLOCK
        self.quotas = np.floor(shares).astype(np.int64)
        self.quotas[np.argsort(-(shares - self.quotas), kind="stable")[: self.BLOCK - self.quotas.sum()]] += 1
        for name, quota in zip(names, self.quotas, strict=True):
            if not quota:
                raise ValueError(f"data.mixture: {name}'s weight is too small to draw one sample in {self.BLOCK}")
        self.path = "mixture of " + ", ".join(str(source.path) for source in sources)
        self.vocab_size = max(source.vocab_size for source in sources)
        self.records = sources[0].records  # open_data refuses a mixture of preference pairs and other data
        self.fingerprint = "mixture:" + "|".join(
            f"{w}:{src.fingerprint}" for w, src in zip(weights, sources, strict=True)
        )
        self._block, self._slots = -1, None

    def _block_slots(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot of a block, which of that source's samples it is)."""
        if block != self._block:
            which = np.random.default_rng([self.seed, 7, block]).permutation(
                np.repeat(np.arange(len(self.quotas)), self.quotas)
            )
            rank = np.empty(self.BLOCK, dtype=np.int64)
            for source, quota in enumerate(self.quotas):
                rank[which == source] = block * quota + np.arange(quota)
            self._block, self._slots = block, (which, rank)
        return self._slots

    def assign(self, global_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index among that source's samples) of each global sample."""
        which, local = np.empty_like(global_ids), np.empty_like(global_ids)
        blocks, slots = np.divmod(global_ids, self.BLOCK)
        for block in np.unique(blocks):
            mask = blocks == block
            block_which, block_rank = self._block_slots(int(block))
            which[mask], local[mask] = block_which[slots[mask]], block_rank[slots[mask]]
        return which, local

    def drawn(self, n: int) -> np.ndarray:
        """How many of the first n global samples each source gave."""
        blocks, rest = divmod(n, self.BLOCK)
        which, _ = self._block_slots(blocks) if rest else (np.zeros(0, np.int64), None)
        return blocks * self.quotas + np.bincount(which[:rest], minlength=len(self.quotas))


class _Epochs:
    """The windows of one token source, visited in epochs, each in a permutation drawn from (seed key, epoch)."""

    def __init__(self, tokens: Tokens, seq_len: int, seed_key: list[int], shuffle: bool):
        self.tokens, self.seq_len, self.seed_key, self.shuffle = tokens, seq_len, seed_key, shuffle
        self.packed = tokens.packed_seq_len is not None
        self.window = seq_len if self.packed else seq_len + 1  # plain windows overlap by the last target
        self.n_samples = (len(tokens) - self.window + seq_len) // seq_len
        if self.n_samples < 1:
            raise ValueError(f"{tokens.path} has {len(tokens)} tokens, fewer than one sequence of {self.window}")
        self._epoch, self._order = -1, None

    def read(self, sample_ids: np.ndarray) -> np.ndarray:
        """The windows of this source's samples `sample_ids` (counted over all its epochs): (B, seq_len + 1) tokens,
        or for packed data (B, 2, seq_len): tokens and flags."""
        positions = self.positions(sample_ids)
        if self.packed:
            starts = positions * self.seq_len
            tokens, flags = self.tokens.windows(starts, self.window), self.tokens.flag_windows(starts, self.window)
            return np.stack([tokens, flags], 1)
        return self.tokens.windows(positions * self.seq_len, self.window)

    def margins(self, sample_ids: np.ndarray) -> np.ndarray | None:
        """The margins of these samples' windows (B, seq_len), of a file of pairs with margins; else None."""
        if getattr(self.tokens, "margins", None) is None:
            return None
        return self.tokens.margin_windows(self.positions(sample_ids) * self.seq_len, self.window)

    def positions(self, sample_ids: np.ndarray) -> np.ndarray:
        """Which window of the file each of this source's samples is, in its epoch's order."""
        epochs, positions = np.divmod(sample_ids, self.n_samples)
        if self.shuffle:
            for epoch in np.unique(epochs):  # a batch spans at most two epochs
                if epoch != self._epoch:
                    self._epoch = int(epoch)
                    self._order = np.random.default_rng([*self.seed_key, self._epoch]).permutation(self.n_samples)
                mask = epochs == epoch
                positions[mask] = self._order[positions[mask]]
        return positions


def _responses(documents: np.ndarray, trained: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the number of the response each target belongs to, -1 elsewhere; each response's key) of packed windows:
    the documents that have targets, numbered in row-major order (preference pairs: chosen, rejected alternate,
    format.py), keyed row x (length + 1) + document."""
    rows, length = documents.shape
    keys = np.where(trained, np.arange(rows)[:, None] * (length + 1) + documents, -1)
    responses = np.unique(keys[trained])
    return np.where(trained, np.searchsorted(responses, keys), -1), responses


def _at_starts(documents: np.ndarray, flags: np.ndarray, responses: np.ndarray, values: np.ndarray) -> np.ndarray:
    """What `values` (B, T) hold at each response's (by its key, _responses) document's START: a label, a margin."""
    rows, length = documents.shape
    starts = (flags & START) > 0
    keys = (np.arange(rows)[:, None] * (length + 1) + documents)[starts]  # in row-major order, so sorted
    return values[starts][np.searchsorted(keys, responses)]


def micro_batch(
    rows: np.ndarray,
    packed: bool,
    records: str | None,
    device: torch.device,
    windows: np.ndarray | None = None,
    margins: np.ndarray | None = None,
) -> MicroBatch:
    """A micro-batch of rows read from a token file: windows of seq_len + 1 tokens (B, T + 1), or packed windows of
    tokens and their flags (B, 2, T), on `device`; `records` preference or unpaired: their responses numbered;
    `windows`: which of the file's windows the rows are (kept on the host); `margins` (B, T): a file of pairs'."""
    pairs, desirable, pair_margins = 0, None, None
    if packed:  # (B, 2, T): tokens, flags
        tokens, flags = rows[:, 0], rows[:, 1]
        targets = np.where(flags & TARGET, np.roll(tokens, -1, axis=1), IGNORE)
        documents = np.cumsum((flags & START) > 0, axis=1)
        rows = [tokens, targets, documents]
        if records is not None:
            sequences, responses = _responses(documents, targets != IGNORE)
            rows.append(sequences)
            if records == "preference" and len(responses) % 2:
                raise ValueError("a window of preference data holds an odd number of responses: prepare the data again")
            pairs = len(responses) // 2 if records == "preference" else 0
            if records == "unpaired":
                desirable = torch.from_numpy(_at_starts(documents, flags, responses, (flags & DESIRABLE) > 0))
                desirable = desirable.to(device)
            if records == "preference" and margins is not None:  # on each pair's chosen conversation's START
                pair_margins = torch.from_numpy(_at_starts(documents, flags, responses, margins)[0::2]).to(device)
        rows = np.stack(rows, 1)
    trained = None
    if packed:
        trained = trained_positions(rows[:, 1], device)
    rows = torch.from_numpy(rows)
    if device.type == "cuda":
        rows = rows.pin_memory().to(device, non_blocking=True)
    windows = None if windows is None else torch.from_numpy(windows)
    if records is not None:
        extra = (pairs, desirable, windows, pair_margins, trained)
        return MicroBatch(rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3], *extra)
    if packed:
        return MicroBatch(rows[:, 0], rows[:, 1], rows[:, 2], trained=trained)
    return MicroBatch(rows[:, :-1], rows[:, 1:])  # (B, T + 1) -> inputs, next tokens


def _read_mixture(
    sources: list[_Epochs], which: np.ndarray, local: np.ndarray, seq_len: int, packed: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """(the rows, their margins or None) of samples drawn from a mixture's `sources`: sample i is sample local[i] of
    source which[i]."""
    shape = (2, seq_len) if packed else (seq_len + 1,)
    rows, margins = np.empty((len(which), *shape), dtype=np.int64), None
    if any(getattr(source.tokens, "margins", None) is not None for source in sources):
        margins = np.zeros((len(which), seq_len), np.float32)  # a source without: 0
    for source in np.unique(which):
        rows[which == source] = sources[source].read(local[which == source])
        if margins is not None and (read := sources[source].margins(local[which == source])) is not None:
            margins[which == source] = read
    return rows, margins


class TokenLoader:
    """Batches of (inputs, targets) for one rank, in an order fixed by the seed; checkpointable by state_dict()."""

    def __init__(
        self,
        token_file: Tokens | Mixture,
        seq_len: int,
        micro_batch_size: int,
        grad_accum_steps: int = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        device: torch.device | str = "cpu",
        shard: Callable[[MicroBatch], MicroBatch] | None = None,  # each read on the host, cut to this rank's share
    ):
        self.file, self.shard, self.records = token_file, shard or (lambda batch: batch), token_file.records
        self.seq_len, self.micro_batch_size, self.grad_accum_steps = seq_len, micro_batch_size, grad_accum_steps
        self.rank, self.world_size = rank, world_size  # among the ranks that read different windows
        self.seed, self.shuffle, self.device = seed, shuffle, torch.device("cpu" if shard else device)
        self.mixture = token_file if isinstance(token_file, Mixture) else None
        if self.mixture is None:
            self.sources = [_Epochs(token_file, seq_len, [seed], shuffle)]
        else:  # each source its own epochs
            self.sources = [_Epochs(t, seq_len, [seed, i + 1], shuffle) for i, t in enumerate(self.mixture.sources)]
        self.packed = self.sources[0].packed  # open_data refuses a mixture of packed and plain sources
        self.global_batch_size = micro_batch_size * grad_accum_steps * world_size
        self.consumed = 0  # global samples handed out so far, by all ranks together

    def _micro_batch(self, first_global_id: int) -> MicroBatch:
        global_ids = np.arange(first_global_id, first_global_id + self.micro_batch_size)
        windows = margins = None
        if self.mixture is None:
            rows = self.sources[0].read(global_ids)
            windows = self.sources[0].positions(global_ids) if self.packed else None
            margins = self.sources[0].margins(global_ids)
        else:
            which, local = self.mixture.assign(global_ids)
            rows, margins = _read_mixture(self.sources, which, local, self.seq_len, self.packed)
        return self.shard(micro_batch(rows, self.packed, self.records, self.device, windows, margins))

    def mixture_report(self) -> dict[str, dict[str, float]] | None:
        """Per source of a mixture: the tokens drawn so far and the epochs that makes (None without a mixture)."""
        if self.mixture is None:
            return None
        drawn = self.mixture.drawn(self.consumed)
        return {
            name: {"tokens": int(n) * self.seq_len, "epochs": round(int(n) / source.n_samples, 4)}
            for name, n, source in zip(self.mixture.names, drawn, self.sources, strict=True)
        }

    def next_batch(self) -> list[MicroBatch]:
        """This rank's grad_accum_steps micro-batches of the next global batch, each of micro_batch_size x seq_len
        tokens."""
        start = self.consumed
        per_micro_step = self.micro_batch_size * self.world_size
        batch = [
            self._micro_batch(start + m * per_micro_step + self.rank * self.micro_batch_size)
            for m in range(self.grad_accum_steps)
        ]
        self.consumed += self.global_batch_size
        return batch

    def state_dict(self) -> dict:
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "fingerprint": self.file.fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        for key, ours in (("fingerprint", self.file.fingerprint), ("seed", self.seed), ("seq_len", self.seq_len)):
            if state[key] != ours:
                raise ValueError(
                    f"the checkpoint's data loader was at a different {key} ({state[key]!r}, now {ours!r} for "
                    f"{self.file.path}); resume with the same data and recipe, or start fresh with "
                    "--checkpoint.resume none"
                )
        self.consumed = int(state["consumed"])
