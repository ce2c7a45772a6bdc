"""tools/prepare_data.py: what it writes, that it skips up-to-date outputs, and its errors."""

from __future__ import annotations

import gzip
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from fsdp_trainer.data.format import TokenFile, open_tokens
from fsdp_trainer.data.prepare import BUNDLED_CORPUS
from fsdp_trainer.tokenizer import load_tokenizer
from tests.helpers import REPO, forked, tool


def test_outputs_decode_to_the_input(tiny_data):
    recipe = json.loads(tiny_data.read_text())["data"]
    train, val = TokenFile(recipe["train_path"]), TokenFile(recipe["val_path"])
    tokenizer = load_tokenizer(recipe["tokenizer_path"])
    assert train.vocab_size == tokenizer.vocab_size == 512 and train.meta["dtype"] == "uint16"
    assert train.tokenizer_sha256 == val.tokenizer_sha256 == tokenizer.fingerprint()
    assert 0.08 < len(val) / (len(train) + len(val)) < 0.12  # --val_fraction 0.1
    text = (tiny_data.parent / "corpus.txt").read_text()
    ids = np.concatenate([train.tokens, val.tokens]).tolist()
    assert ids[-1] == tokenizer.eos_id and tokenizer.decode(ids[:-1]) == text  # lossless, newlines included


def test_up_to_date_outputs_are_kept(tiny_data):
    proc = tool(
        "prepare_data.py", "--recipe", tiny_data, "--input", tiny_data.parent / "corpus.txt", "--val_fraction", "0.1"
    )
    assert "already prepared" in proc.stdout


def test_missing_input_is_one_error_line(tiny_data, tmp_path):
    proc = tool("prepare_data.py", "--recipe", tiny_data, "--input", tmp_path / "nope.txt", check=False)
    assert proc.returncode == 1 and proc.stderr.strip() == f"error: --input file {tmp_path / 'nope.txt'} does not exist"


def test_the_recipe_is_read_as_the_trainer_reads_it(tiny_data, tmp_path):
    """Any key can be overridden on the command line, and `lr: 3e-4` (a string to PyYAML) is a float here too."""
    sections = json.loads(tiny_data.read_text())
    del sections["optim"]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(sections) + "optim:\n  lr: 3e-4\n  min_lr: 3e-5\n")
    out = tmp_path / "other"
    overrides = [
        "--data.train_path",
        out / "train.bin",
        "--data.val_path",
        "null",
        "--data.tokenizer_path",
        out / "tok.model",
        "--vocab_size",
        "400",
    ]
    tool("prepare_data.py", "--recipe", recipe, "--input", tiny_data.parent / "corpus.txt", *overrides)
    assert TokenFile(out / "train.bin").vocab_size == load_tokenizer(out / "tok.model").vocab_size == 400
    assert not (out / "val.bin").exists()


# --- corpora: formats, globs, workers, shards, restarts, bad records -------------------------------------------------


def _tiny_tokenizer(tiny_data) -> str:
    return json.loads(tiny_data.read_text())["data"]["tokenizer_path"]


def _tool_args(tiny_data, out, inputs, *flags) -> list[str]:
    """prepare_data.py's arguments with the tiny tokenizer, outputs under `out` (a directory of shards unless flags
    say)."""
    paths = ["--data.train_path", out / "train", "--data.val_path", out / "val"]
    tokenizer = ["--data.tokenizer_path", _tiny_tokenizer(tiny_data)]
    return list(map(str, ["--recipe", tiny_data, *tokenizer, *paths, "--input", *inputs, *flags]))


def _run_tool(tiny_data, out, inputs, *flags, check=True):
    """prepare_data.py with `_tool_args`."""
    return tool("prepare_data.py", *_tool_args(tiny_data, out, inputs, *flags), check=check)


@pytest.fixture(scope="module")
def plays_jsonl(tmp_path_factory) -> Path:
    """The bundled corpus as 5.6 MB of jsonl, a record per paragraph: several tasks for the workers."""
    path = tmp_path_factory.mktemp("corpus") / "plays.jsonl"
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        paragraphs = [p for p in f.read().split("\n\n") if p.strip()]
    path.write_text("".join(json.dumps({"text": p, "id": i}) + "\n" for i, p in enumerate(paragraphs)))
    return path


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_every_input_format_and_glob_gives_the_ids_of_direct_encoding(tiny_data, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        text = f.read(60_000)
    parts = [p for p in text.split("\n\n") if p.strip()]
    long = "\n\n".join(parts) * 25  # a record longer than the blocks the input is read in (1 MiB)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(text[:5000])
    with gzip.open(tmp_path / "in" / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"body": p}) + "\n" for p in parts[:40])
        f.write(json.dumps({"body": long}))  # the last line without a newline
    pq.write_table(pa.table({"body": parts[40:80]}), tmp_path / "in" / "c.parquet", row_group_size=7)
    # .json: JSON Lines, as datasets' to_json writes it, or a JSON array of records.
    (tmp_path / "in" / "d.json").write_text("".join(json.dumps({"body": p}) + "\n" for p in parts[80:90]))
    (tmp_path / "in" / "e.json").write_text(json.dumps([{"body": p} for p in parts[90:100]], indent=2))
    out = tmp_path / "out"
    _run_tool(
        tiny_data,
        out,
        [tmp_path / "in" / "*.txt", tmp_path / "in" / "*.[jp]*"],
        "--text_key",
        "body",
        "--data.val_path",
        "null",
    )  # no validation output: every token goes to training
    tokenizer = load_tokenizer(_tiny_tokenizer(tiny_data))
    documents = [text[:5000], *parts[:40], long, *parts[40:100]]  # a.txt, then the glob in sorted order: b, c, d, e
    expected = [i for doc in documents for i in tokenizer.encode_document(doc)]
    assert list(open_tokens(out / "train").windows(np.array([0]), len(expected))[0]) == expected
    assert len(open_tokens(out / "train")) == len(expected)


def test_the_bytes_written_do_not_depend_on_the_workers(tiny_data, tmp_path, plays_jsonl):
    outputs = {}
    for workers in (1, 2):
        proc = _run_tool(
            tiny_data, tmp_path / str(workers), [plays_jsonl], "--workers", workers, "--shard_tokens", 200_000
        )
        assert f"{workers} worker(s)" in proc.stdout
        outputs[workers] = _tree_bytes(tmp_path / str(workers))
    assert len([name for name in outputs[1] if name.endswith(".bin")]) > 6  # several shards of train and val
    assert outputs[1] == outputs[2]
    manifest = json.loads(outputs[1]["train/manifest.json"])
    shards = open_tokens(tmp_path / "1" / "train")
    assert len(shards) == manifest["n_tokens"] == sum(s["n_tokens"] for s in manifest["shards"])
    val = open_tokens(tmp_path / "1" / "val")
    assert 0.03 < len(val) / (len(val) + len(shards)) < 0.08  # whole documents, about 5%


def test_a_killed_preparation_keeps_the_previous_one_and_restarts_from_its_complete_shards(
    tiny_data, tmp_path, plays_jsonl
):
    flags = ["--workers", "1", "--shard_tokens", 40_000]
    _run_tool(tiny_data, tmp_path / "whole", [plays_jsonl], *flags)
    _run_tool(tiny_data, tmp_path / "cut", [tiny_data.parent / "corpus.txt"], *flags)  # a previous preparation
    previous = _tree_bytes(tmp_path / "cut")
    argv = _tool_args(tiny_data, tmp_path / "cut", [plays_jsonl], *flags)
    proc = forked.start(str(REPO / "tools" / "prepare_data.py"), argv, [(os.devnull, os.devnull)])
    # Until both writers have complete shards past the one spoiled below: the restart goes on from the writer that is
    # behind, and the validation writer gets a task's documents only after the training writer has written its 11
    # shards of them. Waited for however long a loaded machine takes (no deadline: a clock would decide the verdict).
    done = [tmp_path / "cut" / f"{split}.tmp" / "shard_00004.bin.meta.json" for split in ("train", "val")]
    while not all(p.exists() for p in done) and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "cut" / "train.tmp" / "manifest.json").exists(), "finished before it could be killed"
    staged = {name for name in _tree_bytes(tmp_path / "cut") if name.split("/")[0].endswith(".tmp")}
    assert {k: v for k, v in _tree_bytes(tmp_path / "cut").items() if k not in staged} == previous
    (tmp_path / "cut" / "train.tmp" / "shard_00002.bin").write_bytes(b"\0" * 16)  # a complete shard gone bad: redone
    again = _run_tool(tiny_data, tmp_path / "cut", [plays_jsonl], *flags)
    assert "resumed at document" in again.stdout
    assert _tree_bytes(tmp_path / "cut") == _tree_bytes(tmp_path / "whole")


def test_bad_records_are_named_or_skipped_and_counted(tiny_data, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = json.dumps({"text": "To be, or not to be"})
    (tmp_path / "a.jsonl").write_text(f"{good}\n{{not json\n{good}\n")
    (tmp_path / "b.jsonl").write_text(f'{good}\n{{"title": "no text here"}}\n')
    pq.write_table(pa.table({"text": ["a line", None, "another"]}), tmp_path / "c.parquet")
    (tmp_path / "d.jsonl").write_bytes(f"{good}\n".encode() + b'{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8
    (tmp_path / "e.json").write_text(json.dumps([json.loads(good), {"title": "no text"}]))
    (tmp_path / "f.json").write_text(json.dumps({"text": "one object"}, indent=2))  # not records
    (tmp_path / "g.json").write_text("plain text, misnamed")
    cases = [
        (tmp_path / "a.jsonl", "a.jsonl:2: not JSON"),
        (tmp_path / "b.jsonl", "b.jsonl:2: no text field"),
        (tmp_path / "c.parquet", "c.parquet: row 2: 'text' is NoneType"),
        (tmp_path / "d.jsonl", "d.jsonl:2: not JSON ('utf-8' codec can't decode byte 0xe9"),
        (tmp_path / "e.json", "e.json: record 2: no text field"),
    ]
    for path, where in cases:
        proc = _run_tool(tiny_data, tmp_path / "out", [path], check=False)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and where in proc.stderr, proc.stderr
        assert "--skip_bad_records" in proc.stderr and not (tmp_path / "out" / "train" / "manifest.json").exists()
    for name in ("f.json", "g.json"):  # a .json that holds no records is refused whole, not read as text
        proc = _run_tool(tiny_data, tmp_path / "out", [tmp_path / name], check=False)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"{name}: a .json input is read as JSON Lines (one record per line" in proc.stderr
    one_file = _run_tool(
        tiny_data,
        tmp_path / "one",
        [tmp_path / "a.jsonl"],
        "--data.train_path",
        tmp_path / "t.bin",
        "--data.val_path",
        "null",
        check=False,
    )
    assert one_file.returncode == 1 and not list(tmp_path.glob("t.bin*"))  # nothing half-written stays
    inputs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.parquet", tmp_path / "d.jsonl"]
    proc = _run_tool(tiny_data, tmp_path / "out", inputs, "--skip_bad_records", "true", "--val_fraction", "0")
    assert "prepared 6 documents, 4 bad record(s) skipped" in proc.stdout, proc.stdout
    missing = _run_tool(tiny_data, tmp_path / "out", [tmp_path / "c.parquet"], "--text_key", "body", check=False)
    assert missing.returncode == 1 and "c.parquet: no column 'body'" in missing.stderr


def test_a_preparation_stopped_while_moving_its_files_in_is_finished_by_the_next(tmp_path, monkeypatch):
    """The staged set moves in under a journal: stopped after its first move, the next preparation finishes the moves
    (a file, its stale margins removed, a directory of shards swapped whole) before it looks at anything."""
    import fsdp_trainer.data.writers as writers

    (tmp_path / "train.bin").write_bytes(b"old")
    (tmp_path / "train.bin.margins").write_bytes(b"old margins")
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "shard_00000.bin").write_bytes(b"old shard")
    (tmp_path / "train.bin.tmp").write_bytes(b"new")
    (tmp_path / "train.bin.meta.json.tmp").write_bytes(b"new meta")
    (tmp_path / "val.tmp").mkdir()
    (tmp_path / "val.tmp" / "manifest.json").write_bytes(b"new manifest")

    class Staged:
        def __init__(self, *pairs):
            self.pairs = pairs

        def staged(self):
            return [(a and str(tmp_path / a), str(tmp_path / b)) for a, b in self.pairs]

    sets = [Staged(("train.bin.tmp", "train.bin"), (None, "train.bin.margins"),
                   ("train.bin.meta.json.tmp", "train.bin.meta.json")), Staged(("val.tmp", "val"))]  # fmt: skip
    moves, real_replace = [], os.replace

    def stop_after_one(src, dst):  # the journal's own rename, then one move
        if len(moves) == 2:
            raise KeyboardInterrupt
        moves.append(dst)
        return real_replace(src, dst)

    journal = tmp_path / "train.bin.replacing.json"
    with monkeypatch.context() as patched:
        patched.setattr(writers.os, "replace", stop_after_one)
        with pytest.raises(KeyboardInterrupt):
            writers.replace(sets, journal)
    assert (tmp_path / "train.bin").read_bytes() == b"new" and journal.is_file()
    writers.finish_replacement(journal)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.bin", "train.bin.meta.json", "val"]
    assert (tmp_path / "train.bin.meta.json").read_bytes() == b"new meta"
    assert [p.name for p in (tmp_path / "val").iterdir()] == ["manifest.json"]


def test_training_on_an_empty_token_file_names_it(tmp_path):
    from fsdp_trainer.data.format import write_token_file

    write_token_file(tmp_path / "val.bin", np.zeros(0, np.uint16), 512, "sha")
    with pytest.raises(ValueError, match=f"token file {tmp_path / 'val.bin'} holds no tokens: prepare it again"):
        TokenFile(tmp_path / "val.bin")
