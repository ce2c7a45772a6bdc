"""Preference tuning on CPU ranks: pairs prepared and packed together, a DPO run that starts as its reference (the
loss ln 2 at step 1), 2 ranks equal one process with accumulation, resume bitwise and onto another world size, the
reference that stays the model the run started from, LoRA's reference (the adapters off), the bundled set learned,
bad input in one line. TRL's numbers for the same pairs are checked in test_dpo.py."""

from __future__ import annotations

import gzip
import json
import logging
import math
import shutil

import numpy as np
import pytest
import torch

from fsdp_trainer.adapters.lora import adapters_disabled, apply_lora, init_lora
from fsdp_trainer.config import LoraConfig, ModelConfig
from fsdp_trainer.data.chat import SEQUENCE, TRAINED, Packer
from fsdp_trainer.data.format import START, TARGET, TokenFile
from fsdp_trainer.data.loader import TokenLoader
from fsdp_trainer.data.prepare import BUNDLED_PREFERENCES
from fsdp_trainer.loss import SequenceLogProbs
from fsdp_trainer.model import Transformer
from fsdp_trainer.sinks import LogLine, scalars
from fsdp_trainer.steps.preference import METRICS, PreferenceStep
from tests.conftest import PAIRS_SEQ_LEN, prepare_pairs
from tests.helpers import REPO, read_metrics, run_args, train_cli, train_losses

SEQ = PAIRS_SEQ_LEN


def _args(tiny_data, pairs, out, steps, **sections):
    overrides = {
        "model": {"max_seq_len": SEQ},
        "data": {
            "train_path": pairs / "train.bin",
            "val_path": pairs / "val.bin",
            "seq_len": SEQ,
            "micro_batch_size": 4,
        },
        "preference": {"loss": "sigmoid"},
        "optim": {"lr": 1e-2, "min_lr": 3e-3},
        "train": {"eval_every": 5, "eval_steps": 3},
    }
    for section, values in sections.items():
        overrides[section] = {**overrides.get(section, {}), **values}
    return run_args(tiny_data, out, steps, **overrides)


def test_pairs_are_packed_together_chosen_first_each_trained_on_its_answer(pairs):
    """Every window holds whole pairs: its responses (the documents with targets) alternate chosen, rejected, and the
    two of a pair share their prompt; a response's targets are its answer."""
    data = TokenFile(pairs / "train.bin")
    # of 540 pairs: the rest have prompts too long for 128 tokens
    assert data.records == "preference" and data.meta["examples"] > 200
    loader = TokenLoader(data, SEQ, micro_batch_size=8, shuffle=False)
    (batch,) = loader.next_batch()
    assert batch.pairs >= 8 and int(batch.sequences.max()) == 2 * batch.pairs - 1
    for row in range(8):
        responses = []
        for document in batch.documents[row].unique().tolist():
            inside = batch.documents[row] == document
            trained = inside & (batch.sequences[row] >= 0)
            if trained.any():
                numbers = batch.sequences[row][trained].unique()
                assert len(numbers) == 1  # one response per document
                first = int(trained.nonzero()[0])  # the answer follows its prompt
                responses.append((int(numbers), batch.inputs[row][inside][: first - int(inside.nonzero()[0]) + 1]))
        assert len(responses) % 2 == 0
        for (chosen, prompt), (rejected, rejected_prompt) in zip(responses[0::2], responses[1::2], strict=True):
            assert rejected == chosen + 1 and chosen % 2 == 0
            assert torch.equal(prompt, rejected_prompt)


def test_a_pair_is_cut_keeping_each_conversation_start_and_dropped_without_an_answer():
    """TRL's keep_start at max_length = seq_len / 2, per conversation: prompt first, then as much answer as fits."""
    packer = Packer(seq_len=16, pad_id=0)
    ids = np.arange(1, 25)
    marks = np.zeros(24, np.uint8)
    marks[[0, 12]] = SEQUENCE
    marks[5:12] = marks[17:24] = TRAINED  # each conversation: 5 prompt tokens, 7 answer tokens
    assert packer.add(ids, marks) == []
    (tokens, flags, _), *_ = packer.finish()
    np.testing.assert_array_equal(tokens, np.r_[1:9, 13:21])  # 8 tokens of each, from its start
    assert np.flatnonzero(flags & START).tolist() == [0, 8]
    assert np.flatnonzero(flags & TARGET).tolist() == [4, 5, 6, 12, 13, 14]  # never across into the next
    assert packer.truncated == 1
    marks[5:9] = 0  # the chosen answer starts after 8 tokens: cut away whole, so the pair goes
    assert packer.add(ids, marks) == [] and packer.untrained == 1 and packer.examples == 1


def test_dpo_two_ranks_equal_one_process_resume_and_the_reference_stays_the_start(tiny_data, pairs, tmp_path):
    """A DPO run from another run's checkpoint (plain training here, an SFT run in README) starts from its weights
    only: step 1's policy is its reference, so the loss is ln 2 and every reward 0. 2 ranks equal 1 process with
    accumulation 2 over 10 steps, held-out metrics included; a resume on 2 ranks is bitwise, onto 1 to float order,
    and loads the reference from where the run started, not from the policy's latest weights."""
    start = tmp_path / "start"
    train_cli(run_args(tiny_data, start, 3, checkpoint={"every": 3}))
    every = {"every": 5, "keep_last": 0, "resume": start}
    two = tmp_path / "two"
    proc = train_cli(_args(tiny_data, pairs, two, 10, checkpoint=every), nproc=2)
    assert f"loaded weights from {start}" in proc.stdout + proc.stderr
    one = tmp_path / "one"
    # Evaluation reads eval_steps global micro-batches: twice as many on one process cover the same pairs.
    train_cli(_args(tiny_data, pairs, one, 10, checkpoint=every, data={"grad_accum_steps": 2}, train={"eval_steps": 6}))
    records_two, records_one = read_metrics(two), read_metrics(one)
    first = next(r for r in records_two if "loss" in r)
    assert first["step"] == 1 and first["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert first["rewards/margins"] == 0 and first["pairs"] >= 4  # 2 ranks x 2 windows, each of whole pairs
    keys = ["loss", "val_loss", *METRICS, *(f"val_{name}" for name in METRICS)]
    for a, b in zip(records_two, records_one, strict=True):
        for key in set(keys) & set(a):
            assert b[key] == _close(key, a[key]), (a["step"], key)
    reference = json.loads((two / "checkpoints" / "step_00000005" / "reference.json").read_text())
    assert reference["path"] == str((start / "checkpoints" / "step_00000003").resolve())

    # Resumed from step 5 on 2 ranks: bitwise; on 1 rank: to float order. Each reloads its reference from `start`.
    for nproc, extra in ((2, {}), (1, {"grad_accum_steps": 2})):  # no evaluation compared
        moved = tmp_path / f"moved{nproc}"
        shutil.copytree(two, moved)
        shutil.rmtree(moved / "checkpoints" / "step_00000010")
        (moved / "checkpoints" / "latest").write_text("step_00000005\n")
        proc = train_cli(_args(tiny_data, pairs, moved, 10, checkpoint=every, data=extra), nproc=nproc)
        assert "at step 5" in proc.stdout + proc.stderr
        resumed = {r["step"]: r for r in read_metrics(moved) if "loss" in r}
        for step, record in ((r["step"], r) for r in records_two if "loss" in r):
            for key in ("loss", *METRICS):
                expected = record[key] if nproc == 2 else _close(key, record[key])
                assert resumed[step][key] == expected, (step, key)

    # The bundled set is learned: held-out reward accuracy above chance, the margin of the chosen answers over the
    # rejected ones up from 0 (where the policy is its reference) on the held-out pairs.
    evals = [r for r in records_two if "val_loss" in r]
    assert [r["step"] for r in evals] == [5, 10]
    assert evals[1]["val_rewards/accuracies"] > 0.5
    assert evals[1]["val_rewards/margins"] > evals[0]["val_rewards/margins"] > 0
    assert train_losses(two)[10] < math.log(2)


@pytest.mark.slow
def test_a_cached_reference_gives_the_frozen_copys_numbers_resumes_bitwise_and_a_stale_one_is_refused(
    tiny_data, pairs, tmp_path
):
    """preference.reference=cache: one pass of the reference over every pair before training, then no reference: the
    same losses, metrics and held-out numbers as the frozen copy (rel 1e-6) over 6 steps on 2 ranks; a resume reads
    the cache and is bitwise; a cache made from another reference is refused in one line."""
    start = tmp_path / "start"
    train_cli(run_args(tiny_data, start, 3, checkpoint={"every": 3}))
    every, train = {"every": 3, "keep_last": 0, "resume": start}, {"eval_every": 3}
    model, cache = tmp_path / "model", tmp_path / "cache"
    train_cli(_args(tiny_data, pairs, model, 6, checkpoint=every, train=train), nproc=2)
    proc = train_cli(_args(tiny_data, pairs, cache, 6, checkpoint=every, train=train,
                           preference={"reference": "cache"}), nproc=2)  # fmt: skip
    assert "the reference's log-probabilities of train's" in proc.stdout
    assert {p.name for p in (cache / "reference_cache").iterdir()} == {"train.npz", "val.npz"}
    for a, b in zip(read_metrics(model), read_metrics(cache), strict=True):
        for key in {"loss", "val_loss", *METRICS, *(f"val_{name}" for name in METRICS)} & set(a):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (a["step"], key)

    straight = {r["step"]: r for r in read_metrics(cache) if "loss" in r}
    shutil.rmtree(cache / "checkpoints" / "step_00000006")
    (cache / "checkpoints" / "latest").write_text("step_00000003\n")
    args = _args(tiny_data, pairs, cache, 6, checkpoint=every, train=train, preference={"reference": "cache"})
    proc = train_cli(args, nproc=2)
    assert "the reference's log-probabilities read from" in proc.stdout
    resumed = {r["step"]: r for r in read_metrics(cache) if "loss" in r}
    for step in (4, 5, 6):
        assert (resumed[step]["loss"], resumed[step]["rewards/margins"]) == (
            straight[step]["loss"], straight[step]["rewards/margins"]), step  # fmt: skip

    stale = tmp_path / "stale"  # a new run from the seeded init, beside the cache of a run from `start`
    shutil.copytree(cache / "reference_cache", stale / "reference_cache")
    args = _args(tiny_data, pairs, stale, 6, checkpoint={"resume": "none"}, preference={"reference": "cache"})
    proc = train_cli(args, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: rank 0: {stale / 'reference_cache' / 'train.npz'} holds the reference's log-probabilities made with "
        "another reference than this run's: delete it to compute them again, or resume with what it was made from"
    )


def _close(key: str, value: float):
    """Equal to float order: a reward is beta x a difference of log-probabilities some hundreds large, so it keeps
    their absolute error (1e-5 relative of them), not a relative one of its own."""
    return pytest.approx(value, rel=1e-5, abs=2e-5 if "rewards/" in key else 1e-6)


SMALL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)


def test_lora_reference_is_the_base_model_and_only_adapters_learn():
    """With the adapters off, a LoRA model computes its base's log-probabilities bitwise, whatever the adapters
    hold; with them on, its own."""
    torch.manual_seed(0)
    base = Transformer(SMALL)
    base.init_weights(seed=0)
    adapted = Transformer(SMALL)
    adapted.load_state_dict(base.state_dict())
    apply_lora(adapted, LoraConfig(rank=4, targets=["q_proj", "v_proj", "down_proj"]))
    init_lora(adapted, 0, lambda param, values: param.copy_(values), torch.device("cpu"))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_()  # adapters that change the output
    inputs = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    targets[:, :4] = -100
    with torch.no_grad():
        expected = base(inputs, loss=SequenceLogProbs(targets))
        with adapters_disabled(adapted):
            reference = adapted(inputs, loss=SequenceLogProbs(targets))
        policy = adapted(inputs, loss=SequenceLogProbs(targets))
    assert torch.equal(reference, expected)
    assert not torch.allclose(policy, expected)
    assert all(m.enabled for m in adapted.modules() if hasattr(m, "enabled"))  # switched back on


def test_dpo_with_lora_starts_at_the_reference_and_saves_adapters_only(tiny_data, pairs, tmp_path):
    out = tmp_path / "lora"
    train_cli(_args(tiny_data, pairs, out, 3, lora={"rank": 4}, preference={"loss": "ipo"}, checkpoint={"every": 3}),
              nproc=2)  # fmt: skip
    records = [r for r in read_metrics(out) if "loss" in r]
    assert records[0]["loss"] == pytest.approx(25.0, rel=1e-6)  # IPO at the reference: (0 - 1 / (2 beta))^2
    assert records[-1]["loss"] < 25.0
    saved = (out / "checkpoints" / "step_00000003").iterdir()
    assert "reference.json" not in {p.name for p in saved}  # the reference is the base, recorded as lora_base.json


def test_pairs_read_alike_from_jsonl_and_parquet_as_texts_or_messages(tiny_data, tmp_path):
    """TRL's two layouts (three texts, three message lists) give the same tokens; parquet rows read as JSON lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [{"prompt": "Who is there?", "chosen": "Nay, answer me.", "rejected": "me answer Nay."}] * 3
    messages = [
        {key: [{"role": "user" if key == "prompt" else "assistant", "content": value}] for key, value in r.items()}
        for r in texts
    ]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in texts))
    pq.write_table(pa.Table.from_pylist(messages), tmp_path / "messages.parquet")
    for name in ("texts.jsonl", "messages.parquet"):
        prepare_pairs(tiny_data, tmp_path / f"{name}.out", [tmp_path / name], "--val_fraction", "0")
    a, b = (TokenFile(tmp_path / f"{name}.out" / "train.bin") for name in ("texts.jsonl", "messages.parquet"))
    assert a.meta["examples"] == 3 and np.array_equal(a.tokens, b.tokens) and np.array_equal(a.flags, b.flags)


def test_reward_metrics_go_to_tensorboard_and_wandb_under_trls_names_and_to_the_log_line(caplog):
    record = {"step": 3, "loss": 0.5, "rewards/accuracies": 0.75, "val_rewards/margins": 1.5, "val_loss": 0.6}
    assert scalars(record) == {
        "loss/train": 0.5, "train/rewards/accuracies": 0.75, "eval/rewards/margins": 1.5, "loss/val": 0.6
    }  # fmt: skip
    caplog.set_level(logging.INFO, logger="fsdp_trainer")
    LogLine(PreferenceStep.shown).write(
        {"step": 5, "val_loss": 0.6, "val_rewards/accuracies": 0.875, "val_rewards/margins": 1.25}
    )
    assert "step      5 | val_loss 0.6000 | val_reward accuracy 0.875 | val_margin 1.250" in caplog.text


def test_bad_preference_input_is_one_line(tiny_data, pairs, tmp_path):
    good = {"prompt": "Who is there?", "chosen": "Nay, answer me.", "rejected": "me answer Nay."}
    cases = [
        ({"prompt": "Who is there?", "chosen": "Nay, answer me."}, "bad.jsonl:2: no 'rejected'"),
        ({**good, "chosen": [{"role": "assistant", "content": "Nay"}]}, "bad.jsonl:2: 'prompt', 'chosen' and"),
        ({**good, "prompt": [], "chosen": [{"role": "user", "content": "x"}], "rejected": []}, "'chosen' must hold"),
    ]
    for record, message in cases:
        (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
        proc = prepare_pairs(tiny_data, tmp_path / "out", [tmp_path / "bad.jsonl"], check=False)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    proc = prepare_pairs(tiny_data, tmp_path / "out", [tmp_path / "bad.jsonl"], "--train_on", "all", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--train_on=all applies to --format chat: a preference pair is measured on its answers" in proc.stderr
    # Pairs without a preference loss, and a preference loss on plain token files: refused before any process starts.
    proc = train_cli(_args(tiny_data, pairs, tmp_path / "a", 1, preference={"loss": None}), check=False)
    assert proc.returncode == 1 and "holds preference pairs, and the next-token kind" in proc.stderr, proc.stderr
    assert "or set preference.loss (sigmoid for DPO, ipo or robust) to train on these" in proc.stderr
    proc = train_cli(_args(tiny_data, pairs, tmp_path / "a", 1, preference={"loss": "kto"}), check=False)
    assert "holds preference pairs, and the kto kind this recipe asks for trains on" in proc.stderr, proc.stderr
    assert "prepare them with tools/prepare_data.py --format unpaired" in proc.stderr
    proc = train_cli(run_args(tiny_data, tmp_path / "b", 1, preference={"loss": "sigmoid"}), check=False)
    assert proc.returncode == 1 and "trains on preference pairs, and" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_readme_walkthrough_sft_then_dpo_on_an_imported_qwen3_and_export(tmp_path):
    """README's commands: a Qwen3 saved by transformers (sharded, ChatML tokenizer) imported, instruction-tuned
    (sft_qwen3_0.6b.yaml), then DPO from that SFT run (dpo_qwen3_0.6b.yaml) on 2 ranks, and consolidated into a
    directory transformers loads, holding the tuned policy, not its reference."""
    transformers = pytest.importorskip("transformers")
    from tests.helpers import tool
    from tests.test_chat import CHATML
    from tests.test_real_models import save_hf_tokenizer

    hf_in = tmp_path / "hf_in"
    tokenizer = save_hf_tokenizer(hf_in, "qwen3", CHATML)
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer) + 8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(hf_in, max_shard_size="100KB")
    tool("import_hf.py", hf_in, tmp_path / "imported")
    with gzip.open(REPO / "fsdp_trainer" / "assets" / "shakespeare_chat.jsonl.gz", "rt") as f:
        (tmp_path / "chats.jsonl").write_text("".join(f.readline() for _ in range(200)))
    with gzip.open(BUNDLED_PREFERENCES, "rt") as f:
        (tmp_path / "prefs.jsonl").write_text("".join(f.readline() for _ in range(200)))
    small = ["--data.seq_len", SEQ, "--data.micro_batch_size", 2, "--data.grad_accum_steps", 1]
    for kind, fmt, records in (("sft", "chat", "chats"), ("dpo", "preference", "prefs")):
        paths = ["--data.train_path", tmp_path / kind / "train.bin", "--data.val_path", tmp_path / kind / "val.bin"]
        tool("prepare_data.py", "--recipe", REPO / "recipes" / f"{kind}_qwen3_0.6b.yaml", "--format", fmt,
             "--input", tmp_path / f"{records}.jsonl", "--data.tokenizer_path", tmp_path / "imported", *paths,
             *small)  # fmt: skip
        start = tmp_path / "imported" if kind == "sft" else tmp_path / "sft_run"
        args = [
            "--recipe", REPO / "recipes" / f"{kind}_qwen3_0.6b.yaml", "--recipe", tmp_path / "imported" / "model.yaml",
            "--checkpoint.resume", start, "--train.out_dir", tmp_path / f"{kind}_run", *paths, *small,
            "--train.steps", 3, "--train.eval_every", 3, "--train.eval_steps", 1, "--train.loss_chunks", 1,
            "--parallel.compile", "false", "--parallel.mixed_precision", "fp32", "--optim.lr", 1e-3,
            "--optim.min_lr", 1e-4, "--optim.warmup_steps", 1, "--checkpoint.every", 3,
        ]  # fmt: skip
        proc = train_cli(list(map(str, args)), nproc=2)
        assert f"loaded weights from {start}" in proc.stdout + proc.stderr
    records = [r for r in read_metrics(tmp_path / "dpo_run") if "loss" in r]
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-7) and records[-1]["loss"] != records[0]["loss"]
    assert any("val_rewards/accuracies" in r for r in read_metrics(tmp_path / "dpo_run"))

    for kind in ("sft", "dpo"):
        tool("consolidate.py", tmp_path / f"{kind}_run", tmp_path / f"{kind}_hf")
    sft, dpo = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{k}_hf") for k in ("sft", "dpo"))
    sft_weights = sft.state_dict()
    changed = [name for name, value in dpo.state_dict().items() if not torch.equal(value, sft_weights[name])]
    assert len(changed) == len(sft_weights)  # every weight moved away from the reference (the SFT model)
