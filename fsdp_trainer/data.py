"""Token files on disk and the loader that cuts them into batches.

A token file is a flat little-endian array of uint16 (vocab <= 65535) or uint32 ids, with `<file>.meta.json` beside it
giving `dtype`, `n_tokens`, `vocab_size` and the tokenizer's fingerprint (tokenizer.fingerprint, a sha256). A large
corpus is a directory of such files (shards) with a `manifest.json` listing them in order; it reads as their
concatenation, so everything below holds for it unchanged.

The loader's sample order is a pure function of (seed, global sample index): sample k is the window
tokens[k * seq_len : (k + 1) * seq_len + 1], and epoch e visits the windows in a permutation drawn from (seed, e).
Step t uses global samples [t * B, (t + 1) * B) with B = micro_batch_size * grad_accum_steps * world_size, and rank r
takes its micro-batches from that range. So the batch at step t is the same set of sequences whatever the world size
and the micro-batch / accumulation split, and the loader's whole state is one integer plus a fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from fsdp_trainer.config import Recipe
from fsdp_trainer.files import write_atomic
from fsdp_trainer.tokenizer import fingerprint

BUNDLED_CORPUS = Path(__file__).parent / "assets" / "shakespeare.txt.gz"
"""The default corpus: 42 plays of Shakespeare (public domain; CC-BY 2.5 Open Knowledge Foundation, see assets/)."""

_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


MANIFEST = "manifest.json"
"""The file that makes a directory of token shards a corpus: the shards in order, their sizes and checksums."""


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.bin"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65536 else "uint32"


def write_token_file(
    path: str | os.PathLike, tokens: np.ndarray, vocab_size: int, tokenizer_sha256: str, extra: dict | None = None
) -> None:
    """Write ids and their `.meta.json` (plus `extra` keys); each file appears whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"{path}: token ids must lie in [0, {vocab_size})")
    write_atomic(path, tokens.astype(_DTYPES[dtype]).tobytes())
    meta = {
        "dtype": dtype,
        "n_tokens": int(tokens.size),
        "vocab_size": vocab_size,
        "tokenizer_sha256": tokenizer_sha256,
        **(extra or {}),
    }
    write_atomic(f"{path}.meta.json", json.dumps(meta, indent=2))


class TokenFile:
    """A memory-mapped token file, checked against its meta.json."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        meta_path = f"{path}.meta.json"
        if not os.path.isfile(self.path) or not os.path.isfile(meta_path):
            raise FileNotFoundError(
                f"token file {self.path} (or its .meta.json) does not exist; run "
                "`python tools/prepare_data.py --recipe RECIPE` to write it"
            )
        with open(meta_path) as f:
            self.meta = json.load(f)
        dtype = self.meta.get("dtype")
        if dtype not in _DTYPES:
            raise ValueError(f"{meta_path}: dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        expected = int(self.meta["n_tokens"]) * _DTYPES[dtype].itemsize
        if os.path.getsize(self.path) != expected:
            raise ValueError(
                f"{self.path} holds {os.path.getsize(self.path)} bytes but its meta.json says {expected}; "
                "the file is truncated or foreign: prepare the data again"
            )
        self.tokens = np.memmap(self.path, dtype=_DTYPES[dtype], mode="r")
        self.vocab_size = int(self.meta["vocab_size"])
        self.tokenizer_sha256 = self.meta.get("tokenizer_sha256", "")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def fingerprint(self) -> str:
        m = self.meta
        return f"{m['n_tokens']}:{m['dtype']}:{m['vocab_size']}:{m.get('tokenizer_sha256', '')}"

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """tokens[start : start + length] for each start, as int64 rows."""
        return self.tokens[starts[:, None] + np.arange(length)].astype(np.int64)


class TokenShards:
    """A directory of token files with a manifest, read as the concatenation of its shards in manifest order."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        manifest = Path(path) / MANIFEST
        if not manifest.is_file():
            raise FileNotFoundError(
                f"token directory {self.path} has no {MANIFEST}: its preparation did not finish; run "
                "`python tools/prepare_data.py` again, which keeps the shards already complete"
            )
        raw = manifest.read_bytes()
        self.meta = json.loads(raw)
        self.shards = [TokenFile(Path(path) / shard["file"]) for shard in self.meta["shards"]]
        for shard, listed in zip(self.shards, self.meta["shards"], strict=True):
            if len(shard) != listed["n_tokens"]:
                raise ValueError(f"{shard.path} holds {len(shard)} tokens but {manifest} says {listed['n_tokens']}")
        self.offsets = np.cumsum([0] + [len(shard) for shard in self.shards])
        self.vocab_size = int(self.meta["vocab_size"])
        self.tokenizer_sha256 = self.meta["tokenizer_sha256"]
        self.fingerprint = "manifest:" + hashlib.sha256(raw).hexdigest()  # the shards' checksums are in it

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, start in enumerate(starts):
            index = int(np.searchsorted(self.offsets, start, side="right")) - 1
            done = 0
            while done < length:  # a window may run over the end of one shard into the next
                local = start + done - self.offsets[index]
                piece = self.shards[index].tokens[local : local + length - done]
                out[row, done : done + len(piece)] = piece
                done += len(piece)
                index += 1
        return out


Tokens = TokenFile | TokenShards


def open_tokens(path: str | os.PathLike) -> Tokens:
    """A token file, or a directory of shards with a manifest."""
    return TokenShards(path) if os.path.isdir(path) else TokenFile(path)


def open_data(recipe: Recipe) -> tuple[Tokens, Tokens | None]:
    """Open the recipe's token files (the validation file only when the run evaluates) and check them against the
    tokenizer and the model; raises ValueError / FileNotFoundError naming the file."""
    data = recipe.data
    train_file = open_tokens(data.train_path)
    val_file = open_tokens(data.val_path) if data.val_path and recipe.train.eval_every else None
    if not os.path.exists(data.tokenizer_path):
        raise FileNotFoundError(f"data.tokenizer_path={data.tokenizer_path} does not exist")
    tokenizer_sha = fingerprint(data.tokenizer_path)
    for f in filter(None, (train_file, val_file)):
        if f.vocab_size > recipe.model.vocab_size:
            raise ValueError(
                f"{f.path} was tokenized with vocab_size={f.vocab_size}, more than model.vocab_size="
                f"{recipe.model.vocab_size}"
            )
        if f.tokenizer_sha256 != tokenizer_sha:
            raise ValueError(f"{f.path} was not made with data.tokenizer_path={data.tokenizer_path}; prepare it again")
    return train_file, val_file


class TokenLoader:
    """Batches of (inputs, targets) for one rank, in an order fixed by the seed; checkpointable by state_dict()."""

    def __init__(
        self,
        token_file: Tokens,
        seq_len: int,
        micro_batch_size: int,
        grad_accum_steps: int = 1,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        device: torch.device | str = "cpu",
    ):
        self.file = token_file
        self.seq_len, self.micro_batch_size, self.grad_accum_steps = seq_len, micro_batch_size, grad_accum_steps
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.device = torch.device(device)
        self.n_samples = (len(token_file) - 1) // seq_len
        if self.n_samples < 1:
            raise ValueError(
                f"{token_file.path} has {len(token_file)} tokens, fewer than one sequence of {seq_len + 1}"
            )
        self.global_batch_size = micro_batch_size * grad_accum_steps * world_size
        self.consumed = 0  # global samples handed out so far, by all ranks together
        self._epoch, self._order = -1, None

    def _sample_ids(self, global_ids: np.ndarray) -> np.ndarray:
        epochs, positions = np.divmod(global_ids, self.n_samples)
        if not self.shuffle:
            return positions
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):  # a batch spans at most two epochs
            if epoch != self._epoch:
                self._epoch = int(epoch)
                self._order = np.random.default_rng([self.seed, self._epoch]).permutation(self.n_samples)
            mask = epochs == epoch
            out[mask] = self._order[positions[mask]]
        return out

    def _micro_batch(self, first_global_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self._sample_ids(np.arange(first_global_id, first_global_id + self.micro_batch_size))
        rows = torch.from_numpy(self.file.windows(ids * self.seq_len, self.seq_len + 1))  # (B, T + 1)
        if self.device.type == "cuda":
            rows = rows.pin_memory().to(self.device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's grad_accum_steps micro-batches of the next global batch, each (inputs, targets) of
        shape (micro_batch_size, seq_len)."""
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
