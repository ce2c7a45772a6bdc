"""The writers of data preparation: a token file, a packed file of conversations with its flags, or a directory of
shards with a manifest (the format is format.py's).

Each writer stages its files beside the ones it replaces (`train.bin.tmp`, `train.bin.meta.json.tmp`, ...; a directory
of shards as `train.tmp/`) and touches no file of the previous preparation. Once every writer of a preparation has
staged a complete set, replace() moves them all in place under a journal, so that the previous set is replaced whole
or not at all: a failure before (a bad record, a full disk, Ctrl-C, SIGKILL) leaves it byte-identical, and a kill
during the moves is finished by the next preparation. A directory of shards killed mid-way keeps its complete staged
shards, and the same preparation started again goes on from where the last one ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections import deque
from pathlib import Path

import numpy as np

from fsdp_trainer.data.chat import RECORDS, Packer, PromptPacker, Window
from fsdp_trainer.data.encode import Part
from fsdp_trainer.data.format import (
    COLUMNS_SUFFIX,
    FLAGS_SUFFIX,
    MANIFEST,
    MARGINS_SUFFIX,
    META_SUFFIX,
    TokenFile,
    disk_dtype,
    shard_name,
    token_meta,
    write_meta,
    write_token_file,
)
from fsdp_trainer.files import file_sha256, write_atomic


class FileWriter:
    """One token file, streamed to a temporary file and renamed when complete (a restart starts it over)."""

    def __init__(self, path: str, vocab_size: int, tokenizer_sha256: str):
        self.path, self.vocab_size, self.tokenizer_sha256 = path, vocab_size, tokenizer_sha256
        self.dtype = disk_dtype(vocab_size)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path + ".tmp", "wb")
        self.n_tokens, self.files = 0, 1
        self.resume_from = 0

    def add(self, part: Part) -> None:
        try:
            self.file.write(part.ids.astype(self.dtype).tobytes())
        except OSError as e:  # a full disk: say which file
            e.filename = e.filename or self.file.name
            raise
        self.n_tokens += len(part.ids)

    def abandon(self) -> None:
        """After a failure: nothing staged stays behind; the previous preparation's files were never touched."""
        try:
            self.file.close()
        except OSError:
            pass  # flushing the rest failed too: the file goes anyway
        for staged, _ in self.staged():
            if staged is not None:
                Path(staged).unlink(missing_ok=True)

    def discard(self) -> None:
        """A complete set that prepare() refuses goes as a failed one does."""
        self.abandon()

    def finish(self, stamp: dict) -> None:
        """Stage the file, its meta, and the inputs' stamp that says it is complete; on a failure, none of them."""
        try:
            self._finish(stamp)
        except BaseException:
            self.abandon()
            raise

    def _finish(self, stamp: dict) -> None:
        self.file.close()
        meta = token_meta(self.n_tokens, self.vocab_size, self.tokenizer_sha256, **self.extra_meta())
        write_meta(self.path, meta, staged=".tmp")
        write_atomic(f"{self.path}.inputs.json.tmp", json.dumps(stamp))

    def staged(self) -> list[tuple[str | None, str]]:
        """(staged, final) for each file of the set, the stamp that says it is complete last; (None, final) for a file
        of the previous set that the new one has none of, to be removed."""
        return [(f"{self.path}{suffix}.tmp", f"{self.path}{suffix}") for suffix in ("", META_SUFFIX, ".inputs.json")]

    def extra_meta(self) -> dict:
        return {}

    @staticmethod
    def is_done(path: str, stamp: dict) -> bool:
        stamp_path = Path(f"{path}.inputs.json")
        return (
            Path(path).is_file()
            and Path(f"{path}{META_SUFFIX}").is_file()
            and stamp_path.is_file()
            and (json.loads(stamp_path.read_text()) == stamp)
        )


class PackedWriter(FileWriter):
    """Conversations packed into windows by a chat.Packer: one token file of whole windows and its flags file
    (format.py), and, once a pair with a margin comes, its margins file, each streamed to a temporary file and renamed
    when complete."""

    def __init__(self, path: str, vocab_size: int, tokenizer_sha256: str, packer: Packer, records: str = "chat"):
        super().__init__(path, vocab_size, tokenizer_sha256)
        self.packer, self.records = packer, records  # chat, preference or unpaired (chat.ENCODERS)
        self.flags = open(path + FLAGS_SUFFIX + ".tmp", "wb")
        self.margins = None  # opened at the first window with a margin, the windows before it given zeros
        prompts = isinstance(packer, PromptPacker)  # their records go beside them
        self.columns = open(path + COLUMNS_SUFFIX + ".tmp", "w", encoding="utf-8") if prompts else None

    def add(self, part: Part) -> None:
        ends = np.cumsum(part.lengths)
        for k, (start, end) in enumerate(zip(ends - part.lengths, ends, strict=True)):
            margin = 0.0 if part.margins is None else float(part.margins[k])
            for window in self.packer.add(part.ids[start:end].astype(np.int64), part.trained[start:end], margin):
                self._write(window)
                if self.columns is not None:  # a prompt closes its own window at once: this one is the k-th's
                    self.columns.write(part.columns[k] + "\n")

    def _write(self, window: Window) -> None:
        self.file.write(window.tokens.astype(self.dtype).tobytes())
        self.flags.write(window.flags.tobytes())
        if self.margins is None and window.margins.any():
            self.margins = open(self.path + MARGINS_SUFFIX + ".tmp", "wb")
            self.margins.write(np.zeros(self.n_tokens, np.float32).tobytes())
        if self.margins is not None:
            self.margins.write(window.margins.astype("<f4").tobytes())
        self.n_tokens += len(window.tokens)

    def abandon(self) -> None:
        for file in filter(None, (self.flags, self.margins, self.columns)):
            try:
                file.close()
            except OSError:
                pass
        super().abandon()

    def _finish(self, stamp: dict) -> None:
        for window in self.packer.finish():
            self._write(window)
        self.flags.close()
        for file in filter(None, (self.margins, self.columns)):
            file.close()
        super()._finish(stamp)

    def staged(self) -> list[tuple[str | None, str]]:
        """The flags, and the margins where a pair had one (else an earlier preparation's go), before the token file's
        set."""
        flags, margins = self.path + FLAGS_SUFFIX, self.path + MARGINS_SUFFIX
        margins_staged = margins + ".tmp" if self.margins is not None else None
        columns = self.path + COLUMNS_SUFFIX
        columns_staged = columns + ".tmp" if self.columns is not None else None
        return [(flags + ".tmp", flags), (margins_staged, margins), (columns_staged, columns), *super().staged()]

    def extra_meta(self) -> dict:
        p = self.packer
        return {
            "packed_seq_len": p.seq_len,
            "examples": p.examples,
            "supervised_tokens": p.targets,
            "truncated": p.truncated,
            "dropped": p.dropped,
            "untrained": p.untrained,
            **({self.records: True} if self.records != "chat" else {}),  # format.py: preference, unpaired
            **({"margins": True} if self.margins is not None else {}),
        }

    def summary(self) -> str:
        return packed_summary(self.packer, self.records)


def packed_summary(p: Packer, records: str) -> str:
    """What a packer made of its examples, in a line: how many, how full the windows are, what it dropped."""
    fill = p.placed / max(p.windows * p.seq_len, 1)
    if records == "prompts":
        return (
            f"{p.examples:,} prompts, a window of {p.seq_len} each ({fill:.1%} of them the prompts, the rest room for "
            f"their completions); {p.dropped:,} dropped as leaving no room in data.seq_len"
        )
    return (
        f"{p.examples:,} {RECORDS[records]} in {p.windows:,} windows of {p.seq_len} ({fill:.1%} filled, "
        f"{p.targets:,} supervised tokens; {p.truncated:,} truncated and {p.dropped:,} dropped as longer than "
        f"data.seq_len, {p.untrained:,} dropped with no answer left within it)"
    )


class _Chunk:
    """A batch of documents' ids waiting in a ShardWriter, `pos` of them already in shards."""

    def __init__(self, part: Part, offsets: np.ndarray):
        self.part, self.offsets, self.pos = part, offsets, 0
        self.starts = np.cumsum(part.lengths) - part.lengths

    def position(self, pos: int) -> tuple[int, int]:
        """(document, offset in its part) of the token after the first `pos` of this chunk."""
        k = int(np.searchsorted(self.starts, pos - 1, side="right")) - 1  # the document holding token pos - 1
        return int(self.part.indices[k]), int(self.offsets[k] + pos - self.starts[k])


def check_shard_dir(shard_dir: Path) -> None:
    """Refuse a directory that holds anything but a preparation's shards: replacing it would lose the user's files."""
    ours = ("shard_", MANIFEST, "progress.json")
    strangers = [p.name for p in shard_dir.iterdir() if not p.name.startswith(ours)] if shard_dir.is_dir() else []
    if strangers:
        raise ValueError(
            f"{shard_dir} exists and holds files that are not token shards ({', '.join(sorted(strangers)[:3])}); "
            "choose another data path (a directory of shards, or a file name ending in .bin)"
        )


def kept_shards(shard_dir: Path, stamp: dict) -> tuple[list[dict], tuple[int, int]]:
    """The shards a previous, interrupted run with the same `stamp` completed in staging directory `shard_dir` and that
    still verify, and where the last of them ends ((0, 0) for none); everything else in it is removed."""
    progress = shard_dir / "progress.json"
    if shard_dir.is_dir() and (not progress.is_file() or json.loads(progress.read_text()) != stamp):
        check_shard_dir(shard_dir)
        shutil.rmtree(shard_dir)  # shards made from other inputs or options: start over
    shard_dir.mkdir(parents=True, exist_ok=True)
    shards, end = [], (0, 0)
    write_atomic(progress, json.dumps(stamp))
    for index in range(sys.maxsize):
        path = shard_dir / shard_name(index)
        try:
            shard = TokenFile(path)
            if file_sha256(path) != shard.meta["sha256"]:
                break
        except (FileNotFoundError, ValueError, KeyError):
            break
        shards.append({"file": path.name, "n_tokens": len(shard), "sha256": shard.meta["sha256"]})
        end = tuple(shard.meta["end"])
    for path in shard_dir.iterdir():  # whatever comes after the kept shards is redone
        if path.name.startswith("shard_") and path.name.split(".")[0] >= shard_name(len(shards))[:-4]:
            path.unlink()
    return shards, end


def after(part: Part, end: tuple[int, int]) -> tuple[Part, np.ndarray]:
    """The documents' ids of `part` from `end` on ((document, offset in its part): where kept shards end), and
    where in its part each kept document's ids start."""
    doc, offset = end
    indices, lengths, pieces, offsets, start = [], [], [], [], 0
    for index, length in zip(part.indices.tolist(), part.lengths.tolist(), strict=True):
        drop = length if index < doc else min(offset, length) if index == doc else 0
        if length > drop:
            indices.append(index)
            lengths.append(length - drop)
            pieces.append(part.ids[start + drop : start + length])
            offsets.append(drop)
        start += length
    kept = Part(np.array(indices, np.int64), np.array(lengths, np.int64), np.concatenate(pieces or [part.ids[:0]]))
    return kept, np.array(offsets, np.int64)


class ShardWriter:
    """A directory of token shards of `shard_tokens` tokens each (the last shorter), written in order, each shard
    atomically, with a manifest last. A shard's meta says where it ends: its last token comes from document `doc`,
    before `offset` in the part of it this writer gets; a restart goes on from there."""

    def __init__(self, out_dir: str, shard_tokens: int, vocab_size: int, tokenizer_sha256: str, stamp: dict):
        check_shard_dir(Path(out_dir))
        self.final, self.dir, self.shard_tokens = Path(out_dir), Path(out_dir + ".tmp"), shard_tokens  # dir: staged
        self.vocab_size, self.tokenizer_sha256 = vocab_size, tokenizer_sha256
        self.buffer: deque[_Chunk] = deque()
        self.buffered = 0
        # the shards a previous, interrupted run completed, and where the last of them ends
        self.shards, self.end = kept_shards(self.dir, stamp)
        self.resume_from = self.end[0]

    def add(self, part: Part) -> None:
        offsets = np.zeros(len(part.indices), dtype=np.int64)  # where in its part each document's ids here start
        if len(part.indices) and part.indices[0] <= self.end[0]:  # after a restart: drop what kept shards hold
            part, offsets = after(part, self.end)
        if len(part.ids):
            self.buffer.append(_Chunk(part, offsets))
            self.buffered += len(part.ids)
        while self.buffered >= self.shard_tokens:
            self._write_shard(self.shard_tokens)

    def _write_shard(self, n_tokens: int) -> None:
        pieces, taken = [], 0
        while taken < n_tokens:
            chunk = self.buffer[0]
            take = min(len(chunk.part.ids) - chunk.pos, n_tokens - taken)
            pieces.append(chunk.part.ids[chunk.pos : chunk.pos + take])
            chunk.pos += take
            taken += take
            end = chunk.position(chunk.pos)
            if chunk.pos == len(chunk.part.ids):
                self.buffer.popleft()
        self.buffered -= n_tokens
        path = self.dir / shard_name(len(self.shards))
        tokens = np.concatenate(pieces)
        sha = hashlib.sha256(tokens.astype(disk_dtype(self.vocab_size), copy=False))
        write_token_file(
            path, tokens, self.vocab_size, self.tokenizer_sha256, {"sha256": sha.hexdigest(), "end": list(end)}
        )
        self.shards.append({"file": path.name, "n_tokens": n_tokens, "sha256": sha.hexdigest()})
        self.end = end

    @property
    def n_tokens(self) -> int:
        return sum(shard["n_tokens"] for shard in self.shards) + self.buffered

    @property
    def files(self) -> int:
        return len(self.shards)

    def finish(self, stamp: dict) -> None:
        if self.buffered:
            self._write_shard(self.buffered)
        manifest = {
            "shards": self.shards,
            **token_meta(self.n_tokens, self.vocab_size, self.tokenizer_sha256),
            "stamp": stamp,
        }
        write_atomic(self.dir / MANIFEST, json.dumps(manifest, indent=1))
        (self.dir / "progress.json").unlink()

    def abandon(self) -> None:
        """After a failure: the complete staged shards stay, for a restart to check and keep."""

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def staged(self) -> list[tuple[str, str]]:
        return [(str(self.dir), str(self.final))]

    @staticmethod
    def is_done(path: str, stamp: dict) -> bool:
        manifest = Path(path) / MANIFEST
        return manifest.is_file() and json.loads(manifest.read_text()).get("stamp") == stamp


def replace(writers: list, journal: Path) -> None:
    """Move the staged sets of `writers` (each finished) in place of the previous preparation's files, all or none:
    the moves are listed in `journal` first, so that a kill among them is finished by finish_replacement."""
    write_atomic(journal, json.dumps({"moves": [pair for w in writers for pair in w.staged()]}), sync=True)
    finish_replacement(journal)


def finish_replacement(journal: Path) -> None:
    """Carry out the moves a replacement's journal lists (those done already are passed over), then drop it; nothing
    to do where there is no journal."""
    if not journal.is_file():
        return
    for staged, final in json.loads(journal.read_text())["moves"]:
        final = Path(final)
        if staged is None:  # a file the new set has none of
            final.unlink(missing_ok=True)
            continue
        staged, old = Path(staged), final.with_name(final.name + ".old")
        if staged.is_dir():  # a directory of shards: the old one aside, the new one in, the old one gone
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
            staged.rename(final)
        elif staged.exists():
            os.replace(staged, final)
        if final.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    journal.unlink()


def writer_kind(path: str):
    return FileWriter if Path(path).suffix else ShardWriter
