"""Token files and the loader: the global batch at step t is the same whatever the world size and split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fsdp_trainer.data.encode import Part
from fsdp_trainer.data.format import MANIFEST, TokenFile, open_tokens, write_token_file
from fsdp_trainer.data.loader import Mixture, TokenLoader
from fsdp_trainer.data.writers import ShardWriter, replace
from fsdp_trainer.tokenizer import run_tokenizer_path


@pytest.fixture(params=["file", "shards"])
def token_file(tmp_path, request):
    """1001 distinct tokens (every window distinct): one file, or a directory of shards of 97 tokens written by the
    preparation's writer, so that windows cross shard boundaries."""
    if request.param == "file":
        write_token_file(tmp_path / "t.bin", np.arange(1001), vocab_size=1001, tokenizer_sha256="abc")
        return TokenFile(tmp_path / "t.bin")
    writer = ShardWriter(str(tmp_path / "shards"), 97, vocab_size=1001, tokenizer_sha256="abc", stamp={})
    writer.add(Part(np.array([0, 1]), np.array([300, 300]), np.arange(600)))  # two documents, then a third
    writer.add(Part(np.array([2]), np.array([401]), np.arange(600, 1001)))
    writer.finish({})
    replace([writer], tmp_path / "shards.replacing.json")
    shards = open_tokens(tmp_path / "shards")
    assert len(shards.shards) == 11 and len(shards) == 1001
    return shards


def test_shard_windows_are_windows_of_the_concatenated_shards(tmp_path):
    writer = ShardWriter(str(tmp_path / "s"), 7, vocab_size=50_000, tokenizer_sha256="x", stamp={})
    tokens = np.random.default_rng(0).integers(0, 50_000, 100)
    writer.add(Part(np.array([0]), np.array([100]), tokens))
    writer.finish({})
    replace([writer], tmp_path / "s.replacing.json")
    shards = open_tokens(tmp_path / "s")
    concatenated = np.concatenate([shard.tokens for shard in shards.shards])
    assert np.array_equal(concatenated, tokens)
    starts = np.arange(0, 100 - 12)
    assert np.array_equal(shards.windows(starts, 12), concatenated[starts[:, None] + np.arange(12)])


def global_batch(token_file, world_size, micro, accum, steps, seed=0):
    """The set of sequences every rank sees at each step, as sorted tuples."""
    loaders = [TokenLoader(token_file, 10, micro, accum, r, world_size, seed=seed) for r in range(world_size)]
    out = []
    for _ in range(steps):
        rows = []
        for loader in loaders:
            for inputs, targets, *_ in loader.next_batch():
                assert inputs.shape == targets.shape == (micro, 10) and inputs.dtype == torch.int64
                assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are inputs shifted by one
                rows += [tuple(r) for r in inputs.tolist()]
        out.append(sorted(rows))
    return out


def test_global_batch_is_independent_of_world_size_and_split(token_file):
    reference = global_batch(token_file, world_size=1, micro=4, accum=1, steps=60)  # > 1 epoch of 100 samples
    assert global_batch(token_file, world_size=2, micro=2, accum=1, steps=60) == reference
    assert global_batch(token_file, world_size=1, micro=2, accum=2, steps=60) == reference
    assert global_batch(token_file, world_size=2, micro=1, accum=2, steps=60) == reference
    assert global_batch(token_file, world_size=4, micro=1, accum=1, steps=60) == reference


def test_each_epoch_visits_every_sample_once_in_a_seeded_order(token_file):
    epoch = [row for step in global_batch(token_file, 1, 4, 1, steps=25) for row in step]
    assert len(set(epoch)) == 100  # (1001 - 1) // 10 windows, each once
    assert global_batch(token_file, 1, 4, 1, 3, seed=1) != global_batch(token_file, 1, 4, 1, 3, seed=0)


def test_state_dict_resumes_the_stream_on_another_world_size(token_file):
    run = TokenLoader(token_file, 10, 4, 1, 0, 1, seed=3)
    for _ in range(7):
        run.next_batch()
    state = run.state_dict()
    expected = torch.cat([inputs for inputs, *_ in run.next_batch()])
    # Resume on 2 ranks with micro 2: together they produce the same sequences.
    resumed = [TokenLoader(token_file, 10, 2, 1, r, 2, seed=3) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state)
    got = torch.cat([loader.next_batch()[0][0] for loader in resumed])
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, expected.tolist()))


def test_state_from_other_data_is_refused(token_file, tmp_path):
    state = TokenLoader(token_file, 10, 4, seed=0).state_dict()
    write_token_file(tmp_path / "other.bin", np.arange(2001), vocab_size=2001, tokenizer_sha256="abc")
    with pytest.raises(ValueError, match="different fingerprint"):
        TokenLoader(TokenFile(tmp_path / "other.bin"), 10, 4).load_state_dict(state)
    with pytest.raises(ValueError, match="different seed"):
        TokenLoader(token_file, 10, 4, seed=1).load_state_dict(state)


def test_token_file_round_trip_and_dtypes(tmp_path):
    write_token_file(tmp_path / "small.bin", np.array([1, 2, 65535]), vocab_size=65536, tokenizer_sha256="x")
    write_token_file(tmp_path / "big.bin", np.array([1, 2, 100_000]), vocab_size=128256, tokenizer_sha256="x")
    small, big = TokenFile(tmp_path / "small.bin"), TokenFile(tmp_path / "big.bin")
    assert small.meta["dtype"] == "uint16" and list(small.tokens) == [1, 2, 65535]
    assert big.meta["dtype"] == "uint32" and list(big.tokens) == [1, 2, 100_000]
    assert (tmp_path / "small.bin").stat().st_size == 6  # flat little-endian, no header


def test_bad_token_files_are_refused_with_the_file_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare_data.py"):
        TokenFile(tmp_path / "missing.bin")
    write_token_file(tmp_path / "t.bin", np.arange(100), vocab_size=100, tokenizer_sha256="x")
    with open(tmp_path / "t.bin", "r+b") as f:
        f.truncate(50)
    with pytest.raises(ValueError, match="truncated or foreign"):
        TokenFile(tmp_path / "t.bin")
    with pytest.raises(ValueError, match=r"must lie in \[0, 100\)"):
        write_token_file(tmp_path / "u.bin", np.array([5, 100]), vocab_size=100, tokenizer_sha256="x")
    # The folder above a prepared corpus (its train/ and val/ shard directories) is named for what it holds.
    for split in ("train", "val"):
        (tmp_path / "corpus" / split).mkdir(parents=True)
        (tmp_path / "corpus" / split / MANIFEST).write_text("{}")
    named = f"holds no shards of its own but train, val: .*{tmp_path}/corpus/train"
    with pytest.raises(FileNotFoundError, match=named):
        open_tokens(tmp_path / "corpus")
    (tmp_path / "half").mkdir()  # a preparation cut short: no manifest yet
    with pytest.raises(FileNotFoundError, match="its preparation did not finish"):
        open_tokens(tmp_path / "half")


@pytest.fixture
def two_sources(tmp_path):
    """A (ids 0-999) and B (ids 1000-1199): which source a window came from shows in its first id."""
    write_token_file(tmp_path / "a.bin", np.arange(1000), vocab_size=1200, tokenizer_sha256="t")
    write_token_file(tmp_path / "b.bin", np.arange(1000, 1200), vocab_size=1200, tokenizer_sha256="t")
    return [TokenFile(tmp_path / "a.bin"), TokenFile(tmp_path / "b.bin")]


def _sources_drawn(loader, steps) -> list[int]:
    """The source (0 = A, 1 = B) of each sequence of `steps` global batches of one rank's loader."""
    return [int(first >= 1000) for _ in range(steps) for batch in loader.next_batch() for first in batch.inputs[:, 0]]


def test_a_mixture_draws_each_source_by_its_weight_over_any_window(two_sources):
    mixture = Mixture(two_sources, [0.7, 0.3], ["a", "b"], seed=0)
    loader = TokenLoader(mixture, 9, micro_batch_size=64)
    drawn = np.array(_sources_drawn(loader, 64))  # 4096 samples: 4 blocks
    assert list(mixture.quotas) == [717, 307] and list(mixture.drawn(4096)) == [4 * 717, 4 * 307]
    for start in range(0, len(drawn) - 256, 64):  # any window of 256 samples: 30% from B, give or take
        assert abs(drawn[start : start + 256].mean() - 0.3) < 0.08
    assert list(np.bincount(drawn[:1500], minlength=2)) == list(mixture.drawn(1500))
    # B holds 22 windows of 9 tokens, so by now it has been read many times over, each epoch in a new order.
    report = loader.mixture_report()
    assert report["b"] == {"tokens": 4 * 307 * 9, "epochs": round(4 * 307 / 22, 4)}
    assert report["a"]["epochs"] == round(4 * 717 / 111, 4)


def test_a_mixture_is_the_same_global_batch_at_any_world_size_and_resumes(two_sources):
    def mixture():
        return Mixture(two_sources, [2.0, 1.0], ["a", "b"], seed=3)

    reference = global_batch(mixture(), world_size=1, micro=4, accum=1, steps=300, seed=3)
    assert global_batch(mixture(), world_size=2, micro=1, accum=2, steps=300, seed=3) == reference
    run = TokenLoader(mixture(), 10, 4, seed=3)
    for _ in range(7):
        run.next_batch()
    state = run.state_dict()
    expected = sorted(map(tuple, torch.cat([x for x, *_ in run.next_batch()]).tolist()))
    resumed = [TokenLoader(mixture(), 10, 2, 1, r, 2, seed=3) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state)
    assert sorted(map(tuple, torch.cat([loader.next_batch()[0][0] for loader in resumed]).tolist())) == expected
    other_weights = TokenLoader(Mixture(two_sources, [1.0, 1.0], ["a", "b"], seed=3), 10, 4, seed=3)
    with pytest.raises(ValueError, match="different fingerprint"):
        other_weights.load_state_dict(state)


def test_a_null_tokenizer_path_is_the_one_that_came_with_the_checkpoint(tmp_path):
    """data.tokenizer_path: null takes the tokenizer saved with checkpoint.resume (an import directory holds it at its
    top, a run in the step its `latest` names), else what the run recorded; with nothing to take it from, one line."""
    imported = tmp_path / "my_import"
    imported.mkdir()
    (imported / "tokenizer.json").write_text("{}")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "checkpoints" / "step_00000004" / "tokenizer.model").write_bytes(b"sp")
    (run / "checkpoints" / "latest").write_text("step_00000004\n")
    assert run_tokenizer_path("tok.model", "none", str(run)) == "tok.model"  # named: used as it is
    assert run_tokenizer_path(None, str(imported), str(tmp_path / "new")) == str(imported)
    assert run_tokenizer_path(None, "auto", str(run)) == str(run / "checkpoints" / "step_00000004")
    (run / "config.yaml").write_text(f"data:\n  tokenizer_path: {imported}\n")  # what the first attempt resolved
    assert run_tokenizer_path(None, "auto", str(run)) == str(imported)
    with pytest.raises(ValueError, match="data.tokenizer_path is null.*checkpoint.resume=none names no checkpoint"):
        run_tokenizer_path(None, "none", str(run))


def test_an_evaluation_reads_no_window_twice_and_says_when_eval_steps_asks_for_more(tmp_path):
    from fsdp_trainer.data.loader import eval_batches

    write_token_file(tmp_path / "val.bin", np.arange(101), vocab_size=1001, tokenizer_sha256="abc")
    val = TokenFile(tmp_path / "val.bin")  # (101 - 1) // 10 = 10 windows of 10 (+1) tokens
    assert eval_batches(val, 10, 2, 2, 2) == (2, None)  # 8 of its windows
    n, note = eval_batches(val, 10, 2, 2, 50)
    assert n == 2 and note == (
        f"train.eval_steps=50 is more than {val.path} holds (10 windows, 2 global micro-batches of 4): each "
        "evaluation scores those 2, each window once"
    )
    loader = TokenLoader(val, 10, 2, 1, 0, 1, shuffle=False)
    seen = [tuple(row) for _ in range(5) for row in loader.next_batch()[0].inputs.tolist()]
    assert len(set(seen)) == len(seen) == 10  # the first 10 windows in order: none twice
    n, note = eval_batches(val, 10, 8, 2, 3)
    assert n == 1 and "fewer than one global micro-batch (16): each evaluation scores some of them twice" in note
