"""The reference's log-probabilities computed once (preference.reference: cache): one sharded forward pass of the
reference over every window of the train and validation files before the first step, each response's summed
log-probability kept in window order, so a step looks up its micro-batch's by the windows its rows are
(MicroBatch.windows) instead of running the reference.

The ranks split the windows (rank r takes r, r + world, ...) and make the same number of passes (a rank out of windows
runs one of window 0 and drops it), each filling its windows' entries of one array, summed over the ranks. How many
responses each window holds comes from the flags alone, so every rank knows where each window's entries go. Rank 0
stores the arrays in train.out_dir/reference_cache with what they were computed from (the reference's record, the
token file's meta); a resume reads them, and refuses a cache made from another reference or other data.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fsdp_trainer.checkpoint.storage import CheckpointError
from fsdp_trainer.data.format import META_SUFFIX, START, TARGET
from fsdp_trainer.data.loader import MicroBatch, micro_batch
from fsdp_trainer.distributed.runtime import DistEnv
from fsdp_trainer.files import write_atomic

logger = logging.getLogger("fsdp_trainer")

CACHE_DIR = "reference_cache"
"""In train.out_dir: the cached log-probabilities of each split (`train.npz`, `val.npz`)."""


def responses_per_window(tokens: Any, seq_len: int, chunk: int = 4096) -> np.ndarray:
    """How many responses (examples with targets) each packed window of a file holds, from its flags."""
    n = len(tokens) // seq_len
    counts = np.zeros(n, dtype=np.int64)
    for first in range(0, n, chunk):
        flags = np.asarray(tokens.flag_windows(np.arange(first, min(n, first + chunk)) * seq_len, seq_len))
        documents = np.cumsum((flags & START) > 0, axis=1)
        keys = np.unique((np.arange(len(flags))[:, None] * (seq_len + 1) + documents)[(flags & TARGET) > 0])
        counts[first : first + len(flags)] = np.bincount(keys // (seq_len + 1), minlength=len(flags))
    return counts


def data_fingerprint(tokens: Any) -> str:
    """What the cache of a token file is valid for: its meta.json, which names its inputs, packing and counts."""
    return hashlib.sha256(Path(f"{tokens.path}{META_SUFFIX}").read_bytes()).hexdigest()


class ReferenceCache:
    """Each response's reference log-probability, window by window: window w's are values[offsets[w]:offsets[w+1]],
    in the order a micro-batch numbers them."""

    def __init__(self, offsets: np.ndarray, values: np.ndarray):
        self.offsets, self.values = offsets, values

    def logps(self, batch: MicroBatch) -> torch.Tensor:
        """The micro-batch's responses' log-probabilities (2 x pairs,), chosen and rejected alternating."""
        parts = [self.values[self.offsets[w] : self.offsets[w + 1]] for w in batch.windows.tolist()]
        return torch.from_numpy(np.concatenate(parts)).to(batch.inputs.device)

    @classmethod
    @torch.no_grad()
    def compute(cls, logps_of, tokens: Any, seq_len: int, micro_batch_size: int, env: DistEnv) -> ReferenceCache:
        """The cache of a token file, `logps_of(batch)` the reference's log-probabilities of a micro-batch's
        responses; every rank calls it and gets the whole."""
        offsets = np.concatenate([[0], np.cumsum(responses_per_window(tokens, seq_len))])
        n = len(offsets) - 1
        values = torch.zeros(int(offsets[-1]), dtype=torch.float32, device=env.device)
        mine = np.arange(env.rank, n, env.world_size)
        most = math.ceil(n / env.world_size)  # the windows of the rank with the most
        passes = math.ceil(most / micro_batch_size)
        for i in range(passes):
            ids = mine[i * micro_batch_size : (i + 1) * micro_batch_size]
            read = ids if len(ids) else np.zeros(1, dtype=np.int64)  # a pass every rank makes: FSDP gathers in it
            rows = np.stack([tokens.windows(read * seq_len, seq_len), tokens.flag_windows(read * seq_len, seq_len)], 1)
            logps = logps_of(micro_batch(rows.astype(np.int64), True, "preference", env.device, read))
            if len(ids):
                where = np.concatenate([np.arange(offsets[w], offsets[w + 1]) for w in ids])
                values[torch.from_numpy(where).to(env.device)] = logps.float()
        if dist.is_initialized():
            dist.all_reduce(values)  # each entry is one rank's, zero on the others
        return cls(offsets, values.cpu().numpy())

    def save(self, path: Path, made_from: dict) -> None:
        buffer = io.BytesIO()
        np.savez(buffer, offsets=self.offsets, values=self.values, made_from=json.dumps(made_from))
        os.makedirs(path.parent, exist_ok=True)
        write_atomic(path, buffer.getvalue())

    @classmethod
    def load(cls, path: Path, made_from: dict) -> ReferenceCache:
        """The cache at `path`; CheckpointError naming what differs if it was made from another reference or data
        (every rank finds it, as a resume's other refusals)."""
        with np.load(path) as saved:
            recorded = json.loads(str(saved["made_from"]))
            differs = [key for key in made_from if recorded.get(key) != made_from[key]]
            if differs:
                raise CheckpointError(
                    f"{path} holds the reference's log-probabilities made with another {' and '.join(differs)} than "
                    "this run's: delete it to compute them again, or resume with what it was made from"
                )
            return cls(saved["offsets"], saved["values"])


def cached_logps(
    logps_of: Callable[[MicroBatch], torch.Tensor], record: bytes, files: dict[str, Any], recipe: Any, env: DistEnv
) -> dict[str, ReferenceCache]:
    """The cache of each split's token file (`files`: None for a split without one), read from train.out_dir or
    computed with `logps_of` (one sharded pass) and stored there; `record` is the reference's start record
    (checkpoint/starts.py), which with the file's meta says what a cache was made from."""
    caches = {}
    for split, tokens in files.items():
        if tokens is None:
            continue
        made_from = {"reference": json.loads(record), "data": data_fingerprint(tokens)}
        path = Path(recipe.train.out_dir) / CACHE_DIR / f"{split}.npz"
        if path.is_file():
            caches[split] = ReferenceCache.load(path, made_from)
            if env.is_main:
                logger.info(f"preference.reference=cache: the reference's log-probabilities read from {path}")
            continue
        data, began = recipe.data, time.perf_counter()
        if env.is_main:
            logger.info(f"preference.reference=cache: one pass of the reference over {tokens.path} first")
        caches[split] = ReferenceCache.compute(logps_of, tokens, data.seq_len, data.micro_batch_size, env)
        if env.is_main:
            caches[split].save(path, made_from)
            logger.info(
                f"preference.reference=cache: the reference's log-probabilities of {split}'s "
                f"{len(caches[split].values):,} answers computed in {time.perf_counter() - began:.1f} s, stored in "
                f"{path}"
            )
    return caches
