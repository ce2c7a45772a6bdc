"""Preference tuning's loss against TRL's DPOTrainer: the same pairs, tokenized and collated by TRL, through TRL's
concatenated forward on transformers models and through ours (SequenceLogProbs) on the same weights: the responses'
log-probabilities, the loss and the reward metrics agree."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fsdp_trainer.loss import IGNORE, PreferenceLoss, SequenceLogProbs
from fsdp_trainer.model import Transformer
from tests.test_real_models import save_hf_tokenizer

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

PAIRS = [
    {"prompt": "ROMEO. What light", "chosen": " through yonder window breaks?", "rejected": " is that over there"},
    {"prompt": "To be, or not", "chosen": " to be, that is the question", "rejected": " hmm"},
    {"prompt": "Now is the winter", "chosen": " of our discontent", "rejected": " of our discontent, made glorious"},
]


def trl_first_batch(trainer) -> tuple[dict, float, dict]:
    """A TRL trainer's first training batch, its loss (no gradient) and the metrics TRL logs of it."""
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        compute_loss = getattr(trainer, "_compute_loss", trainer.compute_loss)  # RewardTrainer's is the public one
        loss = compute_loss(trainer.model, batch, return_outputs=False).item()
    return batch, loss, {name: values[-1] for name, values in trainer._metrics["train"].items()}


def _trl_loss_and_metrics(trl_setup, kind: str, beta: float, label_smoothing: float):
    tmp, tokenizer, policy, reference, _ = trl_setup
    args = trl.DPOConfig(
        output_dir=str(tmp / "out"), per_device_train_batch_size=len(PAIRS), beta=beta, loss_type=[kind],
        label_smoothing=label_smoothing, report_to=[], use_cpu=True, bf16=False, disable_tqdm=True,
    )  # fmt: skip
    dataset = datasets.Dataset.from_list(PAIRS)
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=dataset,
                             processing_class=tokenizer)  # fmt: skip
    return trl_first_batch(trainer)


def _our_logps(hf_model, cfg, batch):
    """Each row's summed log-probability of its completion under our model holding `hf_model`'s weights."""
    ours = Transformer(cfg)
    missing, unexpected = ours.load_state_dict(hf_model.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("rope_") for name in missing)
    tokens, completion = batch["input_ids"], batch["completion_mask"].bool()
    targets = tokens[:, 1:].masked_fill(~completion[:, 1:], IGNORE)  # TRL pads on the right: causal, no effect
    objective = SequenceLogProbs(targets)
    with torch.no_grad():
        return ours(tokens[:, :-1], loss=objective), objective.count()


@pytest.mark.parametrize(("kind", "label_smoothing"), [("sigmoid", 0.0), ("ipo", 0.0), ("robust", 0.1)])
def test_loss_and_reward_metrics_equal_trls(trl_setup, kind, label_smoothing):
    beta = 0.1
    batch, trl_loss, trl_metrics = _trl_loss_and_metrics(trl_setup, kind, beta, label_smoothing)
    _, _, policy, reference, cfg = trl_setup
    logps, lengths = _our_logps(policy, cfg, batch)
    ref_logps, _ = _our_logps(reference, cfg, batch)
    chosen, rejected = logps.chunk(2)  # TRL's batch: the chosen responses, then the rejected ones
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    chosen_tokens, rejected_tokens = lengths.chunk(2)
    loss = PreferenceLoss(kind, beta, label_smoothing)
    ours = loss(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens).mean()
    print(f"{kind}: ours {ours.item():.9g}, TRL {trl_loss:.9g}")  # pytest -s shows the gap
    assert ours.item() == pytest.approx(trl_loss, rel=1e-5)
    for name, values in loss.rewards(chosen, rejected, ref_chosen, ref_rejected).items():
        assert values.mean().item() == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-7), name
    assert abs(trl_metrics["rewards/margins"]) > 1e-3  # a reference unlike the policy: nothing cancels


def test_conservative_dpo_is_the_label_smoothed_sigmoid_and_zero_smoothing_is_dpo():
    """cDPO (TRL before 0.20 and torchtune's DPOLoss): -(1 - e) log sigmoid(beta d) - e log sigmoid(-beta d)."""
    generator = torch.Generator().manual_seed(0)
    chosen, rejected, ref_chosen, ref_rejected = (-50 * torch.rand(4, generator=generator) for _ in range(4))
    d = (chosen - ref_chosen) - (rejected - ref_rejected)
    beta, e = 0.2, 0.1
    smoothed = PreferenceLoss("sigmoid", beta, e)(chosen, rejected, ref_chosen, ref_rejected)
    expected = -(1 - e) * F.logsigmoid(beta * d) - e * F.logsigmoid(-beta * d)
    torch.testing.assert_close(smoothed, expected, rtol=1e-6, atol=0)
    plain = PreferenceLoss("sigmoid", beta)(chosen, rejected, ref_chosen, ref_rejected)
    torch.testing.assert_close(plain, -F.logsigmoid(beta * d), rtol=1e-6, atol=0)
    # The policy equal to its reference: every pair's loss is log 2, every reward 0.
    same = PreferenceLoss("sigmoid", beta)(chosen, rejected, chosen, rejected)
    assert torch.allclose(same, torch.full_like(same, math.log(2)))


def test_an_unknown_loss_or_smoothing_out_of_range_is_refused():
    with pytest.raises(ValueError, match="preference loss 'hinge': choose among sigmoid, ipo, robust"):
        PreferenceLoss("hinge")
    with pytest.raises(ValueError, match=r"label_smoothing=0.5 must be in \[0, 0.5\)"):
        PreferenceLoss("robust", label_smoothing=0.5)


def test_sequence_log_probs_in_slices_equal_whole():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 6, 8, generator=generator, requires_grad=True)
    output = torch.nn.Linear(8, 16, bias=False)
    targets = torch.randint(0, 16, (4, 6), generator=generator)
    targets[:, :2] = IGNORE  # the prompt
    whole = SequenceLogProbs(targets)(hidden, output)
    sliced = SequenceLogProbs(targets, chunks=2)(hidden, output)
    torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=1e-6)
    direct = torch.log_softmax(hidden @ output.weight.T, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(whole, (direct * (targets != IGNORE)).sum(-1), rtol=1e-6, atol=1e-6)
    assert SequenceLogProbs(targets).count().tolist() == [4, 4, 4, 4]


LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""Llama 3's layout: nothing follows an answer's end-of-turn token, so TRL's completion (all the conversation renders
after the prompt) is exactly what we train: the answer's content and its <|eot_id|>."""


def prepared_batch(tmp_path, model: dict, records: list[dict], data_format: str, seq_len: int):
    """`records` through prepare_data.py --format `data_format`, with the tokenizer saved in tmp_path/tokenizer and
    the model section `model`: the whole file, in order, as one micro-batch."""
    import json

    from fsdp_trainer.data.format import TokenFile
    from fsdp_trainer.data.loader import TokenLoader
    from tests.helpers import tool

    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe = {"model": model, "parallel": {"mixed_precision": "fp32"},
              "data": {"train_path": str(tmp_path / "train.bin"), "tokenizer_path": str(tmp_path / "tokenizer"),
                       "seq_len": seq_len}}  # fmt: skip
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    tool("prepare_data.py", "--recipe", tmp_path / "recipe.yaml", "--format", data_format,
         "--input", tmp_path / "records.jsonl", "--val_fraction", "0")  # fmt: skip
    data = TokenFile(tmp_path / "train.bin")
    (batch,) = TokenLoader(data, seq_len, micro_batch_size=len(data) // seq_len, shuffle=False).next_batch()
    return batch


def test_prepared_pairs_give_trls_tokens_log_probabilities_loss_and_metrics(tmp_path, trl_setup):
    """Conversational pairs (TRL's message lists) through prepare_data.py --format preference, our loader and our
    objective, against TRL's DPOTrainer on the same records: the same token ids and completion tokens per
    conversation, and the same loss and reward metrics from a policy and a reference built from one config."""
    from dataclasses import asdict, replace

    from fsdp_trainer.config import PreferenceConfig
    from fsdp_trainer.steps.preference import METRICS, PreferenceStep, Reference

    _, _, policy, reference, cfg = trl_setup
    tokenizer = save_hf_tokenizer(tmp_path / "tokenizer", "llama", LLAMA3_TEMPLATE)
    tokenizer.pad_token = tokenizer.eos_token
    records = [
        {k: [{"role": "user" if k == "prompt" else "assistant", "content": pair[k]}] for k in pair} for pair in PAIRS
    ]
    records[0]["prompt"].insert(0, {"role": "system", "content": "Answer in verse."})
    seq_len = 512  # room for a pair whole: this tokenizer spells Llama 3's header tokens in several pieces
    batch = prepared_batch(tmp_path, {**asdict(cfg), "max_seq_len": seq_len}, records, "preference", seq_len)

    args = trl.DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(PAIRS), beta=0.1,
                         report_to=[], use_cpu=True, bf16=False, disable_tqdm=True)  # fmt: skip
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list(records))  # fmt: skip
    trl_batch, trl_loss, trl_metrics = trl_first_batch(trainer)

    # The same conversations, token for token, and the same tokens trained on (as (ids, completion) per sequence).
    def ours():
        for row in range(batch.inputs.shape[0]):
            for document in batch.documents[row].unique().tolist():
                inside = batch.documents[row] == document
                if (batch.sequences[row][inside] >= 0).any():
                    ids = batch.inputs[row][inside]
                    trained = torch.cat([torch.zeros(1, dtype=torch.bool), batch.sequences[row][inside][:-1] >= 0])
                    yield ids.tolist(), trained.tolist()

    def theirs():
        for ids, mask, completion in zip(trl_batch["input_ids"], trl_batch["attention_mask"],
                                         trl_batch["completion_mask"], strict=True):  # fmt: skip
            yield ids[mask.bool()].tolist(), completion[mask.bool()].bool().tolist()

    assert sorted(ours()) == sorted(theirs())

    def weights_of(hf_model):
        model = Transformer(replace(cfg, max_seq_len=seq_len))
        model.load_state_dict(hf_model.state_dict(), strict=False)
        return model

    step = PreferenceStep(PreferenceConfig(loss="sigmoid", beta=0.1), Reference(None, weights_of(reference)))
    with torch.no_grad():
        loss, metrics = step.sums(weights_of(policy), batch)  # sums over the micro-batch's pairs
    pairs = step.batch_units(batch)
    results = dict(zip(("loss", *METRICS), (torch.cat([loss[None], metrics]) / pairs).tolist(), strict=True))
    print(f"ours {results['loss']:.9g}, TRL {trl_loss:.9g}")
    assert pairs == len(PAIRS) and results["loss"] == pytest.approx(trl_loss, rel=1e-5)
    for name in METRICS:  # rewards: beta x a difference of log-probabilities a few hundred large, so absolute
        print(f"{name}: ours {results[name]:.9g}, TRL {trl_metrics[name]:.9g}")
        assert results[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-5 if "rewards/" in name else 0), name
