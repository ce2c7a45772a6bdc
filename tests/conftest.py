"""Fixtures: a tiny tokenized slice of the bundled corpus and a recipe for it. Shared helpers: tests/helpers."""

from __future__ import annotations

import gc
import gzip
import json
import os
from pathlib import Path

# The compile tests check what our compile path does (dynamo's capture of a block, AC, the routing, expert
# parallelism's symbolic sizes, FSDP around compiled blocks) against eager, not how inductor vectorizes its C++
# kernels, a CPU stand-in for the GPU's Triton ones. Scalar kernels cost the compile tests a quarter to a third less
# CPU with an empty compile cache, as CI's is (docs/benchmarks.md). Read as torch._inductor is first imported, so set
# before anything imports torch; inherited by torchrun's workers and tools, and by the forkserver, whose runs take it
# again from their own environment (tests/helpers/forked.py).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# One OpenMP thread per process, as torchrun gives each worker: `make test` already runs a pytest worker per core,
# each forking its runs' ranks, so a second intra-op thread only oversubscribes the cores, and libgomp's threads spin
# while they wait for a descheduled peer (a test of in-process scoring and exports took twice the CPU beside two busy
# processes with two threads as with one; docs/benchmarks.md). Read as torch is first imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from fsdp_trainer.data.prepare import BUNDLED_CHAT, BUNDLED_CORPUS, BUNDLED_PREFERENCES
from tests.helpers import TINY_BATCH, TINY_MODEL, forked, made_once, tool


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A recipe file whose data section points at a 512-token tokenizer and token files cut from ~400 KB of
    Shakespeare, all written by tools/prepare_data.py, once for the suite's workers."""
    return made_once(tmp_path_factory, "data", _make_tiny_data) / "tiny.yaml"


def _make_tiny_data(root: Path) -> None:
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        (root / "corpus.txt").write_text(f.read(400_000))
    recipe = root / "tiny.yaml"
    recipe.write_text(
        json.dumps(  # JSON is YAML
            {
                "model": TINY_MODEL,
                "parallel": {"mixed_precision": "fp32"},
                "data": {
                    "train_path": str(root / "train.bin"),
                    "val_path": str(root / "val.bin"),
                    "tokenizer_path": str(root / "tokenizer.model"),
                    **TINY_BATCH,
                },
                "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
                "train": {"steps": 10, "log_every": 1, "eval_every": 0, "eval_steps": 2},
                "checkpoint": {"every": 0},
            }
        )
    )
    tool("prepare_data.py", "--recipe", recipe, "--input", root / "corpus.txt", "--val_fraction", "0.1")


PAIRS_SEQ_LEN = 256  # a pair per window at most 256 tokens: each conversation up to 128 of the tiny tokenizer's


def prepare_records(recipe, out, fmt, inputs, seq_len, *extra, check=True):
    """tools/prepare_data.py --format `fmt` of `inputs` into out/train.bin and out/val.bin (a tenth), in windows of
    `seq_len`; `extra` flags after those (a later --val_fraction wins)."""
    args = ["--recipe", recipe, "--format", fmt, "--input", *inputs, "--data.seq_len", seq_len, "--model.max_seq_len",
            seq_len, "--val_fraction", "0.1", "--data.train_path", out / "train.bin", "--data.val_path",
            out / "val.bin", *extra]  # fmt: skip
    return tool("prepare_data.py", *args, check=check)


def prepare_pairs(recipe, out, inputs, *extra, check=True):
    """Preference pairs prepared (prepare_records) in windows of PAIRS_SEQ_LEN."""
    return prepare_records(recipe, out, "preference", inputs, PAIRS_SEQ_LEN, *extra, check=check)


@pytest.fixture(scope="session")
def chat_data(tiny_data, tmp_path_factory) -> Path:
    """The bundled chat set's first 300 conversations, packed in windows of 128 tokens of the tiny tokenizer: a
    recipe."""

    def make(root: Path) -> None:
        with gzip.open(BUNDLED_CHAT, "rt") as f:
            (root / "chat.jsonl").write_text("".join(f.readlines()[:300]))
        recipe = json.loads(Path(tiny_data).read_text())
        recipe["data"].update(train_path=str(root / "train.bin"), val_path=str(root / "val.bin"), seq_len=128)
        recipe["model"]["max_seq_len"] = 128
        (root / "chat.yaml").write_text(json.dumps(recipe))
        tool("prepare_data.py", "--recipe", root / "chat.yaml", "--format", "chat", "--input", root / "chat.jsonl",
             "--val_fraction", "0.1")  # fmt: skip

    return made_once(tmp_path_factory, "chat", make) / "chat.yaml"


@pytest.fixture(scope="session")
def pairs(tiny_data, tmp_path_factory):
    """The first 600 pairs of the bundled set, prepared with the tiny tokenizer."""

    def make(root: Path) -> None:
        with gzip.open(BUNDLED_PREFERENCES, "rt") as f:
            (root / "pairs.jsonl").write_text("".join(f.readlines()[:600]))
        prepare_pairs(tiny_data, root, [root / "pairs.jsonl"])

    return made_once(tmp_path_factory, "pairs", make)


@pytest.fixture(scope="module")
def trl_setup(tmp_path_factory):
    """A tokenizer, a policy and a different reference (transformers Llamas from one config), and TRL's batch."""
    transformers = pytest.importorskip("transformers")
    import torch

    from fsdp_trainer.hf import model_config_from_hf
    from tests.test_real_models import save_hf_tokenizer

    tmp = tmp_path_factory.mktemp("dpo")
    tokenizer = save_hf_tokenizer(tmp / "tokenizer", "llama")
    tokenizer.pad_token = tokenizer.eos_token
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    policy = transformers.LlamaForCausalLM(config)
    torch.manual_seed(1)
    reference = transformers.LlamaForCausalLM(config)
    return tmp, tokenizer, policy, reference, model_config_from_hf(config.to_dict(), "test")


@pytest.fixture
def one_rank():
    """A 1-rank gloo process group for the test, as `python -m fsdp_trainer.train` makes one (a step's means are
    all-reduced), destroyed after it: none is left for another test, whichever module the worker runs next."""
    from fsdp_trainer.config import ParallelConfig
    from fsdp_trainer.distributed.runtime import close_distributed, init_distributed

    init_distributed(ParallelConfig(mixed_precision="fp32"))
    yield
    close_distributed()


def pytest_configure(config):
    """Where tests are collected (an xdist worker, or the one process without xdist): no garbage collection while
    collection imports transformers, TRL and peft, a million objects and no garbage (until collection ends). In xdist's
    controller, before it starts the workers: the forkserver both workers' runs fork from (tests/helpers/forked.py),
    unless the cost plugin counts each test's runs, which it finds in its worker's process tree (a server each)."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        gc.disable()
    elif not config.pluginmanager.has_plugin("tests.helpers.cost"):
        os.environ[forked.SHARED] = forked.start_server()


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, TRL, the package) lives as long as the worker: kept out of every
    later garbage collection, each full one of which would otherwise walk it all again."""
    gc.collect()
    gc.freeze()
    gc.enable()
