"""Online RL's loss against TRL's GRPOTrainer: TRL samples completions of the same prompts, scores them with the same
reward functions and computes its advantages, old and reference log-probs; the policy then moves (its weights
perturbed, as after an optimizer step); TRL's loss and gradients and ours (our model holding the same weights, the
completions packed as our steps pack them) agree for every loss type, both importance-sampling levels and every
reward scale, and so do the advantages and the metrics TRL logs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fsdp_trainer.loss import POLICY_METRICS, PolicyLoss, PolicyObjective, group_advantages
from fsdp_trainer.model import ATTENTION_TILE, Transformer
from fsdp_trainer.rewards import (
    Reward,
    RewardError,
    exact_answer,
    final_answer,
    matching_characters,
    overlong_penalty,
    score,
)
from fsdp_trainer.steps.examples import packed

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

PROMPTS = ["To be, or not", "Now is the winter", "ROMEO. What light", "Friends, Romans"]
G = 4


FUNCTIONS = "tests.helpers.rewards"
"""Where the tests' reward functions are: a module of their own, which a run imports without this one."""
REWARDS = [Reward(f"{FUNCTIONS}:digit_reward"), Reward(f"{FUNCTIONS}:sometimes_none", weight=0.5)]


@pytest.fixture(scope="module")
def grpo_setup(trl_setup):
    """trl_setup's tokenizer and policy, saved where TRL loads a policy and its reference from."""
    tmp, tokenizer, policy, _, cfg = trl_setup
    path = tmp / "grpo_policy"
    policy.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tmp, tokenizer, path, cfg


def _trl_rollout(grpo_setup, policy: PolicyLoss, scale: str):
    """A GRPOTrainer on the saved policy, its first batch of rollouts with TRL's advantages and log-probs."""
    tmp, tokenizer, path, _ = grpo_setup
    args = trl.GRPOConfig(
        output_dir=str(tmp / "grpo_out"), per_device_train_batch_size=2 * G, num_generations=G,
        max_completion_length=policy.max_completion_length, temperature=policy.temperature, beta=policy.beta,
        loss_type=policy.loss_type, importance_sampling_level=policy.importance_sampling_level,
        epsilon=policy.epsilon, epsilon_high=policy.epsilon_high, scale_rewards=scale, num_iterations=2,
        reward_weights=[r.weight for r in REWARDS], report_to=[], use_cpu=True, bf16=False, disable_tqdm=True,
        model_init_kwargs={"dtype": torch.float32}, seed=0,
    )  # fmt: skip
    dataset = datasets.Dataset.from_list([{"prompt": p, "answer": str(i)} for i, p in enumerate(PROMPTS)])
    functions = [r.function for r in REWARDS]
    trainer = trl.GRPOTrainer(
        model=str(path), reward_funcs=functions, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    batch = next(iter(trainer.get_train_dataloader()))
    torch.manual_seed(0)
    inputs = trainer._prepare_inputs(batch)  # samples, scores, and computes the old and reference log-probs
    return trainer, batch, inputs


def _moved(model: torch.nn.Module) -> None:
    """The policy after an update: every weight moved by noise of 0.05 of its scale."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5 * param.std().nan_to_num(0.02) * torch.randn(param.shape, generator=generator))


def _completions(inputs) -> list[tuple[np.ndarray, np.ndarray]]:
    """TRL's rollouts as (prompt, completion) token arrays, the padding (left of prompts, right of completions) off."""
    out = []
    for row in range(len(inputs["prompt_ids"])):
        prompt = inputs["prompt_ids"][row][inputs["prompt_mask"][row].bool()].numpy()
        completion = inputs["completion_ids"][row][inputs["completion_mask"][row].bool()].numpy()
        out.append((prompt, completion))
    return out


CASES = [
    ("grpo", "token", "group", 0.04),
    ("bnpo", "token", "batch", 0.04),
    ("dr_grpo", "token", "none", 0.04),
    ("dapo", "token", "group", 0.04),
    ("cispo", "token", "group", 0.0),
    ("grpo", "sequence", "group", 0.04),
    ("dapo", "sequence", "batch", 0.0),
]


@pytest.mark.parametrize(("loss_type", "level", "scale", "beta"), CASES)
def test_loss_gradients_advantages_and_metrics_equal_trls(grpo_setup, loss_type, level, scale, beta):
    # Clip bounds the moved policy's ratios pass (a completion's mean log-ratio moves less than its tokens').
    epsilon, epsilon_high = {"token": (0.05, 0.08), "sequence": (0.01, 0.015)}[level]
    epsilon_high = 1.05 if loss_type == "cispo" else epsilon_high
    policy = PolicyLoss(loss_type, level, epsilon, epsilon_high, beta, temperature=0.7, max_completion_length=8)
    trainer, batch, inputs = _trl_rollout(grpo_setup, policy, scale)
    rollouts = _completions(inputs)
    tokenizer = grpo_setup[1]

    # The advantages, from our reward scoring of TRL's completions.
    completions = tokenizer.batch_decode([c for _, c in rollouts], skip_special_tokens=True)
    columns = {"answer": [record["answer"] for record in batch]}
    rewards = score(REWARDS, [r["prompt"] for r in batch], completions, [c.tolist() for _, c in rollouts], columns)
    weights = torch.tensor([r.weight for r in REWARDS])
    advantages, _, _ = group_advantages(torch.from_numpy(rewards).float(), weights, G, scale)
    torch.testing.assert_close(advantages, inputs["advantages"], rtol=1e-5, atol=1e-6)
    assert advantages.abs().max() > 0.1 and advantages[5] == 0  # rewards that differ; one completion unscored

    # TRL's loss and gradients after the policy moved.
    _moved(trainer.model)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by TRL's training loop, which this test does not run
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_grads = {name: p.grad for name, p in trainer.model.named_parameters()}
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    # Ours: the same weights, the rollouts packed into one window each as a step packs them.
    ours = Transformer(grpo_setup[3])
    missing, unexpected = ours.load_state_dict(trainer.model.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("rope_") for name in missing)
    mb = packed(rollouts, max(len(p) + len(c) for p, c in rollouts), torch.device("cpu"))
    mask = inputs["completion_mask"].bool()
    old, ref = inputs["old_per_token_logps"][mask], None if beta == 0 else inputs["ref_per_token_logps"][mask]
    objective = PolicyObjective(policy, mb.targets, mb.trained, mb.sequences, len(rollouts), advantages, old, ref)
    sums = ours(mb.inputs, mb.documents, loss=objective)
    _exact_on_the_same_log_probs(trainer, inputs, policy, objective)
    tokens = sums[1].item()
    units = {"completions": len(rollouts), "micro_batches": 1, "tokens": tokens}[policy.units]
    loss = sums[0] / units
    loss.backward()
    # Both forwards are fp32: their log-probs differ by ~1e-6 (their sums run in other orders), and the loss is a
    # difference of terms of the advantages' size (~1), so it agrees to that (measured: 1.1e-5 relative at worst);
    # each gradient to 1e-5 of its norm (measured: 5.3e-7 at worst), not element by element.
    print(f"{loss_type}/{level}/{scale}: ours {loss.item():.9g}, TRL {trl_loss.item():.9g}")
    assert loss.item() == pytest.approx(trl_loss.item(), rel=5e-5, abs=1e-8)
    assert abs(trl_loss.item()) > 1e-3  # something to compare
    worst = 0.0
    for name, param in ours.named_parameters():
        g, t = param.grad, trl_grads[name]
        gap = ((g - t).norm() / t.norm()).item()
        assert gap < 1e-5, name
        worst = max(worst, gap)
    print(f"largest gradient gap (norm-relative): {worst:.1e}")

    metrics = dict(zip(POLICY_METRICS, sums[1:].detach(), strict=True))
    clip_units = len(rollouts) if level == "sequence" else tokens
    assert metrics["entropy"].item() / tokens == pytest.approx(trl_metrics["entropy"], rel=1e-5)
    if beta:
        assert metrics["kl"].item() / tokens == pytest.approx(trl_metrics["kl"], rel=1e-5)
    names = {"cispo": {"clip_ratio/region_mean": "cispo_clip_ratio"}}.get(loss_type, {m: m for m in POLICY_METRICS[3:]})
    for ours_name, trl_name in names.items():
        assert metrics[ours_name].item() / clip_units == pytest.approx(trl_metrics[trl_name], abs=1e-7), ours_name
    assert any(trl_metrics[name] > 0 for name in names.values())  # some ratio clipped: the clip is exercised


def _exact_on_the_same_log_probs(trainer, inputs, policy: PolicyLoss, objective: PolicyObjective) -> None:
    """The loss itself, without the two forwards' float noise: TRL's and ours on the same log-probs (a leaf), equal
    with their gradients to 1e-6 relative."""
    mask = inputs["completion_mask"].bool()
    logps = inputs["old_per_token_logps"] + 0.3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    logps = logps.masked_fill(~mask, 0).requires_grad_()
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, torch.zeros_like(logps), None)
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, logps)
    ours_logps = logps.detach()[mask].requires_grad_()
    o = objective
    sequences = o.sequences.flatten().index_select(0, o.trained)
    losses, _, _ = policy.token_losses(ours_logps, o.old, o.ref, o.advantages, sequences, o.n_sequences, o.weights)
    units = {"completions": o.n_sequences, "micro_batches": 1, "tokens": len(ours_logps)}[policy.units]
    loss = policy.summed(losses, sequences, o.n_sequences) / units
    (grad,) = torch.autograd.grad(loss, ours_logps)
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(grad, trl_grad[mask], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    ("loss_type", "level", "mode"),
    [("grpo", "token", "token_truncate"), ("dapo", "sequence", "sequence_mask"), ("bnpo", "token", "token_mask")],
)
def test_the_samplers_correction_weighs_each_token_as_trls(grpo_setup, loss_type, level, mode):
    """grpo.sampler_correction: each token's weight from the sampler's and the trainer's log-probs is TRL's
    importance-sampling ratio (its vLLM correction's formula, each mode), and the loss it weighs (the policy term,
    not the KL) is TRL's with that ratio, gradients included."""
    from fsdp_trainer.config import GRPOConfig
    from fsdp_trainer.steps.rollout_buffer import sampler_weights

    policy = PolicyLoss(loss_type, level, 0.05, 0.08, 0.04, temperature=0.7, max_completion_length=8)
    trainer, batch, inputs = _trl_rollout(grpo_setup, policy, "group")
    mask = inputs["completion_mask"].bool()
    old = inputs["old_per_token_logps"]
    noise = 0.4 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
    sampler = (old + noise).masked_fill(~mask, 0)
    low, high = 0.7, 1.4
    cfg = GRPOConfig(sampler_correction=mode, sampler_correction_min=low, sampler_correction_max=high)
    differences = [(old[row] - sampler[row])[mask[row]] for row in range(len(mask))]
    weights = sampler_weights(cfg, differences, torch.device("cpu"))
    # TRL's ratio, as its generation computes it for vLLM's log-probs
    diff = (old - sampler) * mask
    ratio = (diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff).exp()
    outside = (ratio < low) | (ratio > high)
    ratio = ratio.clamp(low, high) if mode.endswith("truncate") else ratio.masked_fill(outside, 0)
    torch.testing.assert_close(weights, ratio.expand_as(mask)[mask], rtol=1e-6, atol=0)
    assert 0 < (weights == (high if mode.endswith("truncate") else 0)).float().mean() < 1  # the bounds bite

    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    inputs["importance_sampling_ratio"], inputs["sampling_per_token_logps"] = ratio, sampler
    rollouts = _completions(inputs)
    mb = packed(rollouts, max(len(p) + len(c) for p, c in rollouts), torch.device("cpu"))
    advantages = inputs["advantages"]
    objective = PolicyObjective(
        policy, mb.targets, mb.trained, mb.sequences, len(rollouts), advantages, old[mask],
        inputs["ref_per_token_logps"][mask], weights=weights,
    )  # fmt: skip
    _exact_on_the_same_log_probs(trainer, inputs, policy, objective)


def test_dynamic_sampling_keeps_the_first_groups_that_differ_then_fills_with_alike_ones():
    """rollouts.selected: of every group sampled, in order, the first whose rewards differ, renumbered from 0; when
    too few differ, the first alike ones fill the rest; advantages (batch-scaled here) and the reward metrics are
    those of the groups kept."""
    from fsdp_trainer.config import GRPOConfig, RewardFunction
    from fsdp_trainer.steps.rollout_buffer import RolloutBuffer, as_group
    from fsdp_trainer.steps.rollouts import Rollouts, selected

    cfg = GRPOConfig([RewardFunction(f"{FUNCTIONS}:digit_reward", weight=2.0)], num_generations=2)
    cfg.scale_rewards = "batch"
    rollouts = Rollouts(cfg, 0, "no tokenizer is read")
    scores = {0: (0, 0), 1: (0, 1), 2: (1, 1), 3: (2, 0), 4: (1, 0)}

    def sampled() -> RolloutBuffer:
        groups = {
            g: as_group([7, g], [[g], [g, 1]], [[-1.0], [-1.0, -2.0]], torch.tensor([[a], [b]]), torch.zeros(2), [0, 1])
            for g, (a, b) in scores.items()
        }
        return RolloutBuffer(cfg, 1, 2, groups, {})

    kept = selected(rollouts, sampled(), 2)
    assert [group["prompt"].tolist() for group in kept.groups.values()] == [[7, 1], [7, 3]]
    assert list(kept.groups) == [0, 1]
    rewards = torch.tensor([[0.0], [1.0], [2.0], [0.0]])
    expected, _, _ = group_advantages(rewards, torch.tensor([2.0]), 2, "batch")
    torch.testing.assert_close(torch.cat([g["advantages"] for g in kept.groups.values()]), expected)
    assert kept.stats["reward"] == pytest.approx(1.5) and kept.stats["frac_reward_zero_std"] == 0
    assert kept.stats["sampling/prompts_sampled"] == 5 and kept.stats["completions/clipped_ratio"] == 0.5

    cfg.scale_rewards = "group"  # (frac_reward_zero_std is of the std the advantages are scaled by, as TRL's)
    short = selected(rollouts, sampled(), 4)  # three differ: the first alike group fills the fourth place
    assert [group["prompt"][1].item() for group in short.groups.values()] == [1, 3, 4, 0]
    assert short.stats["frac_reward_zero_std"] == 0.25


@pytest.mark.parametrize(
    ("family", "length"), [("qwen3", 40), ("qwen3", 300), ("mistral", 40), ("gemma3", 300)]
)  # fmt: skip
def test_a_prompt_packed_once_for_its_completions_gives_each_the_logits_of_its_own_copy(family, length):
    """grpo.share_prompts: groups packed as trees (packed_tree: a prompt once, each completion after it, seeing it
    through `shared`) give every completion token the log-probability and entropy, and the model the gradient, that
    a copy of the prompt before each completion gives (packed); in windows of 40 (a group split over rows) and of
    300 (the CPU's tiled attention), with sliding windows shorter than a completion's context (Mistral, Gemma 3)."""
    from fsdp_trainer.config import ModelConfig
    from fsdp_trainer.loss import token_logps
    from fsdp_trainer.steps.examples import packed_tree
    from tests.helpers import TINY_MODEL

    window = {"mistral": {"sliding_window": 6}, "gemma3": {"sliding_window": 6, "sliding_window_pattern": 2}}
    cfg = ModelConfig(**{**TINY_MODEL, "family": family, "max_seq_len": 512, **window.get(family, {})})
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(seed=1)
    rng = np.random.default_rng(0)
    scale = 4 if length == 300 else 1  # at 300, two windows of 176 (packed as short as keeps them), 2 tiles each
    lengths = [(5, [3, 7, 1]), (1, [4]), (9, [6, 2, 5, 3]), (12, [8, 8])]
    groups = [
        (rng.integers(3, 500, p * scale), [rng.integers(3, 500, a * scale) for a in answers]) for p, answers in lengths
    ]  # fmt: skip
    flat = [(prompt, answer) for prompt, answers in groups for answer in answers]

    def forward(batch):
        model.zero_grad()
        objective = lambda hidden, output: token_logps(hidden, output, batch.targets, batch.trained, 0.7)  # noqa: E731
        logps, entropy = model(batch.inputs, batch.documents, loss=objective, shared=batch.shared)
        logps.sum().backward()
        return logps.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    tree = packed_tree(groups, length, torch.device("cpu"))
    ours, copies = forward(tree), forward(packed(flat, length, torch.device("cpu")))
    torch.testing.assert_close(ours[0], copies[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1], copies[1], rtol=1e-5, atol=1e-5)
    for name, grad in ours[2].items():
        assert (grad - copies[2][name]).norm() <= 1e-5 * copies[2][name].norm(), name
    flat_sequences = packed(flat, length, torch.device("cpu")).sequences
    assert sorted(tree.sequences[tree.sequences >= 0].tolist()) == sorted(flat_sequences[flat_sequences >= 0].tolist())
    if length == 300:
        assert tree.inputs.shape == (2, 176) and ATTENTION_TILE < 176


@pytest.mark.parametrize("tree", [False, True])
def test_packed_windows_are_the_shortest_that_keep_their_number(tree):
    """A micro-batch's examples are packed in order into as few windows of `length` as hold them, each then as short
    as keeps that number (a multiple of 16): no trained token is lost or moved to another example, and every shorter
    multiple of 16 needs more windows (the greedy packing's own count, tried at each)."""
    from fsdp_trainer.steps.examples import WIDTH_STEP, example_rows, packed_tree, tree_rows

    rng = np.random.default_rng(1)
    groups = [(rng.integers(3, 500, rng.integers(2, 30)), [rng.integers(3, 500, rng.integers(1, 13)) for _ in range(8)])
              for _ in range(4)]  # fmt: skip
    flat = [(prompt, answer) for prompt, answers in groups for answer in answers]
    length, cpu = 160, torch.device("cpu")
    batch = packed_tree(groups, length, cpu) if tree else packed(flat, length, cpu)
    layout = (lambda w: tree_rows(groups, w)) if tree else (lambda w: example_rows(flat, w))
    rows, width = batch.inputs.shape
    assert rows == len(layout(length)) > 1 and width % WIDTH_STEP == 0 and width < length
    assert all(len(layout(w)) > rows for w in range(WIDTH_STEP, width, WIDTH_STEP))
    sequences = batch.sequences[batch.sequences >= 0]
    assert torch.equal(batch.targets[batch.sequences >= 0], torch.from_numpy(np.concatenate([a for _, a in flat])))
    assert sequences.tolist() == [k for k, (_, answer) in enumerate(flat) for _ in answer]


def test_reward_functions_fail_in_one_line_naming_them():
    prompts, completions, ids = ["p", "p"], ["a", "b"], [[1], [2]]
    with pytest.raises(RewardError, match=r"^reward nowhere_module:f: importing nowhere_module failed \("):
        score([Reward("nowhere_module:f")], prompts, completions, ids, {})
    with pytest.raises(RewardError, match=rf"^reward {FUNCTIONS}:missing: {FUNCTIONS} has no function missing$"):
        score([Reward(f"{FUNCTIONS}:missing")], prompts, completions, ids, {})
    with pytest.raises(RewardError, match=r"^reward digit_reward is not an import path: write it as module:function$"):
        score([Reward("digit_reward")], prompts, completions, ids, {})
    with pytest.raises(RewardError, match=rf"^reward {FUNCTIONS}:sometimes_none raised TypeError: .*'answer'"):
        score([Reward(f"{FUNCTIONS}:sometimes_none")], prompts, completions, ids, {})  # no answer column
    with pytest.raises(RewardError, match=rf"^reward {FUNCTIONS}:one_reward returned 1 rewards for 2 completions: "):
        score([Reward(f"{FUNCTIONS}:one_reward")], prompts, completions, ids, {})
    with pytest.raises(RewardError, match=rf"^reward {FUNCTIONS}:texts returned 'a' for completion 0: a reward is"):
        score([Reward(f"{FUNCTIONS}:texts")], prompts, completions, ids, {})


def test_builtin_rewards():
    assert final_answer("so 3 + 4 = 7 #### 1,000.0") == "1000"
    assert final_answer(r"thus \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert final_answer("#### cba\nmore") == "cba" and final_answer("no answer") is None
    gold = ["Natalia sold 48 ... #### 72"] * 3 + [""]
    assert exact_answer(["#### 72", r"\boxed{72}", "#### 71", "#### 1"], gold) == [1.0, 1.0, 0.0, None]
    # Partial credit: the characters of the answer at their places, over the longer of the two.
    assert matching_characters(["#### 1284", "#### 1294", "no answer", "#### 12845"], ["1284"] * 4) == [1, 0.75, 0, 0.8]
    # TRL's get_soft_overlong_punishment: 0 up to 80 tokens, -0.5 at 90, -1 past 100.
    assert overlong_penalty([[1] * 80, [1] * 90, [1] * 101], max_length=100, buffer=20) == [0.0, -0.5, -1.0]
    bound = Reward("fsdp_trainer.rewards:overlong_penalty", args={"max_length": 100, "buffer": 20})
    assert score([bound], ["p"], ["c"], [[1] * 90], {}).tolist() == [[-0.5]]


def test_math_equal_agrees_with_trls_accuracy_reward():
    """fsdp_trainer.rewards:math_equal against TRL's accuracy_reward (both math-verify) on boxed answers, equal in
    value and written otherwise; GSM8K's `#### n` and a gold answer of bare LaTeX read too, which TRL's do not."""
    from trl.rewards import accuracy_reward

    from fsdp_trainer.rewards import math_equal

    gold = ["0.5", r"\frac{1}{3}", "72", "2", r"\sqrt{2}", "3"]
    texts = [r"so \boxed{\frac{1}{2}}", r"\boxed{0.3333}", r"\boxed{72}", r"\boxed{3}", r"\boxed{2^{1/2}}", "no answer"]
    messages = [[{"role": "assistant", "content": text}] for text in texts]
    ours = math_equal(messages, gold)
    assert ours[:4] == accuracy_reward(messages, gold)[:4] == [1.0, 0.0, 1.0, 0.0]
    # a gold answer of bare LaTeX: TRL's skips it (None), ours reads it as math
    assert accuracy_reward(messages, gold)[4:] == [None, 0.0] and ours[4:] == [1.0, 0.0]
    assert math_equal(["#### 0.50", "#### 1/2", "#### 7"], ["1/2", "Steps... #### 0.5", ""]) == [1.0, 1.0, None]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, None, 1.0), (0.5, 4, 1.0), (1.0, None, 0.8)])
def test_the_sampler_draws_each_token_with_its_probability_and_each_row_alone(temperature, top_k, top_p):
    """generation.draw over 20,000 rows of the same logits: each token's share is its probability after the
    temperature, top-k and top-p (as transformers' warpers keep them); a row's token depends on its own generator
    only, not on the rows beside it."""
    from fsdp_trainer.generation import draw, truncated

    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    rows = 20_000
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    drawn = draw(logits.expand(rows, -1), temperature, top_k, generators, top_p)
    expected = torch.softmax(truncated(logits / temperature, top_k, top_p), dim=-1)
    shares = torch.bincount(drawn, minlength=len(logits)).float() / rows
    assert torch.allclose(shares, expected, atol=0.012), (shares, expected)
    assert (shares[expected == 0] == 0).all()
    alone = draw(logits[None], temperature, top_k, [torch.Generator().manual_seed(7)], top_p)
    assert alone.item() == drawn[7].item()
