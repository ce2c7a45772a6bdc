"""KTO against TRL's KTOTrainer: TRL's batch (its tokenization, collation and rotated KL completions) through TRL's
loss and through our step on the same weights gives the same loss, KL reference point and metrics; the bundled pairs
split into labelled answers prepare into packed windows whose labels the loader reads back; a run on them: 2 ranks
equal 1 process x accumulation 2 over 10 steps (the KL term included), resume is bitwise, and the held-out margin
grows."""

from __future__ import annotations

import gzip
import json
import shutil

import numpy as np
import pytest
import torch

from fsdp_trainer.config import PreferenceConfig
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.loss import IGNORE
from fsdp_trainer.steps.kto import KTOStep
from fsdp_trainer.steps.preference import Reference
from tests.helpers import read_metrics, run_args, tool, train_cli
from tests.test_dpo import PAIRS, trl_first_batch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

RECORDS = [  # the pairs split into labelled answers, in an order that mixes prompts and labels
    {"prompt": pair["prompt"], "completion": pair[key], "label": key == "chosen"}
    for key in ("chosen", "rejected")
    for pair in PAIRS
]


def our_batch(batch: dict) -> MicroBatch:
    """TRL's rows (right-padded prompt + completion) as our micro-batch: one example per row, the padding an example
    of its own, trained on the completion, its label."""
    ids, real, completion = batch["input_ids"], batch["attention_mask"].bool(), batch["completion_mask"].bool()
    trained = torch.zeros_like(completion)
    trained[:, :-1] = completion[:, 1:]  # position t predicts token t + 1
    targets = torch.roll(ids, -1, dims=1).masked_fill(~trained, IGNORE)
    documents = torch.where(real, 1, 2)
    sequences = torch.where(trained, torch.arange(len(ids))[:, None], -1)
    return MicroBatch(ids, targets, documents, sequences, 0, torch.as_tensor(batch["label"], dtype=torch.bool))


@pytest.mark.parametrize(("beta", "weights"), [(0.1, (1.0, 1.0)), (0.5, (1.0, 1.5))])
def test_loss_kl_and_metrics_equal_trls(trl_setup, one_rank, beta, weights):
    from tests.test_pair_kinds import ours

    tmp, tokenizer, policy, reference, cfg = trl_setup
    args = trl.KTOConfig(
        output_dir=str(tmp / "kto"), per_device_train_batch_size=len(RECORDS), beta=beta, desirable_weight=weights[0],
        undesirable_weight=weights[1], report_to=[], use_cpu=True, bf16=False, disable_tqdm=True,
    )  # fmt: skip
    trainer = trl.KTOTrainer(model=policy, ref_model=reference, args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list(RECORDS))  # fmt: skip
    batch, trl_loss, trl_metrics = trl_first_batch(trainer)

    config = PreferenceConfig(loss="kto", beta=beta, desirable_weight=weights[0], undesirable_weight=weights[1])
    step = KTOStep(config, Reference(None, ours(reference, cfg)))
    numbers = step.evaluate(ours(policy, cfg), [our_batch(batch)])
    names = ["kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"]
    print({"loss": (numbers["loss"].item(), trl_loss), **{n: (numbers[n].item(), trl_metrics[n]) for n in names}})
    assert numbers["loss"].item() == pytest.approx(trl_loss, rel=1e-5)
    for name in names:  # rewards and kl: differences of log-probabilities near -60, each equal to 1e-5 (rel 2e-7)
        assert numbers[name].item() == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-5), name


def prepare_unpaired(recipe, out, records, *extra):
    """tools/prepare_data.py --format unpaired of `records` into out/train.bin and out/val.bin (windows of 256)."""
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tool("prepare_data.py", "--recipe", recipe, "--format", "unpaired", "--input", out / "records.jsonl",
                "--data.seq_len", 256, "--model.max_seq_len", 256, "--data.train_path", out / "train.bin",
                "--data.val_path", out / "val.bin", *extra)  # fmt: skip


def test_prepared_answers_keep_their_labels_and_are_trained_on_the_completion_alone(tiny_data, tmp_path):
    """Each record becomes one example: the loader numbers its answer (`sequences`), whose targets are the completion
    (through the end of its turn) and nothing of the prompt, and reads its label (`desirable`) back; a record without
    a boolean label is one line naming it."""
    from fsdp_trainer.data.format import open_tokens
    from fsdp_trainer.data.loader import micro_batch
    from fsdp_trainer.tokenizer import load_tokenizer

    prepare_unpaired(tiny_data, tmp_path, RECORDS, "--val_fraction", "0")
    tokens = open_tokens(tmp_path / "train.bin")
    assert tokens.records == "unpaired" and tokens.meta["examples"] == len(RECORDS)
    rows = np.stack([tokens.tokens.reshape(-1, 256), tokens.flags.reshape(-1, 256)], 1).astype(np.int64)
    batch = micro_batch(rows, packed=True, records="unpaired", device=torch.device("cpu"))
    tokenizer = load_tokenizer(json.loads(tiny_data.read_text())["data"]["tokenizer_path"])
    answers = {}
    for k, good in enumerate(batch.desirable.tolist()):
        ids = batch.targets[batch.sequences == k].tolist()
        assert ids[-1] == tokenizer.eos_id  # the default template's end of an answer
        answers[tokenizer.decode(ids[:-1]).strip()] = good
    assert answers == {r["completion"].strip(): r["label"] for r in RECORDS}

    bad = [*RECORDS[:2], {"prompt": "Hi", "completion": "there", "label": "yes"}]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    proc = tool("prepare_data.py", "--recipe", tiny_data, "--format", "unpaired", "--input", tmp_path / "bad.jsonl",
                "--data.train_path", tmp_path / "b.bin", "--data.val_path", "null", check=False)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'bad.jsonl'}:3: 'label' is 'yes': it must be true (a desirable completion) or false; fix "
        "it or pass --skip_bad_records to skip and count such records"
    ]


@pytest.fixture(scope="module")
def unpaired(tiny_data, tmp_path_factory):
    """The first 800 of the bundled labelled answers, prepared with the tiny tokenizer: a recipe."""
    from fsdp_trainer.data.prepare import BUNDLED_UNPAIRED

    root = tmp_path_factory.mktemp("unpaired")
    with gzip.open(BUNDLED_UNPAIRED, "rt") as f:
        records = [json.loads(line) for line in f.readlines()[:800]]
    prepare_unpaired(tiny_data, root, records, "--val_fraction", "0.1")
    recipe = json.loads(tiny_data.read_text())
    recipe["model"]["max_seq_len"] = 256
    recipe["data"].update(train_path=str(root / "train.bin"), val_path=str(root / "val.bin"), seq_len=256)
    recipe["preference"] = {"loss": "kto", "beta": 0.1}
    (root / "kto.yaml").write_text(json.dumps(recipe))
    return root / "kto.yaml"


@pytest.mark.slow
def test_kto_two_ranks_equal_one_process_resume_bitwise_and_the_margin_grows(unpaired, tmp_path):
    """2 ranks FULL_SHARD equal 1 process x accumulation 2 over 10 steps (loss, kl, rewards; validation too), though
    the micro-batches hold different numbers of answers; a resume from step 5 is bitwise; the held-out margin grows."""
    every, train = {"every": 5, "keep_last": 0}, {"eval_every": 5, "eval_steps": 2}
    two, one = tmp_path / "two", tmp_path / "one"
    train_cli(run_args(unpaired, two, 10, checkpoint=every, train=train), nproc=2)
    train_cli(run_args(unpaired, one, 10, data={"grad_accum_steps": 2}, train={**train, "eval_steps": 4}))
    steps = {r["step"]: r for r in read_metrics(two) if "kl" in r}
    records_one = [r for r in read_metrics(one) if "kl" in r or "val_kl" in r]
    for b in records_one:
        a = next(r for r in read_metrics(two) if r["step"] == b["step"] and set(r) == set(b))
        for key in {"loss", "kl", "rewards/margins", "logps/chosen", "val_loss", "val_kl", "val_rewards/margins"} & set(
            a
        ):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (a["step"], key)  # margins: differences
    held_out = [r for r in read_metrics(two) if "val_rewards/margins" in r]
    assert held_out[-1]["val_rewards/margins"] > held_out[0]["val_rewards/margins"] > 0

    shutil.rmtree(two / "checkpoints" / "step_00000010")
    (two / "checkpoints" / "latest").write_text("step_00000005\n")
    (two / "metrics.jsonl").rename(tmp_path / "straight.jsonl")
    train_cli(run_args(unpaired, two, 10, checkpoint=every, train=train), nproc=2)
    resumed = {r["step"]: r for r in read_metrics(two) if "kl" in r}
    for step in (6, 8, 10):
        assert (resumed[step]["loss"], resumed[step]["kl"]) == (steps[step]["loss"], steps[step]["kl"]), step


@pytest.mark.parametrize("template", ["llama3", "chatml"])
def test_prepared_records_give_trls_tokens_and_completions(tmp_path, trl_setup, template):
    """Conversational records (message lists) through prepare_data.py --format unpaired and our loader, against TRL's
    KTOTrainer's batch of the same records: the same token ids per example and the same completion tokens, but for
    the newline ChatML writes after <|im_end|>, which TRL counts in the completion and we do not (README)."""
    from dataclasses import asdict

    from tests.test_chat import CHATML
    from tests.test_dpo import LLAMA3_TEMPLATE, prepared_batch
    from tests.test_real_models import save_hf_tokenizer

    _, _, policy, reference, cfg = trl_setup
    chat_template, family = {"llama3": (LLAMA3_TEMPLATE, "llama"), "chatml": (CHATML, "qwen3")}[template]
    tokenizer = save_hf_tokenizer(tmp_path / "tokenizer", family, chat_template)
    tokenizer.pad_token = tokenizer.eos_token
    records = [
        {"prompt": [{"role": "user", "content": r["prompt"]}],
         "completion": [{"role": "assistant", "content": r["completion"]}], "label": r["label"]}
        for r in RECORDS
    ]  # fmt: skip
    records[0]["prompt"].insert(0, {"role": "system", "content": "Answer in verse."})
    model = {**asdict(cfg), "max_seq_len": 512, "vocab_size": len(tokenizer)}
    batch = prepared_batch(tmp_path, model, records, "unpaired", 512)

    args = trl.KTOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(records), report_to=[],
                         use_cpu=True, bf16=False, disable_tqdm=True)  # fmt: skip
    trainer = trl.KTOTrainer(model=policy, ref_model=reference, args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list(records))  # fmt: skip
    trl_batch = next(iter(trainer.get_train_dataloader()))

    def ours():
        for k, good in enumerate(batch.desirable.tolist()):
            row = int((batch.sequences == k).any(dim=1).nonzero()[0])
            document = batch.documents[row][batch.sequences[row] == k][0]
            inside = batch.documents[row] == document
            trained = torch.cat([torch.zeros(1, dtype=torch.bool), batch.sequences[row][inside][:-1] == k])
            yield batch.inputs[row][inside].tolist(), trained.tolist(), good

    newline = tokenizer("\n", add_special_tokens=False).input_ids

    def theirs():
        columns = ("input_ids", "attention_mask", "completion_mask", "label")
        for ids, mask, completion, good in zip(*(trl_batch[c] for c in columns), strict=True):
            ids, trained = ids[mask.bool()].tolist(), completion[mask.bool()].bool().tolist()
            if template == "chatml":  # TRL's completion ends with the template's newline after <|im_end|>
                assert ids[-1:] == newline and trained[-1]
                trained[-1] = False
            yield ids, trained, bool(good)

    assert sorted(ours()) == sorted(theirs())
