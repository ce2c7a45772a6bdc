"""The pair kinds beside DPO (SimPO, ORPO, DPO + NLL) against TRL's trainers of those kinds: TRL's batch (its
tokenization and collation) through TRL's loss and through our step on the same weights give the same loss and
metrics, and a step's loss terms are each a mean over their own units (pairs; the chosen answers' tokens)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from fsdp_trainer.config import PreferenceConfig
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.loss import IGNORE
from fsdp_trainer.model import Transformer
from fsdp_trainer.steps.orpo import ORPOStep
from fsdp_trainer.steps.pairs import answer_logps
from fsdp_trainer.steps.preference import PreferenceStep, Reference
from fsdp_trainer.steps.simpo import SimPOStep
from tests.helpers import read_metrics, train_cli, train_losses
from tests.test_dpo import PAIRS, trl_first_batch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def ours(hf_model, cfg) -> Transformer:
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(hf_model.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("rope_") for name in missing)
    return model


def micro_batch(ids: torch.Tensor, labels: torch.Tensor) -> MicroBatch:
    """TRL's rows (the chosen answers, then the rejected ones; labels IGNORE outside the answers) as our micro-batch
    of pairs: rows alternating chosen, rejected, each row one response."""
    pairs = len(ids) // 2
    order = torch.stack([torch.arange(pairs), torch.arange(pairs) + pairs], 1).flatten()
    ids, labels = ids[order], labels[order]
    targets = labels[:, 1:]  # TRL pads on the right: causal attention, no effect on the answers
    sequences = torch.where(targets != IGNORE, torch.arange(2 * pairs)[:, None], -1)
    return MicroBatch(ids[:, :-1], targets, None, sequences, pairs)


def trl_old_style(trainer_class, config_class, trl_setup, **options):
    """TRL's loss and metrics on its first batch, and that batch as ours (CPOTrainer and ORPOTrainer)."""
    tmp, tokenizer, policy, _, cfg = trl_setup
    args = config_class(output_dir=str(tmp / "out"), per_device_train_batch_size=len(PAIRS), report_to=[],
                        use_cpu=True, bf16=False, disable_tqdm=True, **options)  # fmt: skip
    trainer = trainer_class(model=policy, args=args, train_dataset=datasets.Dataset.from_list(PAIRS),
                            processing_class=tokenizer)  # fmt: skip
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    joined = trainer.concatenated_inputs(batch, padding_value=tokenizer.pad_token_id)
    ids, labels = joined["concatenated_input_ids"], joined["concatenated_labels"]
    metrics = {name: float(value) for name, value in metrics.items()}
    return loss.item(), metrics, micro_batch(ids, labels), ours(policy, cfg)


def assert_equal_to_trl(ours: dict, trl_loss: float, trl_metrics: dict, names: list[str]) -> None:
    gaps = {name: (ours[name].item(), trl_metrics[name]) for name in names}
    print({"loss": (ours["loss"].item(), trl_loss), **gaps})  # pytest -s shows the gaps
    assert ours["loss"].item() == pytest.approx(trl_loss, rel=1e-5)
    for name in names:
        assert ours[name].item() == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-7), name


REWARDS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected"]  # fmt: skip


@pytest.mark.parametrize(("cpo_alpha", "label_smoothing"), [(0.0, 0.0), (1.0, 0.1)])
def test_simpo_equals_trls_cpo_trainer(trl_setup, one_rank, cpo_alpha, label_smoothing):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    options = dict(loss_type="simpo", beta=2.0, simpo_gamma=0.5, cpo_alpha=cpo_alpha, label_smoothing=label_smoothing)
    trl_loss, trl_metrics, batch, model = trl_old_style(CPOTrainer, CPOConfig, trl_setup, **options)
    step = SimPOStep(beta=2.0, gamma=0.5, label_smoothing=label_smoothing, nll_weight=cpo_alpha)
    results = step.evaluate(model, [batch])
    assert_equal_to_trl(results, trl_loss, trl_metrics, REWARDS + (["nll_loss"] if cpo_alpha else []))
    assert abs(trl_metrics["rewards/margins"]) > 1e-3 and step.starts == []  # no reference model


def test_orpo_equals_trls_orpo_trainer_with_the_nll_over_the_answer(trl_setup, one_rank):
    """TRL counts the prompt's tokens in ORPO's NLL; the paper and we count the chosen answer's. The odds-ratio term
    and every other metric are TRL's; the NLL is the chosen answers' mean cross-entropy, computed here directly."""
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    trl_loss, trl_metrics, batch, model = trl_old_style(ORPOTrainer, ORPOConfig, trl_setup, beta=0.1)
    results = ORPOStep(beta=0.1).evaluate(model, [batch])
    odds_ratio_term = results["loss"] - results["nll_loss"]
    assert odds_ratio_term.item() == pytest.approx(trl_loss - trl_metrics["nll_loss"], rel=1e-5)
    assert_equal_to_trl(results, results["loss"].item(), trl_metrics, [*REWARDS, "log_odds_ratio", "log_odds_chosen"])
    with torch.no_grad():
        logits = model(batch.inputs[0::2])  # the chosen answers
    expected = F.cross_entropy(logits.flatten(0, 1), batch.targets[0::2].flatten(), ignore_index=IGNORE)
    assert results["nll_loss"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert results["nll_loss"].item() != pytest.approx(trl_metrics["nll_loss"], rel=1e-3)  # TRL adds the prompt


def test_dpo_with_nll_equals_trls_sigmoid_plus_sft_loss(trl_setup, one_rank):
    """RPO as TRL writes it: loss_type [sigmoid, sft], loss_weights [1, w]; the NLL a mean over the chosen tokens."""
    tmp, tokenizer, policy, reference, cfg = trl_setup
    args = trl.DPOConfig(
        output_dir=str(tmp / "out"), per_device_train_batch_size=len(PAIRS), beta=0.1, loss_type=["sigmoid", "sft"],
        loss_weights=[1.0, 0.5], report_to=[], use_cpu=True, bf16=False, disable_tqdm=True,
    )  # fmt: skip
    trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list(PAIRS))  # fmt: skip
    trl_batch, trl_loss, trl_metrics = trl_first_batch(trainer)
    ids, completion = trl_batch["input_ids"], trl_batch["completion_mask"].bool()
    batch = micro_batch(ids, ids.masked_fill(~completion, IGNORE))
    config = PreferenceConfig(loss="sigmoid", beta=0.1, nll_weight=0.5)
    step = PreferenceStep(config, Reference(ours(policy, cfg), ours(reference, cfg)))
    results = step.evaluate(ours(policy, cfg), [batch])
    assert_equal_to_trl(results, trl_loss, trl_metrics, ["rewards/chosen", "rewards/margins", "rewards/accuracies"])
    dpo_only = PreferenceStep(PreferenceConfig(loss="sigmoid", beta=0.1), step.reference).evaluate(
        ours(policy, cfg), [batch]
    )
    assert results["loss"].item() == pytest.approx(dpo_only["loss"].item() + 0.5 * results["nll_loss"].item(), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preference", "logged"),
    [({"loss": "simpo", "beta": 2.0, "nll_weight": 0.5}, "nll_loss"), ({"loss": "orpo"}, "log_odds_chosen")],
)
def test_reference_free_kinds_two_ranks_equal_one_process_and_resume_bitwise(tiny_data, pairs, tmp_path, preference,
                                                                             logged):  # fmt: skip
    """SimPO (with CPO's NLL term) and ORPO: 2 ranks FULL_SHARD equal 1 process x accumulation 2 over 10 steps, each
    loss term a mean over the global batch's own units; no reference model is built or loaded; a resume from step 5
    on 2 ranks is bitwise."""
    from tests.test_preference import _args, _close

    every = {"every": 5, "keep_last": 0}
    two, one = tmp_path / "two", tmp_path / "one"
    proc = train_cli(_args(tiny_data, pairs, two, 10, checkpoint=every, preference=preference), nproc=2)
    assert "reference model" not in proc.stdout + proc.stderr
    assert not list((two / "checkpoints" / "step_00000005").glob("reference*"))
    one_args = _args(tiny_data, pairs, one, 10, data={"grad_accum_steps": 2}, train={"eval_steps": 6},
                     preference=preference)  # fmt: skip
    train_cli(one_args)
    records_two, records_one = read_metrics(two), read_metrics(one)
    keys = {"loss", "val_loss", logged, f"val_{logged}", "rewards/margins", "val_rewards/accuracies", "pairs"}
    for a, b in zip(records_two, records_one, strict=True):
        for key in keys & set(a):
            assert b[key] == _close(key, a[key]), (a["step"], key)
    assert train_losses(two)[10] < train_losses(two)[1]

    moved = tmp_path / "moved"
    shutil.copytree(two, moved)
    shutil.rmtree(moved / "checkpoints" / "step_00000010")
    (moved / "checkpoints" / "latest").write_text("step_00000005\n")
    train_cli(_args(tiny_data, pairs, moved, 10, checkpoint=every, preference=preference), nproc=2)
    resumed = {r["step"]: r for r in read_metrics(moved) if "loss" in r}
    for record in (r for r in records_two if "loss" in r and r["step"] > 5):
        assert all(resumed[record["step"]][key] == record[key] for key in ("loss", logged)), record["step"]


def test_bad_pair_kind_settings_are_one_line():
    with pytest.raises(ValueError, match="preference.nll_weight: ORPO's NLL term always weighs 1"):
        PreferenceConfig(loss="orpo", nll_weight=1.0)
    with pytest.raises(ValueError, match="preference.label_smoothing applies to the sigmoid, robust and simpo losses, "
                                         "not orpo; set it to 0"):  # fmt: skip
        PreferenceConfig(loss="orpo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"preference.nll_weight=-1.0 must be >= 0"):
        PreferenceConfig(loss="simpo", nll_weight=-1.0)


def test_a_sharded_model_returns_its_answers_log_probabilities_as_fsdp2_expects(one_rank):
    """Not a view: FSDP2 warns that an in-place op on a view its module returns would drop the pre-backward hook (the
    warning every DPO run printed once per rank); the gradients reach the sharded weights."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    from fsdp_trainer.config import ModelConfig
    from fsdp_trainer.steps.pairs import PairStep

    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                                    max_seq_len=16))  # fmt: skip
    model.init_weights()
    fully_shard(model)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = PairStep.fake_batch(MicroBatch(tokens, tokens.roll(-1, 1), None, None, 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logps, _ = answer_logps(model, batch)
        logps.sum().backward()
    assert logps._base is None and logps.shape == (4,)
    assert not [w for w in caught if "view" in str(w.message)], [str(w.message) for w in caught]
    assert all(p.grad is not None for p in model.parameters())
