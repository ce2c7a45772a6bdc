"""Online RL as a user runs it: prompts prepared with --format prompts, a run of the grpo kind on 2 ranks against 1
process with accumulation, a resume, and every bad input refused in one line before a worker starts."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import torch

from fsdp_trainer.data.chat import ChatEncoder
from fsdp_trainer.data.format import START, open_tokens
from fsdp_trainer.tokenizer import load_tokenizer
from tests.conftest import PAIRS_SEQ_LEN, prepare_records
from tests.helpers import TINY_BATCH, read_metrics, rewind, run_args, train_cli

SEQ_LEN = 48


def prompt_records(n: int) -> list[dict]:
    """Addition problems, every other one a conversation, each with its `answer` column (and one more column)."""
    records = []
    for i in range(n):
        a, b = 3 * i % 17, 7 * i % 13
        prompt = f"{a} + {b} =" if i % 2 else [{"role": "user", "content": f"What is {a} + {b}?"}]
        records.append({"prompt": prompt, "answer": str(a + b), "id": i})
    return records


def prepare_prompts(recipe, root, records, *extra, check=True):
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    inputs = [root / "prompts.jsonl"]
    return prepare_records(recipe, root, "prompts", inputs, SEQ_LEN, "--val_fraction", "0.2", *extra, check=check)


@pytest.fixture(scope="module")
def prompts(tiny_data, tmp_path_factory):
    """60 prompts prepared with the tiny tokenizer, a recipe on them (the tiny model, windows of SEQ_LEN)."""
    root = tmp_path_factory.mktemp("prompts")
    prepare_prompts(tiny_data, root, prompt_records(60))
    recipe = json.loads(tiny_data.read_text())
    recipe["data"].update(train_path=str(root / "train.bin"), val_path=str(root / "val.bin"), seq_len=SEQ_LEN)
    (root / "grpo.yaml").write_text(json.dumps(recipe))
    return root


def test_prompts_prepare_a_window_each_with_their_records(tiny_data, prompts):
    """Each prompt is a window of its own, its tokens those TRL's GRPOTrainer samples from (a conversation with the
    chat template's generation prompt, a text as it is), padding after; line k of the columns file is window k's
    record; the validation prompts are others than the training ones."""
    tokenizer = load_tokenizer(json.loads(tiny_data.read_text())["data"]["tokenizer_path"])
    encoder = ChatEncoder(tokenizer)
    seen = []
    for split in ("train", "val"):
        tokens = open_tokens(prompts / f"{split}.bin")
        assert tokens.records == "prompts" and tokens.packed_seq_len == SEQ_LEN
        windows = len(tokens) // SEQ_LEN
        records = tokens.columns(range(windows))
        for k, record in enumerate(records):
            window = np.asarray(tokens.tokens[k * SEQ_LEN : (k + 1) * SEQ_LEN])
            flags = np.asarray(tokens.flags[k * SEQ_LEN : (k + 1) * SEQ_LEN])
            prompt = record["prompt"]
            ids = encoder.prompt(prompt) if isinstance(prompt, list) else tokenizer.encode_prompt(prompt)
            assert window[: len(ids)].tolist() == ids and flags[0] == START and flags[len(ids)] == START
            assert not (flags & 1).any()  # nothing trained
            assert record == prompt_records(60)[record["id"]]
        seen.append({r["id"] for r in records})
    assert len(seen[0]) + len(seen[1]) == 60 and not seen[0] & seen[1] and seen[1]


def test_a_prompt_too_long_for_its_window_is_dropped_and_counted(tiny_data, tmp_path):
    records = prompt_records(20)
    records[3]["prompt"] = "to be or not " * 40
    proc = prepare_prompts(tiny_data, tmp_path, records)
    assert "1 dropped as leaving no room in data.seq_len" in proc.stdout, proc.stdout
    ids = [r["id"] for split in ("train", "val") for r in _all_records(tmp_path / f"{split}.bin")]
    assert sorted(ids) == [i for i in range(20) if i != 3]


def _all_records(path):
    tokens = open_tokens(path)
    return tokens.columns(range(len(tokens) // tokens.packed_seq_len))


REWARDS = [
    {"function": "fsdp_trainer.rewards:exact_answer"},
    {"function": "tests.helpers.rewards:digit_reward", "weight": 0.5},
]


def grpo(**overrides) -> dict:
    return {"rewards": REWARDS, "num_generations": 4, "max_completion_length": 12, **overrides}


@pytest.fixture(scope="module")
def reward_run(tiny_data, pairs, tmp_path_factory):
    """A reward model of the tiny shape after 2 steps on the bundled pairs: its run directory."""
    recipe = json.loads(tiny_data.read_text())
    recipe["model"].update(num_labels=1, max_seq_len=PAIRS_SEQ_LEN)
    recipe["data"].update(train_path=str(pairs / "train.bin"), val_path=None, seq_len=PAIRS_SEQ_LEN)
    root = tmp_path_factory.mktemp("reward_model")
    (root / "reward.yaml").write_text(json.dumps(recipe))
    train_cli(run_args(root / "reward.yaml", root / "run", 2, checkpoint={"every": 2}))
    return root / "run"


def test_a_reward_model_scores_a_completion_as_tools_score_does(reward_run):
    """grpo.reward_model's score of a prompt (text or messages) and a completion's text: the conversation rendered
    with the reward model's chat template and read at its last token, as tools/score.py (generation.score) reads
    it, packed several to a window."""
    from fsdp_trainer.checkpoint.storage import checkpoint_tokenizer, resolve_checkpoint
    from fsdp_trainer.convert import load_model
    from fsdp_trainer.generation import score
    from fsdp_trainer.steps.reward_model import RewardModel

    model, _ = load_model(reward_run)
    step = resolve_checkpoint(reward_run)
    scorer = RewardModel(model, checkpoint_tokenizer(step, None))
    prompts = ["3 + 4 =", [{"role": "user", "content": "What is 2 + 2?"}], "9 + 9 ="]
    texts = [" 7", "4, of course.", ""]
    ours = scorer(prompts, texts)
    conversations = [
        [{"role": "user", "content": prompts[0]}, {"role": "assistant", "content": texts[0]}],
        [*prompts[1], {"role": "assistant", "content": texts[1]}],
        [{"role": "user", "content": prompts[2]}, {"role": "assistant", "content": texts[2]}],
    ]
    ids = [torch.from_numpy(scorer.encoder.encode_messages(c)[0]) for c in conversations]
    expected = score(model, ids).numpy()
    assert np.abs(ours - expected).max() < 1e-5 * np.abs(expected).max(), (ours, expected)
    assert len(set(np.round(ours, 4))) == 3  # three conversations, three scores


def two_ranks_and_one(recipe, root, steps: int, settings: dict, every: dict) -> tuple:
    """A GRPO run on 2 ranks (checkpointed as `every` says) and on 1 process with accumulation 2: (the first's
    directory, its records of the steps by step, the second's records of the steps)."""
    two, one = root / "two", root / "one"
    train_cli(run_args(recipe, two, steps, grpo=settings, checkpoint=every), nproc=2)
    train_cli(run_args(recipe, one, steps, grpo=settings, data={"grad_accum_steps": 2}))
    logged = [[r for r in read_metrics(run) if "reward" in r] for run in (two, one)]
    return two, {r["step"]: r for r in logged[0]}, logged[1]


CYCLES = {"on_policy": {}, "reused": {"steps_per_generation": 2, "num_iterations": 2}}


@pytest.mark.slow
@pytest.mark.parametrize("cycle", CYCLES)
def test_two_ranks_equal_one_process_and_a_resume_is_bitwise(prompts, reward_run, tmp_path, cycle):
    """GRPO (loss grpo, KL to a frozen reference, rewards scaled by the batch's std): 2 ranks FULL_SHARD equal 1
    process x accumulation 2 over 6 steps, rollouts included (the same completions: their lengths and rewards); the
    sampler and the trainer agree on the sampled tokens' log-probs to float noise; a resume from step 3 is bitwise.
    `reused`: a sampling feeds 2 steps, twice over (steps 1-4 train on step 1's completions, step 5 samples again);
    the resume from step 3 is in the middle of that and carries them, also to a run on 1 process. `on_policy` also
    scores with a reward model (sharded and frozen, reloaded on resume)."""
    recipe, reused = prompts / "grpo.yaml", cycle == "reused"
    settings = grpo(loss_type="grpo", beta=0.05, scale_rewards="batch", **CYCLES[cycle])
    if not reused:
        settings.update(reward_model=str(reward_run), reward_model_weight=0.3)
    every = {"every": 3, "keep_last": 0}
    two, steps, one = two_ranks_and_one(recipe, tmp_path, 6, settings, every)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    for r in one:
        a = steps[r["step"]]
        for key in ("reward", "rewards/digit_reward/mean", "completions/mean_length", "frac_reward_zero_std"):
            assert r[key] == pytest.approx(a[key], rel=1e-6 if "reward_model" in settings else 0), (r["step"], key)
        for key in ("loss", "grad_norm", "kl", "entropy", *(["rewards/reward_model/mean"] if not reused else [])):
            assert r[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9), (r["step"], key)
        assert a["sampling/sampling_logp_difference/max"] < 1e-4
    assert any(r["kl"] > 0 for r in steps.values()) and any(r["reward_std"] > 0 for r in steps.values())
    if not reused:  # the reward model's weights are the reward run's, recorded with every checkpoint
        record = json.loads((two / "checkpoints" / "step_00000003" / "reward_model.json").read_text())
        assert record["path"] == str(reward_run / "checkpoints" / "step_00000002")
    if reused:  # one sampling's metrics for its 4 steps; the ratios move off 1 once the policy has
        assert steps[1]["reward"] == steps[4]["reward"] != steps[5]["reward"]
        assert steps[2]["completions/mean_length"] == steps[3]["completions/mean_length"]
        assert steps[1]["clip_ratio/region_mean"] == 0 and steps[3]["clip_ratio/region_mean"] > 0

    if reused:  # the checkpoint at step 3 holds what steps 4 and 5 train on: 1 process takes it all
        across = tmp_path / "across"
        shutil.copytree(two, across)
        rewind(across, 3)
        train_cli(run_args(recipe, across, 6, grpo=settings, checkpoint=every, data={"grad_accum_steps": 2}))
        resumed = {r["step"]: r for r in read_metrics(across) if "reward" in r}
        for step in (4, 5, 6):
            assert resumed[step]["reward"] == steps[step]["reward"]
            assert resumed[step]["loss"] == pytest.approx(steps[step]["loss"], rel=1e-5), step
    rewind(two, 3)
    train_cli(run_args(recipe, two, 6, grpo=settings, checkpoint=every), nproc=2)
    resumed = {r["step"]: r for r in read_metrics(two) if "reward" in r}
    for step in (4, 5, 6):
        for key in ("loss", "reward", "grad_norm", "completions/mean_length"):
            assert resumed[step][key] == steps[step][key], (step, key)


def rare(completions, completion_ids, **_):
    """1 for a completion whose first token's id is a multiple of 8, else 0: most groups of 4 random completions
    score alike (all 0), some do not."""
    return [float(ids[0] % 8 == 0) for ids in completion_ids]


def test_dynamic_sampling_trains_on_groups_that_differ_and_two_ranks_equal_one_process(prompts, tmp_path):
    """DAPO's dynamic sampling: the groups whose rewards are all equal are dropped and further prompts sampled
    until the step's groups all differ (frac_reward_zero_std 0, more prompts sampled than a step's); 2 ranks equal 1
    process, and a resume at step 2 reads on from where the refills left the data (bitwise)."""
    recipe, every = prompts / "grpo.yaml", {"every": 2, "keep_last": 0}
    settings = grpo(rewards=[{"function": "tests.test_grpo_runs:rare"}], dynamic_sampling=True)
    two, steps, one = two_ranks_and_one(recipe, tmp_path, 3, settings, every)
    for r in one:
        a = steps[r["step"]]
        assert r["frac_reward_zero_std"] == a["frac_reward_zero_std"] == 0, r
        for key in ("reward", "reward_std", "sampling/prompts_sampled", "completions/mean_length"):
            assert r[key] == a[key], (r["step"], key)
        assert r["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-9)
    per_step = 2 * TINY_BATCH["micro_batch_size"]
    assert all(r["sampling/prompts_sampled"] > per_step for r in steps.values())  # refilled every step
    rewind(two, 2)
    train_cli(run_args(recipe, two, 3, grpo=settings, checkpoint=every), nproc=2)
    [resumed] = [r for r in read_metrics(two) if "reward" in r]
    assert resumed["step"] == 3 and resumed["loss"] == steps[3]["loss"] and resumed["reward"] == steps[3]["reward"]


@pytest.mark.parametrize("base", ["bf16", "nf4"])
def test_a_lora_policy_is_measured_against_itself_with_its_adapters_off(prompts, tmp_path, base):
    """GRPO with LoRA (and QLoRA: the frozen projections in NF4, sampled through and trained through) and a KL term:
    the reference is the policy with its adapters off (no second copy), so at step 1 (adapters' B = 0) the KL is
    exactly 0, and it grows once they move; the checkpoints hold the adapters alone."""
    out = tmp_path / "run"
    lora = {"rank": 4, "alpha": 8, "quantize_base": "nf4" if base == "nf4" else None}
    model = {"dim": 256} if base == "nf4" else {}  # every projection a whole number of NF4's 16,384-value blocks
    settings, every = grpo(beta=0.1, loss_type="grpo"), {"every": 4}
    train_cli(
        run_args(
            prompts / "grpo.yaml", out, 4, grpo=settings, lora=lora, model=model, optim={"lr": 3e-2}, checkpoint=every
        )
    )
    records = {r["step"]: r for r in read_metrics(out) if "kl" in r}
    assert records[1]["kl"] == 0.0 and records[4]["kl"] > 0, records
    from fsdp_trainer.checkpoint.starts import is_adapters_only

    assert is_adapters_only(out / "checkpoints" / "step_00000004")


def test_in_bf16_the_samplers_log_probs_differ_and_the_correction_weighs_them(prompts, tmp_path):
    """In bf16 the KV-cache decode and the whole-window forward round differently: the gap is measured at sampling
    (a forward without gradient there) and grpo.sampler_correction weighs each token by exp(trainer - sampler),
    clipped to its bounds (TRL's metrics, per step)."""
    out = tmp_path / "run"
    settings = grpo(sampler_correction="token_truncate", sampler_correction_min=0.5, sampler_correction_max=2.0)
    train_cli(run_args(prompts / "grpo.yaml", out, 2, grpo=settings, parallel={"mixed_precision": "bf16"}))
    for r in (r for r in read_metrics(out) if "reward" in r):
        gap, mean = r["sampling/sampling_logp_difference/max"], r["sampling/sampling_logp_difference/mean"]
        assert 1e-3 < gap and 0 < mean < gap, r
        low, high = r["sampling/importance_sampling_ratio/min"], r["sampling/importance_sampling_ratio/max"]
        assert 0.5 <= low < r["sampling/importance_sampling_ratio/mean"] < high <= 2.0, r
        assert np.isfinite(r["loss"])


def test_evaluation_scores_greedy_completions_of_the_validation_prompts(prompts, tmp_path):
    out = tmp_path / "run"
    train_cli(run_args(prompts / "grpo.yaml", out, 2, grpo=grpo(), train={"eval_every": 2, "eval_steps": 2}))
    [record] = [r for r in read_metrics(out) if "val_reward" in r]
    assert set(record) >= {"val_reward", "val_rewards/exact_answer/mean", "val_completions/mean_length"}
    assert 0 < record["val_completions/mean_length"] <= 12


BAD = [
    (
        {"rewards": [{"function": "nowhere_module:score"}]},
        "grpo.rewards[0]: reward nowhere_module:score: importing nowhere_module failed (ModuleNotFoundError",
    ),
    (
        {
            "rewards": [
                {"function": "tests.helpers.rewards:sometimes_none"},
                {"function": "tests.helpers.rewards:one_reward"},
            ]
        },
        "grpo.rewards[1]: reward tests.helpers.rewards:one_reward returned 1 rewards for 2 completions",
    ),
    (
        {"rewards": [{"function": "tests.test_grpo_runs:needs_solution"}]},
        "grpo.rewards[0]: reward tests.test_grpo_runs:needs_solution raised KeyError: 'solution' (tried on the first "
        "prompt of",
    ),
    ({"rewards": REWARDS, "num_generations": 1}, "grpo.num_generations=1: a group needs at least 2"),
    ({"rewards": REWARDS, "num_iterations": 0}, "grpo.num_iterations=0 must be >= 1"),
    ({"rewards": [], "reward_model": "/nowhere/run"}, "grpo.reward_model: checkpoint /nowhere/run does not exist"),
]


def needs_solution(completions, **columns):
    return [float(columns["solution"] == c) for c in completions]


@pytest.mark.parametrize(("settings", "message"), BAD)
def test_bad_rl_inputs_are_one_line_before_any_worker(prompts, tmp_path, settings, message):
    start = time.monotonic()
    proc = train_cli(run_args(prompts / "grpo.yaml", tmp_path / "run", 2, grpo=settings), check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and lines[-1].startswith("error: ") and message in lines[-1], proc.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    print(f"refused in {time.monotonic() - start:.1f} s")


def test_prompts_for_another_kind_and_other_data_for_grpo_are_refused_by_name(prompts, tiny_data, tmp_path):
    other = train_cli(run_args(prompts / "grpo.yaml", tmp_path / "a", 2), check=False)
    assert "holds prompts" in other.stderr and "name reward functions in grpo.rewards" in other.stderr, other.stderr
    text = train_cli(run_args(tiny_data, tmp_path / "b", 2, grpo=grpo()), check=False)
    assert "the grpo kind trains on prompts" in text.stderr and "--format prompts" in text.stderr, text.stderr
