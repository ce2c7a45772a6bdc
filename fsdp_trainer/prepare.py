"""Corpus -> token files, at the paths a recipe's `data` section names (tools/prepare_data.py is its command line).

Inputs are files or globs: `.txt` / `.txt.gz` (one document each), `.jsonl` / `.jsonl.gz` (one document per record,
its `text_key` field) and `.parquet` (one document per row, the same column). They are read as a stream, in order,
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

from fsdp_trainer.config import Recipe
from fsdp_trainer.data import MANIFEST, TokenFile, shard_name, token_dtype, write_token_file
from fsdp_trainer.files import file_sha256, write_atomic
from fsdp_trainer.tokenizer import load_tokenizer, train_tokenizer

TASK_CHARS = 1 << 20  # text per tokenization task: large enough to amortize the trip to a worker
TASK_DOCS = 1024
SAMPLE_CHARS = 200_000_000  # what a new sentencepiece tokenizer is trained on, at most


@dataclass
class Document:
    index: int
    """Position in the whole input stream (all files, in order)."""
    text: str
    whole_file: bool
    """The file's only document (a .txt): its validation part is its tail."""


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


def _open_text(path: str):
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def read_documents(path: str, text_key: str, bad: BadRecords) -> Iterator[str]:
    """The documents of one input file (see the module docstring); a bad record is named by file and line or row."""
    kind = path.removesuffix(".gz").rsplit(".", 1)[-1]
    if kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(path)
        if text_key not in table.schema_arrow.names:
            raise ValueError(f"{path}: no column {text_key!r} (it has {table.schema_arrow.names}); pass --text_key")
        row = 0
        for batch in table.iter_batches(columns=[text_key], batch_size=1024):
            for text in batch.column(0).to_pylist():
                row += 1
                if isinstance(text, str):
                    yield text
                else:
                    bad.found(f"{path}: row {row}", f"{text_key!r} is {type(text).__name__}, not text")
        return
    with _open_text(path) as f:
        if kind != "jsonl":
            yield f.read()
            return
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                bad.found(f"{path}:{line_no}", f"not JSON ({e})")
                continue
            text = record.get(text_key) if isinstance(record, dict) else None
            if isinstance(text, str):
                yield text
            else:
                bad.found(f"{path}:{line_no}", f"no text field {text_key!r}")


def document_stream(files: list[str], text_key: str, bad: BadRecords, start: int = 0) -> Iterator[Document]:
    """Every document of every file, in order, from the `start`-th on (the ones before are read and dropped)."""
    index = 0
    for path in files:
        whole_file = not path.removesuffix(".gz").endswith((".jsonl", ".parquet"))
        for text in read_documents(path, text_key, bad):
            if index >= start:
                yield Document(index, text, whole_file)
            index += 1


# --- tokenizing in worker processes, results in input order --------------------------------------------------------

_worker_tokenizer = None


def _start_worker(tokenizer_path: str, one_thread: bool = True) -> None:
    global _worker_tokenizer
    if one_thread:  # in a pool the processes are the parallelism; alone, the HF tokenizer may use every core
        os.environ["RAYON_NUM_THREADS"] = "1"
    _worker_tokenizer = load_tokenizer(tokenizer_path)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Ids of each text, packed as (all ids, each text's length): cheaper to send back than lists of ints."""
    encoded = _worker_tokenizer.encode_documents(texts)
    lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
    return np.concatenate([np.asarray(ids, dtype=np.uint32) for ids in encoded] or [np.zeros(0, np.uint32)]), lengths


def _tasks(docs: Iterator[Document]) -> Iterator[list[Document]]:
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc.text)
        if chars >= TASK_CHARS or len(batch) >= TASK_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def tokenize(
    docs: Iterator[Document], tokenizer_path: str, workers: int
) -> Iterator[tuple[list[Document], list[np.ndarray]]]:
    """(documents, their ids) a batch at a time, in input order. With several workers at most 2 tasks per worker are
    in flight, so the text read ahead and the ids waiting to be written stay bounded."""

    def unpack(batch: list[Document], result: tuple[np.ndarray, np.ndarray]):
        ids, lengths = result
        return batch, np.split(ids, np.cumsum(lengths)[:-1])

    tasks = _tasks(docs)
    first = list(islice(tasks, 2))
    if workers == 1 or len(first) < 2:  # one task (a single file, a small corpus): no pool to start
        _start_worker(tokenizer_path, one_thread=False)
        for batch in chain(first, tasks):
            yield unpack(batch, _encode([d.text for d in batch]))
        return
    # spawn, not fork: the tokenizers library's thread pool does not survive a fork.
    with multiprocessing.get_context("spawn").Pool(workers, _start_worker, (tokenizer_path,)) as pool:
        pending: deque = deque()
        for batch in chain(first, tasks):
            pending.append((batch, pool.apply_async(_encode, ([d.text for d in batch],))))
            if len(pending) >= 2 * workers:
                batch, result = pending.popleft()
                yield unpack(batch, result.get())
        while pending:
            batch, result = pending.popleft()
            yield unpack(batch, result.get())


# --- writers --------------------------------------------------------------------------------------------------------


class FileWriter:
    """One token file, streamed to a temporary file and renamed when complete (a restart starts it over)."""

    def __init__(self, path: str, vocab_size: int, tokenizer_sha256: str):
        self.path, self.vocab_size, self.tokenizer_sha256 = path, vocab_size, tokenizer_sha256
        self.dtype = np.dtype(token_dtype(vocab_size)).newbyteorder("<")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path + ".tmp", "wb")
        self.n_tokens, self.files = 0, 1
        self.resume_from = 0

    def add(self, doc_index: int, ids: np.ndarray) -> None:
        self.file.write(ids.astype(self.dtype).tobytes())
        self.n_tokens += len(ids)

    def finish(self, stamp: dict) -> None:
        self.file.close()
        os.replace(self.path + ".tmp", self.path)
        meta = {"dtype": self.dtype.name, "n_tokens": self.n_tokens, "vocab_size": self.vocab_size,
                "tokenizer_sha256": self.tokenizer_sha256}  # fmt: skip
        write_atomic(f"{self.path}.meta.json", json.dumps(meta, indent=2))
        write_atomic(f"{self.path}.inputs.json", json.dumps(stamp))

    @staticmethod
    def is_done(path: str, stamp: dict) -> bool:
        stamp_path = Path(f"{path}.inputs.json")
        return (
            Path(path).is_file()
            and Path(f"{path}.meta.json").is_file()
            and stamp_path.is_file()
            and (json.loads(stamp_path.read_text()) == stamp)
        )


class ShardWriter:
    """A directory of token shards of `shard_tokens` tokens each (the last shorter), written in order, each shard
    atomically, with a manifest last. A shard's meta says where it ends: the next token comes from document `doc`
    at `offset` in the part of it this writer gets, which is where a restart goes on from."""

    def __init__(self, out_dir: str, shard_tokens: int, vocab_size: int, tokenizer_sha256: str, stamp: dict):
        self.dir, self.shard_tokens = Path(out_dir), shard_tokens
        self.vocab_size, self.tokenizer_sha256 = vocab_size, tokenizer_sha256
        self.buffer: deque[tuple[int, int, np.ndarray]] = deque()  # (doc, offset of the piece in its part, ids)
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

    def add(self, doc_index: int, ids: np.ndarray) -> None:
        offset = 0
        if doc_index < self.end[0]:
            return  # in a shard already kept
        if doc_index == self.end[0]:
            offset = self.end[1]
            ids = ids[offset:]
        if len(ids):
            self.buffer.append((doc_index, offset, ids))
            self.buffered += len(ids)
        while self.buffered >= self.shard_tokens:
            self._write_shard(self.shard_tokens)

    def _write_shard(self, n_tokens: int) -> None:
        pieces, taken = [], 0
        while taken < n_tokens:
            doc, offset, ids = self.buffer[0]
            take = min(len(ids), n_tokens - taken)
            pieces.append(ids[:take])
            taken += take
            end = (doc, offset + take)
            if take == len(ids):
                self.buffer.popleft()
            else:
                self.buffer[0] = (doc, offset + take, ids[take:])
        self.buffered -= n_tokens
        path = self.dir / shard_name(len(self.shards))
        tokens = np.concatenate(pieces)
        sha = hashlib.sha256(tokens.astype(np.dtype(token_dtype(self.vocab_size)).newbyteorder("<")).tobytes())
        write_token_file(path, tokens, self.vocab_size, self.tokenizer_sha256,
                         {"sha256": sha.hexdigest(), "end": list(end)})  # fmt: skip
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
            "n_tokens": self.n_tokens,
            "dtype": token_dtype(self.vocab_size),
            "vocab_size": self.vocab_size,
            "tokenizer_sha256": self.tokenizer_sha256,
            "stamp": stamp,
        }
        write_atomic(self.dir / MANIFEST, json.dumps(manifest, indent=1))
        (self.dir / "progress.json").unlink()

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
) -> None:
    """Write data.train_path and data.val_path of the recipe from `inputs` (files or globs), tokenized with the
    tokenizer at data.tokenizer_path (trained there first if there is none)."""
    data = recipe.data
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val_fraction={val_fraction} must lie in [0, 1)")
    if shard_tokens < 1:
        raise ValueError(f"--shard_tokens={shard_tokens} must be positive")
    files = expand_inputs(inputs)
    start_time = time.perf_counter()

    if not os.path.exists(data.tokenizer_path):
        vocab_size = vocab_size or recipe.model.vocab_size
        if vocab_size > recipe.model.vocab_size:
            raise ValueError(
                f"--vocab_size={vocab_size} exceeds the recipe's model.vocab_size={recipe.model.vocab_size}"
            )
        with tempfile.TemporaryDirectory() as tmp:  # sentencepiece trains from a plain-text file: a sample
            sample, chars = os.path.join(tmp, "sample.txt"), 0
            with open(sample, "w", encoding="utf-8") as f:
                for doc in document_stream(files, text_key, BadRecords(skip=True)):
                    f.write(doc.text[: SAMPLE_CHARS - chars] + "\n")
                    chars += len(doc.text) + 1
                    if chars >= SAMPLE_CHARS:
                        break
            train_tokenizer([sample], data.tokenizer_path, vocab_size)
        print(f"{data.tokenizer_path}: trained, vocab {vocab_size}")
    tokenizer = load_tokenizer(data.tokenizer_path)
    if tokenizer.vocab_size > recipe.model.vocab_size:
        raise ValueError(
            f"data.tokenizer_path={data.tokenizer_path} has {tokenizer.vocab_size} ids (added tokens included), more "
            f"than model.vocab_size={recipe.model.vocab_size}: the model could not embed them"
        )
    fingerprint = tokenizer.fingerprint()
    stat = [os.stat(f) for f in files]
    stamp = {"inputs": [[f, s.st_size, s.st_mtime_ns] for f, s in zip(files, stat, strict=True)],
             "tokenizer": fingerprint, "val_fraction": val_fraction, "text_key": text_key,
             "shard_tokens": shard_tokens, "skip_bad_records": skip_bad_records}  # fmt: skip
    outputs = [data.train_path] + ([data.val_path] if data.val_path and val_fraction else [])
    if not force and all(_writer_kind(p).is_done(p, stamp) for p in outputs):
        print(f"data already prepared: {', '.join(outputs)} (pass --force to rebuild)")
        return

    def writer(path: str, tokens_per_shard: int):
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
    n_docs = 0
    for docs, doc_ids in tokenize(document_stream(files, text_key, bad, start), data.tokenizer_path, workers):
        to_val = is_validation(np.array([doc.index for doc in docs]), val_fraction)
        for doc, ids, for_val in zip(docs, doc_ids, to_val, strict=True):
            if val is None:
                train.add(doc.index, ids)
            elif doc.whole_file:  # the tail of the file's one document
                cut = len(ids) - int(len(ids) * val_fraction)
                train.add(doc.index, ids[:cut])
                val.add(doc.index, ids[cut:])
            else:
                (val if for_val else train).add(doc.index, ids)
        n_docs += len(docs)
        if bar is not None:
            bar.update(sum(len(doc.text) for doc in docs))  # characters, close to bytes for most text
            bar.set_postfix(docs=f"{n_docs:,}", tokens=f"{train.n_tokens:,}", refresh=False)
    if bar is not None:
        bar.close()
    for w in (train, val):
        if w is not None:
            w.finish(stamp)
    elapsed = time.perf_counter() - start_time
    writers = [w for w in (train, val) if w is not None]
    n_tokens = sum(w.n_tokens for w in writers)
    counts = f"{train.n_tokens:,} train" + (f" + {val.n_tokens:,} val" if val is not None else "")
    skipped = f", {bad.count:,} bad record(s) skipped" if bad.count else ""
    resumed = f" (resumed at document {start:,})" if start else ""
    print(
        f"prepared {n_docs:,} documents{resumed}{skipped}: {counts} tokens, {sum(w.files for w in writers)} file(s), "
        f"{n_tokens * np.dtype(token_dtype(tokenizer.vocab_size)).itemsize / 1e6:,.1f} MB written; "
        f"{total_bytes / 1e6:,.1f} MB of input in {elapsed:.1f} s ({total_bytes / 1e6 / max(elapsed, 1e-9):.1f} MB/s, "
        f"{workers} worker(s))"
    )


def _progress_bar(total_bytes: int):
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True, desc="prepare")
