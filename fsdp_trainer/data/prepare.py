"""Corpus -> token files, at the paths a recipe's `data` section names (tools/prepare_data.py is its command line).

Inputs are files or globs: `.txt` / `.txt.gz` (one document each), `.jsonl` / `.jsonl.gz` (one document per record,
its `text_key` field), `.json` / `.json.gz` (JSON Lines, as `datasets`' to_json writes, or a JSON array of records,
read whole) and `.parquet` (one document per row, the same column). They are read as a stream, in order,
and tokenized in batches by `workers` processes with at most a few batches in flight, so memory stays bounded
whatever the corpus size; results are taken back in input order, so the bytes written are the same for any number of
workers. Each document is encoded as the model was pretrained (BOS where the tokenizer adds one, EOS last).

The tokenizer is the one at data.tokenizer_path, used as it is; only when nothing exists there is a sentencepiece
tokenizer trained, on a sample of the inputs (their first SAMPLE_CHARS characters), never the whole corpus.

Validation: documents of a single-document file keep the tail split (its last val_fraction of tokens); otherwise
whole documents go to validation, chosen by a hash of their index, deterministically.

Outputs: a path with a suffix (`train.bin`) is one token file, written through a temporary file and renamed; any
other path is a directory of shards of `shard_tokens` tokens (validation: shard_tokens x val_fraction; the last
shard shorter) with a manifest written last; with val_fraction 0 no validation data is written. Each
shard is a token file written atomically whose meta records its sha256 and where in the input stream it ends, so a
preparation killed at any instant and started again verifies the shards already complete, keeps them, and goes on
from where the last one ends. Outputs made from the same inputs, tokenizer and options are kept unless forced.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from glob import glob, has_magic
from itertools import chain, islice
from pathlib import Path

import numpy as np

from fsdp_trainer.data.chat import ChatEncoder, Packer, check_options
from fsdp_trainer.config import Recipe
from fsdp_trainer.files import file_sha256, write_atomic
from fsdp_trainer.tokenizer import load_tokenizer, run_tokenizer_path, train_tokenizer
from fsdp_trainer.data.format import (
    FLAGS_SUFFIX,
    MANIFEST,
    META_SUFFIX,
    TokenFile,
    disk_dtype,
    shard_name,
    token_dtype,
    token_meta,
    write_meta,
    write_token_file,
)

BUNDLED_CORPUS = Path(__file__).parents[1] / "assets" / "shakespeare.txt.gz"
"""The default corpus: 42 plays of Shakespeare (public domain; CC-BY 2.5 Open Knowledge Foundation, see assets/)."""
BUNDLED_CHAT = Path(__file__).parents[1] / "assets" / "shakespeare_chat.jsonl.gz"
"""The default conversations: 2,000 "continue this passage" exchanges cut from the corpus (see assets/)."""

TASK_BYTES = 1 << 20  # text per tokenization task: large enough to amortize the trip to a worker
TASK_DOCS = 1024
SAMPLE_CHARS = 200_000_000  # what a new sentencepiece tokenizer is trained on, at most


@dataclass
class BadRecords:
    skip: bool
    count: int = 0

    def found(self, where: str, what: str) -> None:
        if not self.skip:
            raise ValueError(f"{where}: {what}; fix it or pass --skip_bad_records to skip and count such records")
        self.count += 1


def expand_inputs(patterns: list[str]) -> list[str]:
    """Files and globs -> files, in the order given (each glob sorted); a pattern that matches nothing is an error."""
    files = []
    for pattern in patterns:
        if not has_magic(pattern) and not os.path.isfile(pattern):
            raise ValueError(f"--input file {pattern} does not exist")
        matches = sorted(glob(pattern)) if has_magic(pattern) else [pattern]
        if not matches:
            raise ValueError(f"--input {pattern} matches no file")
        files += matches
    return files


def _kind(path: str) -> str:
    """How a file is read: by records as JSON text ("jsonl": .jsonl, and .json, see _json_records), by rows
    ("parquet"), or whole ("text": anything else)."""
    suffix = path.removesuffix(".gz").rsplit(".", 1)[-1]
    return {"jsonl": "jsonl", "json": "jsonl", "parquet": "parquet"}.get(suffix, "text")


def _json_records(path: str) -> list[bytes] | None:
    """A `.json` file's records as JSON texts when it is a JSON array of records (read whole), None when it is JSON
    Lines (read as a .jsonl); anything else is refused, since reading it as text would train on its syntax."""
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        head = f.read(1 << 16).lstrip()
        if head.startswith(b"{") and (head.find(b"\n") < 0 or _is_json(head[: head.find(b"\n")])):
            return None  # JSON Lines: its first line is a whole record
        if head.startswith((b"[", b"{")):
            f.seek(0)
            try:
                value = json.load(f)
            except ValueError as e:
                raise ValueError(f"{path} is neither JSON Lines nor a JSON array of records: {e}") from None
            if isinstance(value, list) and all(isinstance(r, dict) for r in value):
                return [json.dumps(r).encode() for r in value]
    raise ValueError(
        f"{path}: a .json input is read as JSON Lines (one record per line, as datasets' to_json writes) or a JSON "
        "array of records, and this is neither; rename a plain-text file .txt"
    )


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


def _open_text(path: str):
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def _blocks(path: str, text_key: str | None) -> Iterator[tuple[int, list]]:
    """One input file as (number of its first record, records) blocks of about TASK_BYTES bytes: lines of a .jsonl as
    bytes, undecoded (blank ones included, so record n is line n; a worker decodes them, which saves this process
    decoding, and pickling as text, every byte of the corpus), rows of a parquet column (None where missing; with no
    text_key, whole rows as dicts: conversations), or the whole text of any other file."""
    kind = _kind(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        if text_key is not None and text_key not in table.schema_arrow.names:
            raise ValueError(f"{path}: no column {text_key!r} (it has {table.schema_arrow.names}); pass --text_key")
        row = 1
        for batch in table.iter_batches(columns=None if text_key is None else [text_key], batch_size=TASK_DOCS):
            texts = batch.to_pylist() if text_key is None else batch.column(0).to_pylist()
            yield row, texts
            row += len(texts)
        return
    if kind == "text":
        with _open_text(path) as f:
            yield 1, [f.read()]
        return
    array = _json_records(path) if path.removesuffix(".gz").endswith(".json") else None
    if array is not None:
        for first in range(0, len(array), TASK_DOCS):
            yield first + 1, array[first : first + TASK_DOCS]
        return
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        line, rest = 1, b""
        while block := f.read(TASK_BYTES):
            block = rest + block
            end = block.rfind(b"\n")
            if end < 0:  # a line longer than a block: read on
                rest = block
                continue
            lines, rest = block[:end].split(b"\n"), block[end + 1 :]
            yield line, lines
            line += len(lines)
        if rest:  # the last line, without a newline
            yield line, [rest]


def _where(path: str, kind: str, number: int) -> str:
    if kind == "parquet":
        return f"{path}: row {number}"
    return f"{path}: record {number}" if path.removesuffix(".gz").endswith(".json") else f"{path}:{number}"


def _text_of(record: object, kind: str, text_key: str) -> tuple[str | None, str]:
    """(the record's text, or None and what is wrong with it)."""
    if kind != "jsonl":
        return (record, "") if isinstance(record, str) else (None, f"{text_key!r} is {type(record).__name__}, not text")
    try:
        value = json.loads(record)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
        return None, f"not JSON ({e})"
    text = value.get(text_key) if isinstance(value, dict) else None
    return (text, "") if isinstance(text, str) else (None, f"no text field {text_key!r}")


def read_documents(path: str, text_key: str, bad: BadRecords) -> Iterator[str]:
    """The documents of one input file (see the module docstring); a bad record is named by file and line or row."""
    kind = _kind(path)
    for first, records in _blocks(path, text_key):
        for number, record in enumerate(records, start=first):
            if kind == "jsonl" and not record.strip():
                continue
            text, problem = _text_of(record, kind, text_key)
            if text is None:
                bad.found(_where(path, kind, number), problem)
            else:
                yield text


@dataclass
class Task:
    """A block of records of one file, to be parsed, tokenized and split in a worker."""

    first: int
    """The first record's index in the whole input stream (all files, in order): its document index."""
    path: str
    kind: str
    number: int
    """The first record's line (or row) in its file."""
    records: list


def _tasks(files: list[str], text_key: str | None, start: int) -> Iterator[Task]:
    """The input stream in tasks of about TASK_BYTES bytes, from record `start` on (earlier ones are read and
    dropped: they are in shards kept from an interrupted run)."""
    index = 0
    for path in files:
        kind = _kind(path)
        for number, records in _blocks(path, text_key):
            skip = min(max(start - index, 0), len(records))
            if skip < len(records):
                yield Task(index + skip, path, kind, number + skip, records[skip:])
            index += len(records)


# --- parsing, tokenizing and splitting in worker processes, results in input order ----------------------------------

_worker: dict = {}


def _start_worker(
    tokenizer_path: str, text_key: str | None, val_fraction: float, train_on: str | None, one_thread: bool = True
) -> None:
    if one_thread:  # in a pool the processes are the parallelism; alone, the HF tokenizer may use every core
        os.environ["RAYON_NUM_THREADS"] = "1"
    tokenizer = load_tokenizer(tokenizer_path)
    if one_thread:
        tokenizer.threads = 1
    dtype = disk_dtype(tokenizer.vocab_size)
    chat = ChatEncoder(tokenizer, train_on) if train_on is not None else None
    _worker.update(tokenizer=tokenizer, text_key=text_key, val_fraction=val_fraction, dtype=dtype, chat=chat)


@dataclass
class Part:
    """Documents of a task that go to one output: their indices, token counts and ids, packed."""

    indices: np.ndarray
    lengths: np.ndarray
    ids: np.ndarray
    trained: np.ndarray | None = None
    """Conversations: whether each token is a target of the loss (chat.ChatEncoder)."""


@dataclass
class Result:
    train: Part
    val: Part
    bad: list[tuple[str, str]]
    """(where, what is wrong) of each bad record."""
    documents: int
    chars: int


def _encode_conversations(task: Task) -> tuple[list[np.ndarray], list[np.ndarray], list[int], list]:
    """(ids, trained, index) of each good conversation of a task, and (where, what) of each bad one."""
    ids, trained, indices, bad = [], [], [], []
    for i, record in enumerate(task.records):
        if task.kind == "jsonl" and not record.strip():
            continue
        try:
            example = _worker["chat"].encode(json.loads(record) if task.kind == "jsonl" else record)
        except ValueError as e:  # not JSON (or not UTF-8), or a BadConversation
            bad.append((_where(task.path, task.kind, task.number + i), str(e)))
            continue
        ids.append(example[0])
        trained.append(example[1])
        indices.append(task.first + i)
    return ids, trained, indices, bad


def _process(task: Task) -> Result:
    """A task parsed, tokenized and split between training and validation."""
    w = _worker
    if w["chat"] is not None:
        encoded, trained, indices, bad = _encode_conversations(task)
        lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
        ids = np.concatenate(encoded or [np.zeros(0, np.int64)]).astype(w["dtype"])
        trained = np.concatenate(trained or [np.zeros(0, bool)])
        train, val = _split_documents(np.array(indices, dtype=np.int64), lengths, ids, trained)
        return Result(train, val, bad, len(indices), sum(len(r) for r in task.records if isinstance(r, bytes)))
    texts, indices, bad = [], [], []
    for i, record in enumerate(task.records):
        if task.kind == "jsonl" and not record.strip():
            continue  # a blank line is no record
        text, problem = _text_of(record, task.kind, w["text_key"])
        if text is None:
            bad.append((_where(task.path, task.kind, task.number + i), problem))
        else:
            texts.append(text)
            indices.append(task.first + i)
    encoded = w["tokenizer"].encode_documents(texts)
    lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
    # One pass over all the ids: half the time of an array per document (7.5 vs 14 ms per 1 MB of text).
    ids = np.fromiter(chain.from_iterable(encoded), dtype=w["dtype"], count=int(lengths.sum()))
    indices = np.array(indices, dtype=np.int64)
    if task.kind == "text" and len(indices):  # a file that is one document: its tail is for validation
        cut = int(lengths[0]) - int(lengths[0] * w["val_fraction"])
        train = Part(indices, np.array([cut]), ids[:cut])
        val = Part(indices, lengths - cut, ids[cut:])
    else:
        train, val = _split_documents(indices, lengths, ids)
    return Result(train, val, bad, len(texts), sum(len(t) for t in texts))


def _split_documents(
    indices: np.ndarray, lengths: np.ndarray, ids: np.ndarray, trained: np.ndarray | None = None
) -> tuple[Part, Part]:
    """Whole documents to training or validation (is_validation), their ids (and training mask) with them."""
    to_val = is_validation(indices, _worker["val_fraction"])
    token_to_val = np.repeat(to_val, lengths)

    def part(take: np.ndarray, token_take: np.ndarray) -> Part:
        return Part(indices[take], lengths[take], ids[token_take], None if trained is None else trained[token_take])

    return part(~to_val, ~token_to_val), part(to_val, token_to_val)


def process(
    files: list[str],
    text_key: str | None,
    start: int,
    tokenizer_path: str,
    val_fraction: float,
    workers: int,
    train_on: str | None = None,
) -> Iterator[Result]:
    """_process of every task, in input order. With several workers at most 2 tasks per worker are in flight, so
    the text read ahead and the ids waiting to be written stay bounded."""
    tasks = _tasks(files, text_key, start)
    first = list(islice(tasks, 2))
    if workers == 1 or len(first) < 2:  # one task (a single file, a small corpus): no pool to start
        _start_worker(tokenizer_path, text_key, val_fraction, train_on, one_thread=False)
        yield from map(_process, chain(first, tasks))
        return
    # fork: workers start at once with the modules this process has imported (spawn would import torch again in
    # each). Safe here because this process has not batch-encoded yet, so no tokenizer thread pool exists to be
    # broken by the fork.
    context = multiprocessing.get_context("fork")
    with context.Pool(workers, _start_worker, (tokenizer_path, text_key, val_fraction, train_on)) as pool:
        pending: deque = deque()
        for task in chain(first, tasks):
            pending.append(pool.apply_async(_process, (task,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# --- writers --------------------------------------------------------------------------------------------------------


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
        self.file.write(part.ids.astype(self.dtype).tobytes())
        self.n_tokens += len(part.ids)

    def abandon(self) -> None:
        """After a failure: no half-written file stays behind."""
        self.file.close()
        Path(self.path + ".tmp").unlink(missing_ok=True)

    def finish(self, stamp: dict) -> None:
        self.file.close()
        os.replace(self.path + ".tmp", self.path)
        write_meta(self.path, token_meta(self.n_tokens, self.vocab_size, self.tokenizer_sha256, **self.extra_meta()))
        write_atomic(f"{self.path}.inputs.json", json.dumps(stamp))

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
    (format.py), both streamed to temporary files and renamed when complete."""

    def __init__(self, path: str, vocab_size: int, tokenizer_sha256: str, packer: Packer):
        super().__init__(path, vocab_size, tokenizer_sha256)
        self.packer = packer
        self.flags = open(path + FLAGS_SUFFIX + ".tmp", "wb")

    def add(self, part: Part) -> None:
        ends = np.cumsum(part.lengths)
        for start, end in zip(ends - part.lengths, ends, strict=True):
            for window in self.packer.add(part.ids[start:end].astype(np.int64), part.trained[start:end]):
                self._write(*window)

    def _write(self, tokens: np.ndarray, flags: np.ndarray) -> None:
        self.file.write(tokens.astype(self.dtype).tobytes())
        self.flags.write(flags.tobytes())
        self.n_tokens += len(tokens)

    def abandon(self) -> None:
        super().abandon()
        self.flags.close()
        Path(self.path + FLAGS_SUFFIX + ".tmp").unlink(missing_ok=True)

    def finish(self, stamp: dict) -> None:
        for window in self.packer.finish():
            self._write(*window)
        self.flags.close()
        os.replace(self.path + FLAGS_SUFFIX + ".tmp", self.path + FLAGS_SUFFIX)
        super().finish(stamp)

    def extra_meta(self) -> dict:
        p = self.packer
        return {
            "packed_seq_len": p.seq_len,
            "examples": p.examples,
            "supervised_tokens": p.targets,
            "truncated": p.truncated,
            "dropped": p.dropped,
            "untrained": p.untrained,
        }

    def summary(self) -> str:
        p = self.packer
        fill = p.placed / max(p.windows * p.seq_len, 1)
        return (
            f"{p.examples:,} examples in {p.windows:,} windows of {p.seq_len} ({fill:.1%} filled, {p.targets:,} "
            f"supervised tokens; {p.truncated:,} truncated and {p.dropped:,} dropped as longer than data.seq_len, "
            f"{p.untrained:,} dropped with no answer left within it)"
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


class ShardWriter:
    """A directory of token shards of `shard_tokens` tokens each (the last shorter), written in order, each shard
    atomically, with a manifest last. A shard's meta says where it ends: its last token comes from document `doc`,
    before `offset` in the part of it this writer gets; a restart goes on from there."""

    def __init__(self, out_dir: str, shard_tokens: int, vocab_size: int, tokenizer_sha256: str, stamp: dict):
        self.dir, self.shard_tokens = Path(out_dir), shard_tokens
        self.vocab_size, self.tokenizer_sha256 = vocab_size, tokenizer_sha256
        self.buffer: deque[_Chunk] = deque()
        self.buffered = 0
        self.shards: list[dict] = []
        self.end = (0, 0)  # where the last complete shard ends
        self._resume(stamp)
        self.resume_from = self.end[0]

    def _resume(self, stamp: dict) -> None:
        """Keep the shards a previous, interrupted run with the same stamp completed and that still verify."""
        progress = self.dir / "progress.json"
        if self.dir.is_dir() and (not progress.is_file() or json.loads(progress.read_text()) != stamp):
            ours = ("shard_", MANIFEST, "progress.json")
            strangers = [p.name for p in self.dir.iterdir() if not p.name.startswith(ours)]
            if strangers:
                raise ValueError(
                    f"{self.dir} exists and holds files that are not token shards ({', '.join(sorted(strangers)[:3])});"
                    " choose another data path (a directory of shards, or a file name ending in .bin)"
                )
            shutil.rmtree(self.dir)  # shards made from other inputs or options: start over
        self.dir.mkdir(parents=True, exist_ok=True)
        write_atomic(progress, json.dumps(stamp))
        for index in range(sys.maxsize):
            path = self.dir / shard_name(index)
            try:
                shard = TokenFile(path)
                if file_sha256(path) != shard.meta["sha256"]:
                    break
            except (FileNotFoundError, ValueError, KeyError):
                break
            self.shards.append({"file": path.name, "n_tokens": len(shard), "sha256": shard.meta["sha256"]})
            self.end = tuple(shard.meta["end"])
        for path in self.dir.iterdir():  # whatever comes after the kept shards is redone
            if path.name.startswith("shard_") and path.name.split(".")[0] >= shard_name(len(self.shards))[:-4]:
                path.unlink()

    def add(self, part: Part) -> None:
        offsets = np.zeros(len(part.indices), dtype=np.int64)  # where in its part each document's ids here start
        if len(part.indices) and part.indices[0] <= self.end[0]:  # after a restart: drop what kept shards hold
            part, offsets = self._after(part)
        if len(part.ids):
            self.buffer.append(_Chunk(part, offsets))
            self.buffered += len(part.ids)
        while self.buffered >= self.shard_tokens:
            self._write_shard(self.shard_tokens)

    def _after(self, part: Part) -> tuple[Part, np.ndarray]:
        """The documents' ids from this writer's position on."""
        doc, offset = self.end
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
        """After a failure: the complete shards stay, for a restart to check and keep; nothing else was written."""

    @staticmethod
    def is_done(path: str, stamp: dict) -> bool:
        manifest = Path(path) / MANIFEST
        return manifest.is_file() and json.loads(manifest.read_text()).get("stamp") == stamp


def _writer_kind(path: str):
    return FileWriter if Path(path).suffix else ShardWriter


def is_validation(indices: np.ndarray, val_fraction: float) -> np.ndarray:
    """Which documents (by index in the input stream) of multi-document inputs go to validation: a hash of the index
    (splitmix64), so the choice is the same on every run and spread evenly through the corpus."""
    x = indices.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):  # the multiplications wrap around 2**64 on purpose
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x < np.uint64(val_fraction * 2**64)


# --- the whole preparation ------------------------------------------------------------------------------------------


def prepare(
    recipe: Recipe,
    inputs: list[str],
    val_fraction: float = 0.05,
    vocab_size: int | None = None,
    force: bool = False,
    text_key: str = "text",
    workers: int | None = None,
    shard_tokens: int = 50_000_000,
    skip_bad_records: bool = False,
    format: str = "text",
    train_on: str = "assistant",
    long_examples: str = "truncate",
) -> None:
    """Write data.train_path and data.val_path of the recipe from `inputs` (files or globs), tokenized with the
    tokenizer at data.tokenizer_path (trained there first if there is none). With format="chat", the inputs are
    conversations, written packed into data.seq_len windows (see chat.py)."""
    data = recipe.data
    data.tokenizer_path = run_tokenizer_path(data.tokenizer_path, recipe.checkpoint.resume, recipe.train.out_dir)
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val_fraction={val_fraction} must lie in [0, 1)")
    if shard_tokens < 1:
        raise ValueError(f"--shard_tokens={shard_tokens} must be positive")
    if format not in ("text", "chat"):
        raise ValueError(f"--format={format!r} must be text or chat")
    chat = format == "chat"
    files = expand_inputs(inputs)
    start_time = time.perf_counter()
    if chat:
        _check_chat_inputs(recipe, files, train_on, long_examples)

    if not os.path.exists(data.tokenizer_path):
        vocab_size = vocab_size or recipe.model.vocab_size
        if vocab_size > recipe.model.vocab_size:
            raise ValueError(
                f"--vocab_size={vocab_size} exceeds the recipe's model.vocab_size={recipe.model.vocab_size}"
            )
        with tempfile.TemporaryDirectory() as tmp:  # sentencepiece trains from a plain-text file: a sample
            sample, chars = os.path.join(tmp, "sample.txt"), 0
            texts = (text for path in files for text in read_documents(path, text_key, BadRecords(skip=True)))
            with open(sample, "w", encoding="utf-8") as f:
                for text in texts:  # documents a line apart (one .txt file: exactly its text)
                    f.write(("\n" if chars else "") + text[: SAMPLE_CHARS - chars])
                    chars += len(text) + 1
                    if chars >= SAMPLE_CHARS:
                        break
            train_tokenizer([sample], data.tokenizer_path, vocab_size)
        print(f"{data.tokenizer_path}: trained, vocab {vocab_size}")
    tokenizer = load_tokenizer(data.tokenizer_path)
    recipe.model.check_vocab(f"data.tokenizer_path={data.tokenizer_path} (added tokens included)", tokenizer.vocab_size)
    fingerprint = tokenizer.fingerprint()
    stat = [os.stat(f) for f in files]
    stamp = {
        "inputs": [[f, s.st_size, s.st_mtime_ns] for f, s in zip(files, stat, strict=True)],
        "tokenizer": fingerprint,
        "val_fraction": val_fraction,
        "text_key": text_key,
        "shard_tokens": shard_tokens,
        "skip_bad_records": skip_bad_records,
    }
    if chat:
        stamp.update(format=format, train_on=train_on, long_examples=long_examples, seq_len=data.seq_len)
    outputs = [data.train_path] + ([data.val_path] if data.val_path and val_fraction else [])
    if not force and all(_writer_kind(p).is_done(p, stamp) for p in outputs):
        print(f"data already prepared: {', '.join(outputs)} (pass --force to rebuild)")
        return

    def writer(path: str, tokens_per_shard: int):
        if chat:
            pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0  # never attended to across, never a target
            return PackedWriter(path, tokenizer.vocab_size, fingerprint, Packer(data.seq_len, pad_id, long_examples))
        if _writer_kind(path) is FileWriter:
            return FileWriter(path, tokenizer.vocab_size, fingerprint)
        return ShardWriter(path, tokens_per_shard, tokenizer.vocab_size, fingerprint, stamp)

    train = writer(data.train_path, shard_tokens)
    # Validation shards are smaller in proportion, so both writers complete shards at about the same documents and a
    # restart, which goes on from the older of their positions, loses little.
    val = writer(data.val_path, max(1, round(shard_tokens * val_fraction))) if data.val_path and val_fraction else None
    start = min(w.resume_from for w in (train, val) if w is not None)
    total_bytes = sum(s.st_size for s in stat)
    workers = workers or os.cpu_count() or 1
    bad = BadRecords(skip=skip_bad_records)
    bar = _progress_bar(total_bytes) if sys.stdout.isatty() else None
    writers = [w for w in (train, val) if w is not None]
    n_docs = 0
    try:
        split = val_fraction if val is not None else 0.0  # no validation output: every token is for training
        # Conversations are whole records (no text field) with a training mask.
        key, mask = (None, train_on) if chat else (text_key, None)
        for result in process(files, key, start, data.tokenizer_path, split, workers, mask):
            for where, what in result.bad:
                bad.found(where, what)
            train.add(result.train)
            if val is not None:
                val.add(result.val)
            n_docs += result.documents
            if bar is not None:
                bar.update(result.chars)  # characters, close to bytes for most text
                bar.set_postfix(docs=f"{n_docs:,}", tokens=f"{train.n_tokens:,}", refresh=False)
    except BaseException:
        for w in writers:
            w.abandon()
        raise
    finally:
        if bar is not None:
            bar.close()
    for w in writers:
        w.finish(stamp)
    elapsed = time.perf_counter() - start_time
    n_tokens = sum(w.n_tokens for w in writers)
    counts = f"{train.n_tokens:,} train" + (f" + {val.n_tokens:,} val" if val is not None else "")
    skipped = f", {bad.count:,} bad record(s) skipped" if bad.count else ""
    resumed = f" (resumed at document {start:,})" if start else ""
    for name, w in (("train", train), ("val", val)):
        if isinstance(w, PackedWriter):
            print(f"{name}: {w.summary()}")
    what = "conversations" if chat else "documents"
    print(
        f"prepared {n_docs:,} {what}{resumed}{skipped}: {counts} tokens, {sum(w.files for w in writers)} file(s), "
        f"{n_tokens * np.dtype(token_dtype(tokenizer.vocab_size)).itemsize / 1e6:,.1f} MB written; "
        f"{total_bytes / 1e6:,.1f} MB of input in {elapsed:.1f} s ({total_bytes / 1e6 / max(elapsed, 1e-9):.1f} MB/s, "
        f"{workers} worker(s))"
    )


def _check_chat_inputs(recipe: Recipe, files: list[str], train_on: str, long_examples: str) -> None:
    """Conversations need their model's tokenizer, records (not plain text) and one output file per split."""
    data = recipe.data
    check_options(train_on, long_examples)
    if not os.path.exists(data.tokenizer_path):
        raise ValueError(
            f"data.tokenizer_path={data.tokenizer_path} does not exist: conversations are tokenized with the model's "
            "own tokenizer (import the model, or prepare its pretraining data first)"
        )
    for path in files:
        if _kind(path) == "text":
            raise ValueError(f"--input {path}: conversations come as .jsonl or .parquet records, not plain text")
    for key, path in (("data.train_path", data.train_path), ("data.val_path", data.val_path)):
        if path and not Path(path).suffix:
            raise ValueError(
                f"{key}={path}: packed conversations are written to one file; give it a name ending in .bin"
            )


def _progress_bar(total_bytes: int):
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True, desc="prepare")
