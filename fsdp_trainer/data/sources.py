"""Input files -> records: which formats are read and how, each record named by file and line (or row, or record)
when it is bad. A new input format is a reader here: its kind in kind_of, its records in _blocks.

`.txt` / `.txt.gz`: one document each, read whole. `.jsonl` / `.jsonl.gz`: a record per line, its text field. `.json` /
`.json.gz`: JSON Lines (as `datasets`' to_json writes them) or a JSON array of records, read whole; any other `.json`
is refused. `.parquet`: a row per record, read a row group at a time. Records travel as JSON text (undecoded bytes for
.jsonl, so that a worker decodes them, not this process) or, from parquet, as values.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from glob import glob, has_magic

TASK_BYTES = 1 << 20  # text per tokenization task: large enough to amortize the trip to a worker
TASK_DOCS = 1024


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


def kind_of(path: str) -> str:
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
    kind = kind_of(path)
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


def where(path: str, kind: str, number: int) -> str:
    if kind == "parquet":
        return f"{path}: row {number}"
    return f"{path}: record {number}" if path.removesuffix(".gz").endswith(".json") else f"{path}:{number}"


def text_of(record: object, kind: str, text_key: str) -> tuple[str | None, str]:
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
    kind = kind_of(path)
    for first, records in _blocks(path, text_key):
        for number, record in enumerate(records, start=first):
            if kind == "jsonl" and not record.strip():
                continue
            text, problem = text_of(record, kind, text_key)
            if text is None:
                bad.found(where(path, kind, number), problem)
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


def tasks(files: list[str], text_key: str | None, start: int) -> Iterator[Task]:
    """The input stream in tasks of about TASK_BYTES bytes, from record `start` on (earlier ones are read and
    dropped: they are in shards kept from an interrupted run)."""
    index = 0
    for path in files:
        kind = kind_of(path)
        for number, records in _blocks(path, text_key):
            skip = min(max(start - index, 0), len(records))
            if skip < len(records):
                yield Task(index + skip, path, kind, number + skip, records[skip:])
            index += len(records)
