"""Token files on disk: the format data preparation writes and the loader reads (numpy only, so preparing data never
imports torch).

A token file is a flat little-endian array of uint16 (vocab_size <= 65536: ids 0-65535) or uint32 ids, with
`<file>.meta.json` beside it giving `dtype`, `n_tokens`, `vocab_size` and the tokenizer's fingerprint
(tokenizer.fingerprint, a sha256). A large corpus is a directory of such files (shards) with a `manifest.json` listing
them in order; it reads as their concatenation.

Fine-tuning data is packed: the file is windows of exactly `packed_seq_len` tokens (its meta says how many), each
holding whole examples and padding, with `<file>.flags` beside it: a byte per token, TARGET where the next token is
trained on (the assistant's, same example) and START where an example (or the padding) begins. Preference data
(meta `preference: true`) is packed the same way, a pair's two conversations side by side in one window, the chosen
one first, each with its START: so the responses that have targets alternate chosen, rejected in every window.
Unpaired preference data (meta `unpaired: true`, KTO's) is packed as fine-tuning examples are, each one prompt and
one completion, with DESIRABLE on the START of each whose completion is labelled good. Preference data whose records
carry TRL's `margin` (meta `margins: true`) has `<file>.margins` beside it: a little-endian float32 per token, each
pair's margin on its chosen conversation's first token, 0 elsewhere. Prompts (meta `prompts: true`, online RL's)
are packed a prompt a window, untrained, the rest of the window padding (room for what is sampled from it), with
`<file>.columns.jsonl` beside it: window k's record (its prompt and every other column) on line k.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from fsdp_trainer.files import write_atomic

_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
META_SUFFIX = ".meta.json"
"""`<file>.meta.json`: what a token file holds (token_meta)."""
FLAGS_SUFFIX = ".flags"
"""`<file>.flags`: a packed file's byte of flags per token."""
MARGINS_SUFFIX = ".margins"
"""`<file>.margins`: a packed file of preference pairs with margins, a float32 per token."""
COLUMNS_SUFFIX = ".columns.jsonl"
"""`<file>.columns.jsonl`: a file of prompts' records, a JSON line per window."""


MANIFEST = "manifest.json"
"""The file that makes a directory of token shards a corpus: the shards in order, their sizes and checksums."""


TARGET, START, DESIRABLE = 1, 2, 4
"""The bits of a packed file's flags."""
RECORD_KINDS = ("preference", "unpaired", "prompts")
"""The packed files whose examples are not plain fine-tuning examples, each marked by its meta key set true."""


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.bin"


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 65536 else "uint32"


def disk_dtype(vocab_size: int) -> np.dtype:
    """The little-endian numpy dtype ids of this vocabulary are stored in."""
    return _DTYPES[token_dtype(vocab_size)]


def token_meta(n_tokens: int, vocab_size: int, tokenizer_sha256: str, **extra) -> dict:
    """A token file's (or a shard directory's) meta: the one place its schema is written."""
    return {
        "dtype": token_dtype(vocab_size),
        "n_tokens": int(n_tokens),
        "vocab_size": vocab_size,
        "tokenizer_sha256": tokenizer_sha256,
        **extra,
    }


def write_meta(path: str | os.PathLike, meta: dict, staged: str = "") -> None:
    """The meta of token file `path`, at its name plus `staged` (a suffix) while staged beside the previous one."""
    write_atomic(f"{path}{META_SUFFIX}{staged}", json.dumps(meta, indent=2))


def write_token_file(
    path: str | os.PathLike, tokens: np.ndarray, vocab_size: int, tokenizer_sha256: str, extra: dict | None = None
) -> None:
    """Write ids and their `.meta.json` (plus `extra` keys); each file appears whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"{path}: token ids must lie in [0, {vocab_size})")
    write_atomic(path, tokens.astype(disk_dtype(vocab_size), copy=False).tobytes())
    write_meta(path, token_meta(tokens.size, vocab_size, tokenizer_sha256, **(extra or {})))


class TokenFile:
    """A memory-mapped token file, checked against its meta.json."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        meta_path = f"{path}{META_SUFFIX}"
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
        if not expected:  # np.memmap cannot map an empty file, and no window can come from one
            raise ValueError(f"token file {self.path} holds no tokens: prepare it again from more data")
        self.tokens = np.memmap(self.path, dtype=_DTYPES[dtype], mode="r")
        self.vocab_size = int(self.meta["vocab_size"])
        self.tokenizer_sha256 = self.meta.get("tokenizer_sha256", "")
        self.packed_seq_len: int | None = self.meta.get("packed_seq_len")
        # preference: pairs (chat.PreferenceEncoder); unpaired: labelled completions (chat.UnpairedEncoder); or None
        self.records: str | None = next((kind for kind in RECORD_KINDS if self.meta.get(kind)), None)
        self.flags = None
        if self.packed_seq_len is not None:
            flags_path = f"{self.path}{FLAGS_SUFFIX}"
            if not os.path.isfile(flags_path) or os.path.getsize(flags_path) != len(self.tokens):
                raise ValueError(f"{flags_path} is missing or not one byte per token: prepare the data again")
            self.flags = np.memmap(flags_path, dtype=np.uint8, mode="r")
        self.margins = None
        if self.meta.get("margins"):
            margins_path = f"{self.path}{MARGINS_SUFFIX}"
            if not os.path.isfile(margins_path) or os.path.getsize(margins_path) != 4 * len(self.tokens):
                raise ValueError(f"{margins_path} is missing or not a float32 per token: prepare the data again")
            self.margins = np.memmap(margins_path, dtype="<f4", mode="r")
        self._columns: list[str] | None = None
        if self.records == "prompts" and not os.path.isfile(f"{self.path}{COLUMNS_SUFFIX}"):
            raise ValueError(f"{self.path}{COLUMNS_SUFFIX} is missing: prepare the data again")

    def columns(self, windows: np.ndarray | list[int]) -> list[dict]:
        """The records of these windows of a file of prompts (read once, then held: a prompt's record is small)."""
        if self._columns is None:
            with open(f"{self.path}{COLUMNS_SUFFIX}", encoding="utf-8") as f:
                self._columns = f.read().splitlines()
            if len(self._columns) != len(self.tokens) // self.packed_seq_len:
                raise ValueError(f"{self.path}{COLUMNS_SUFFIX} is not a line per window: prepare the data again")
        return [json.loads(self._columns[int(k)]) for k in windows]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def fingerprint(self) -> str:
        m = self.meta
        return f"{m['n_tokens']}:{m['dtype']}:{m['vocab_size']}:{m.get('tokenizer_sha256', '')}"

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """tokens[start : start + length] for each start, as int64 rows."""
        return self.tokens[starts[:, None] + np.arange(length)].astype(np.int64)

    def flag_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """flags[start : start + length] for each start, of a packed file."""
        return self.flags[starts[:, None] + np.arange(length)]

    def margin_windows(self, starts: np.ndarray, length: int) -> np.ndarray | None:
        """margins[start : start + length] for each start, of a packed file of pairs with margins; else None."""
        return None if self.margins is None else self.margins[starts[:, None] + np.arange(length)]


def first_record(path: str | os.PathLike) -> dict:
    """The record of a file of prompts' first window, read alone (a check before training needs no more)."""
    with open(f"{path}{COLUMNS_SUFFIX}", encoding="utf-8") as f:
        return json.loads(f.readline())


class TokenShards:
    """A directory of token files with a manifest, read as the concatenation of its shards in manifest order."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        manifest = Path(path) / MANIFEST
        if not manifest.is_file():
            prepared = sorted(p.name for p in Path(path).iterdir() if (p / MANIFEST).is_file() or p.suffix == ".bin")
            if prepared:  # the folder above a prepared corpus: its train/ and val/, or token files
                example = Path(path) / ("train" if "train" in prepared else prepared[0])
                raise FileNotFoundError(
                    f"{self.path} holds no shards of its own but {', '.join(prepared)}: name one of those "
                    f"(e.g. {example})"
                )
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
        self.packed_seq_len = None  # fine-tuning data is one packed file
        self.records = None
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
