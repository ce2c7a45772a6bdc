"""Corpus -> token files, at the paths a recipe's `data` section names (tools/prepare_data.py is its command line):
the orchestration of sources.py (input files -> records), encode.py (the worker pool) and writers.py.

Inputs are files or globs, of the formats sources.py reads. They are read as a stream, in order, and tokenized in
batches by `workers` processes with at most a few batches in flight, so memory stays bounded whatever the corpus size;
results are taken back in input order, so the bytes written are the same for any number of workers. Each document is
encoded as the model was pretrained (BOS where the tokenizer adds one, EOS last).

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

import os
import sys
import tempfile
import time
from pathlib import Path

from fsdp_trainer.config import Recipe
from fsdp_trainer.data.chat import RECORDS, Packer, PromptPacker
from fsdp_trainer.data.encode import process
from fsdp_trainer.data.format import disk_dtype
from fsdp_trainer.data.options import PrepareOptions
from fsdp_trainer.data.sources import BadRecords, expand_inputs, kind_of, read_documents
from fsdp_trainer.data.writers import (
    FileWriter,
    PackedWriter,
    ShardWriter,
    finish_replacement,
    replace,
    writer_kind,
)
from fsdp_trainer.files import write_failure
from fsdp_trainer.tokenizer import load_tokenizer, run_tokenizer_path, train_tokenizer

BUNDLED_CORPUS = Path(__file__).parents[1] / "assets" / "shakespeare.txt.gz"
"""The default corpus: 42 plays of Shakespeare (public domain; CC-BY 2.5 Open Knowledge Foundation, see assets/)."""
BUNDLED_CHAT = Path(__file__).parents[1] / "assets" / "shakespeare_chat.jsonl.gz"
"""The default conversations: 2,000 "continue this passage" exchanges cut from the corpus (see assets/)."""
BUNDLED_PREFERENCES = Path(__file__).parents[1] / "assets" / "shakespeare_preferences.jsonl.gz"
"""The default preference pairs: those conversations' last answers (chosen) against their words shuffled (rejected)."""
BUNDLED_UNPAIRED = Path(__file__).parents[1] / "assets" / "shakespeare_unpaired.jsonl.gz"
"""The default unpaired answers: the preference pairs split into a desirable and an undesirable answer, shuffled."""

BUNDLED_PROMPTS = Path(__file__).parents[1] / "assets" / "reverse_prompts.jsonl.gz"
"""The default prompts: 3,000 strings of four digits to reverse, each with its answer (see assets/make_reverse.py)."""

SAMPLE_CHARS = 200_000_000  # what a new sentencepiece tokenizer is trained on, at most


def prepare(recipe: Recipe, options: PrepareOptions) -> None:
    """Write data.train_path and data.val_path of the recipe from the options' inputs, tokenized with the tokenizer at
    data.tokenizer_path (trained there first if there is none). With format chat, the inputs are conversations,
    written packed into data.seq_len windows (see chat.py)."""
    o = options
    data = recipe.data
    data.tokenizer_path = run_tokenizer_path(data.tokenizer_path, recipe.checkpoint.resume, recipe.train.out_dir)
    chat = o.format != "text"
    files = expand_inputs(o.inputs)
    start_time = time.perf_counter()
    if chat:
        _check_chat_inputs(recipe, files)

    if not os.path.exists(data.tokenizer_path):
        _train_tokenizer(recipe, files, o.text_key, o.vocab_size or recipe.model.vocab_size)
    tokenizer = load_tokenizer(data.tokenizer_path)
    recipe.model.check_vocab(f"data.tokenizer_path={data.tokenizer_path} (added tokens included)", tokenizer.vocab_size)
    fingerprint = tokenizer.fingerprint()
    stat = [os.stat(f) for f in files]
    stamp = _stamp(files, stat, fingerprint, o, data.seq_len)
    outputs = [data.train_path] + ([data.val_path] if data.val_path and o.val_fraction else [])
    journal = Path(data.train_path + ".replacing.json")
    finish_replacement(journal)  # a preparation killed while it moved its files in place
    if not o.force and all(writer_kind(p).is_done(p, stamp) for p in outputs):
        print(f"data already prepared: {', '.join(outputs)} (pass --force to rebuild)")
        return

    def writer(path: str, tokens_per_shard: int):
        if chat:
            pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0  # never attended to across, never a target
            packer = (PromptPacker if o.format == "prompts" else Packer)(data.seq_len, pad_id, o.long_examples)
            return PackedWriter(path, tokenizer.vocab_size, fingerprint, packer, o.format)
        if writer_kind(path) is FileWriter:
            return FileWriter(path, tokenizer.vocab_size, fingerprint)
        return ShardWriter(path, tokens_per_shard, tokenizer.vocab_size, fingerprint, stamp)

    train = writer(data.train_path, o.shard_tokens)
    # Validation shards are smaller in proportion, so both writers complete shards at about the same documents and a
    # restart, which goes on from the older of their positions, loses little.
    val_shard = max(1, round(o.shard_tokens * o.val_fraction))
    val = writer(data.val_path, val_shard) if data.val_path and o.val_fraction else None
    start = min(w.resume_from for w in (train, val) if w is not None)
    total_bytes = sum(s.st_size for s in stat)
    workers = o.workers or os.cpu_count() or 1
    bad = BadRecords(skip=o.skip_bad_records)
    results = process(files, start, data.tokenizer_path, o, workers, validation=val is not None)
    writers = [w for w in (train, val) if w is not None]
    what = {"text": "documents", "chat": "conversations"}.get(o.format, RECORDS.get(o.format))
    try:
        n_docs = _write(results, train, val, bad, total_bytes, stamp)
    except OSError as e:  # a full disk or quota: the writers removed what they had half-written
        raise OSError(
            f"{write_failure(e, Path(data.train_path).parent)}; nothing half-written is left and the previous files "
            "are as they were (complete shards are kept): make room and run the same command again"
        ) from e
    _check_windows({"train": train, "val": val}, n_docs, what, files, data.seq_len, o.val_fraction)
    replace(writers, journal)
    elapsed = time.perf_counter() - start_time
    for name, w in (("train", train), ("val", val)):
        if isinstance(w, PackedWriter):
            print(f"{name}: {w.summary()}")
    counts = f"{train.n_tokens:,} train" + (f" + {val.n_tokens:,} val" if val is not None else "")
    skipped = f", {bad.count:,} bad record(s) skipped" if bad.count else ""
    resumed = f" (resumed at document {start:,})" if start else ""
    written = sum(w.n_tokens for w in writers) * disk_dtype(tokenizer.vocab_size).itemsize / 1e6
    print(
        f"prepared {n_docs:,} {what}{resumed}{skipped}: {counts} tokens, "
        f"{sum(w.files for w in writers)} file(s), {written:,.1f} MB written; {total_bytes / 1e6:,.1f} MB of input in "
        f"{elapsed:.1f} s ({total_bytes / 1e6 / max(elapsed, 1e-9):.1f} MB/s, {workers} worker(s))"
    )


def _stamp(files: list[str], stat: list[os.stat_result], fingerprint: str, o: PrepareOptions, seq_len: int) -> dict:
    """What a preparation's outputs are made from: the same stamp again means they are up to date."""
    stamp = {
        "inputs": [[f, s.st_size, s.st_mtime_ns] for f, s in zip(files, stat, strict=True)],
        "tokenizer": fingerprint,
        "val_fraction": o.val_fraction,
        "text_key": o.text_key,
        "shard_tokens": o.shard_tokens,
        "skip_bad_records": o.skip_bad_records,
    }
    if o.format != "text":
        stamp.update(format=o.format, train_on=o.train_on, long_examples=o.long_examples, seq_len=seq_len)
    return stamp


def _check_windows(writers: dict, n_docs: int, what: str, files: list[str], seq_len: int, val_fraction: float) -> None:
    """Refuse a preparation whose inputs hold no record, or that leaves a split without one window of data.seq_len
    (training would find it empty), with the counts and the ways out; what it staged goes."""
    problem = f"--input {' '.join(files)}: no {what} in it" if not n_docs else None
    for name, w in writers.items():
        packed = isinstance(w, PackedWriter)  # whole windows of seq_len; a plain window holds seq_len + 1 tokens
        if problem is None and w is not None and not (w.n_tokens if packed else w.n_tokens - 1) // seq_len:
            held = w.summary() if packed else f"{w.n_tokens:,} tokens"
            problem = (
                f"{name}: {held} from {n_docs:,} {what} make no window of data.seq_len={seq_len}; give more data, "
                f"{'lower' if name == 'train' else 'raise'} --val_fraction (now {val_fraction}) or a shorter "
                "data.seq_len"
            )
    if problem is not None:
        for w in filter(None, writers.values()):
            w.discard()
        raise ValueError(f"{problem}; nothing was written")


def _write(results, train, val, bad: BadRecords, total_bytes: int, stamp: dict) -> int:
    """The workers' results into the writers, in input order, and each writer's set staged; returns the documents
    written. On any failure the writers are abandoned, so nothing half-written stays behind."""
    bar = _progress_bar(total_bytes) if sys.stdout.isatty() else None
    n_docs = 0
    try:
        for result in results:
            for where, what in result.bad:
                bad.found(where, what)
            train.add(result.train)
            if val is not None:
                val.add(result.val)
            n_docs += result.documents
            if bar is not None:
                bar.update(result.chars)  # characters, close to bytes for most text
                bar.set_postfix(docs=f"{n_docs:,}", tokens=f"{train.n_tokens:,}", refresh=False)
        for w in filter(None, (train, val)):
            w.finish(stamp)
    except BaseException:
        for w in (train, val):
            if w is not None:
                w.abandon()
        raise
    finally:
        if bar is not None:
            bar.close()
    return n_docs


def _train_tokenizer(recipe: Recipe, files: list[str], text_key: str, vocab_size: int) -> None:
    """A sentencepiece tokenizer at data.tokenizer_path, trained on the inputs' first SAMPLE_CHARS characters."""
    if vocab_size > recipe.model.vocab_size:
        raise ValueError(f"--vocab_size={vocab_size} exceeds the recipe's model.vocab_size={recipe.model.vocab_size}")
    with tempfile.TemporaryDirectory() as tmp:  # sentencepiece trains from a plain-text file: a sample
        sample, chars = os.path.join(tmp, "sample.txt"), 0
        texts = (text for path in files for text in read_documents(path, text_key, BadRecords(skip=True)))
        with open(sample, "w", encoding="utf-8") as f:
            for text in texts:  # documents a line apart (one .txt file: exactly its text)
                f.write(("\n" if chars else "") + text[: SAMPLE_CHARS - chars])
                chars += len(text) + 1
                if chars >= SAMPLE_CHARS:
                    break
        train_tokenizer([sample], recipe.data.tokenizer_path, vocab_size)
    print(f"{recipe.data.tokenizer_path}: trained, vocab {vocab_size}")


def _check_chat_inputs(recipe: Recipe, files: list[str]) -> None:
    """Conversations need their model's tokenizer, records (not plain text) and one output file per split."""
    data = recipe.data
    if not os.path.exists(data.tokenizer_path):
        raise ValueError(
            f"data.tokenizer_path={data.tokenizer_path} does not exist: conversations are tokenized with the model's "
            "own tokenizer (import the model, or prepare its pretraining data first)"
        )
    for path in files:
        if kind_of(path) == "text":
            raise ValueError(f"--input {path}: conversations come as .jsonl or .parquet records, not plain text")
    for key, path in (("data.train_path", data.train_path), ("data.val_path", data.val_path)):
        if path and not Path(path).suffix:
            raise ValueError(
                f"{key}={path}: packed conversations are written to one file; give it a name ending in .bin"
            )


def _progress_bar(total_bytes: int):
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True, desc="prepare")
