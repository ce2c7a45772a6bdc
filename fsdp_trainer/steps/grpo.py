"""Online RL with verifiable rewards: GRPO and its family (DAPO, Dr. GRPO, GSPO, CISPO), as TRL's GRPOTrainer
defines them (config.GRPOConfig, loss.PolicyLoss).

A step samples num_generations completions of each of its prompts with the model being trained, scores them and
computes their advantages (rollouts.py), then trains on them micro-batch by micro-batch: the reference's log-probs
first where grpo.beta > 0 (the policy with its adapters off, or a frozen copy of the model the run started from),
then the policy's forward and backward through loss.PolicyObjective. The policy that sampled is the one trained
(one optimizer step a rollout: TRL's num_iterations 1), so the importance ratios are the policy's own log-probs
against themselves detached, and the largest difference between what the sampler and the trainer computed of a
sampled token is logged every step (sampling/sampling_logp_difference/max: float noise, not drift).

Evaluation samples one completion of each validation prompt greedily and reports the rewards (val_reward, ...).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_trainer.config import GRPOConfig
from fsdp_trainer.data.format import first_record
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import SHARDING, ShardingPlan, reshard
from fsdp_trainer.distributed.runtime import DistEnv, sum_over_ranks
from fsdp_trainer.generation import SamplingShape
from fsdp_trainer.loss import POLICY_METRICS, PolicyLoss, PolicyObjective, TokenLogProbs
from fsdp_trainer.rewards import RewardError, score
from fsdp_trainer.steps.base import Kind, Step, accumulate
from fsdp_trainer.steps.on_policy import rehearse
from fsdp_trainer.steps.reference import Reference
from fsdp_trainer.steps.reward_model import RewardModel, check_reward_model, reward_model_params
from fsdp_trainer.steps.rollout_buffer import (
    Rollout,
    RolloutBuffer,
    cycle,
    keeps_sampling_logps,
    load_buffer,
    sampler_gap,
    save_buffer,
)
from fsdp_trainer.steps.rollouts import Rollouts, alike, evaluate, rewards_of, selected, training_window


def probe(recipe: Any) -> None:
    """Each reward function imports, and scores two empty-ish completions of the first training prompt: RewardError
    (one line naming it) when it does not, before any worker starts."""
    record = first_record(recipe.data.train_path)
    prompt = record["prompt"]
    texts: list = ["", "0"]
    if isinstance(prompt, list):
        texts = [[{"role": "assistant", "content": text}] for text in texts]
    columns = {key: [value, value] for key, value in record.items() if key != "prompt"}
    for k, reward in enumerate(rewards_of(recipe.grpo)):
        try:
            score([reward], [prompt, prompt], texts, [[0], [0]], columns)
        except RewardError as e:
            raise RewardError(
                f"grpo.rewards[{k}]: {e} (tried on the first prompt of {recipe.data.train_path} with the completions "
                "'' and '0')"
            ) from None


def trl_means(numbers: dict[str, torch.Tensor], cfg: GRPOConfig) -> dict[str, torch.Tensor]:
    """TRL's metrics from the global means of the sums (each over the loss's units): KL and entropy per token, the
    clipped shares per token (per completion at the sequence level)."""
    tokens, completions = numbers.pop("tokens"), numbers.pop("completions")
    out = {"entropy": numbers.pop("entropy") / tokens}
    kl = numbers.pop("kl") / tokens
    if cfg.beta:
        out["kl"] = kl
    over = completions if cfg.importance_sampling_level == "sequence" else tokens
    clipped = {name: numbers.pop(name) / over for name in POLICY_METRICS[3:]}
    if cfg.loss_type == "cispo":
        out["cispo_clip_ratio"] = clipped["clip_ratio/region_mean"]
    else:
        out.update(clipped)
    return {**numbers, **out}


class GRPO(Kind):
    """What the house asks of online RL before its step is built: the kind, its data, its checks and its price."""

    name = "grpo"
    chosen_by = "name reward functions in grpo.rewards (or a reward model in grpo.reward_model)"
    trains_on = "prompts"
    prepared_with = "tools/prepare_data.py --format prompts"
    metrics = (*POLICY_METRICS, "completions")  # sums; __call__ turns them into TRL's means
    shown = {"reward": "reward"}

    @classmethod
    def wanted(cls, recipe: Any) -> bool:
        cfg = getattr(recipe, "grpo", None)
        return cfg is not None and (bool(cfg.rewards) or cfg.reward_model is not None)

    @classmethod
    def check(cls, recipe: Any) -> None:
        if recipe.data.mixture:
            raise ValueError(
                "grpo reads each prompt's record from its file, and data.mixture draws from several: set "
                "data.train_path to one file of prompts"
            )
        probe(recipe)
        if recipe.grpo.reward_model is not None:
            check_reward_model(recipe.grpo.reward_model)

    @classmethod
    def frozen_params(cls, recipe: Any, n_params: int, adapted: bool) -> int:
        """The reference where beta > 0 (none with adapters: the policy with them off), and the reward model."""
        return (0 if recipe.grpo.beta == 0 or adapted else n_params) + reward_model_params(recipe)

    @classmethod
    def forward_params(cls, recipe: Any, n_params: int) -> int:
        """The reference's forward where beta > 0; once a sampling (in 1 / num_iterations of the steps), the policy's
        without gradient where its log-probs then are kept, and the reward model's."""
        cfg = recipe.grpo
        scored = (n_params if keeps_sampling_logps(cfg) else 0) + reward_model_params(recipe)  # once a sampling
        return (n_params if cfg.beta > 0 else 0) + scored // cfg.num_iterations

    @classmethod
    def trained_rows(cls, recipe: Any) -> int:
        """A window a completion: a micro-batch of prompts trains num_generations windows of each (at most)."""
        return recipe.data.micro_batch_size * recipe.grpo.num_generations

    @classmethod
    def sampling(cls, recipe: Any) -> SamplingShape:
        data, cfg = recipe.data, recipe.grpo
        return SamplingShape(
            data.micro_batch_size, cfg.num_generations, data.seq_len, cfg.max_completion_length, data.grad_accum_steps,
            share=1 / cfg.num_iterations,  # each step's prompts sampled once for num_iterations passes
        )  # fmt: skip

    @classmethod
    def plan_note(cls, recipe: Any, estimates: list) -> str:
        g, data = recipe.grpo.num_generations, recipe.data
        shape, sampling_gb = cls.sampling(recipe), max(e.sampling_gb for e in estimates)
        return (
            f"grpo: a micro-batch of {data.micro_batch_size} prompts trains their {g} completions each, "
            f"{shape.rows} windows of {data.seq_len} (the rows' activations and logits); a step first samples them "
            f"with the model gathered whole, a KV cache and a decode pass's logits, "
            f"{sampling_gb:.2f} GB beside the sharded state (`sampling`, "
            f"in each row's peak), its {shape.new_tokens} decode passes a micro-batch priced by the bytes they read "
            "(in the predicted step time: a floor, since an eager pass over a small model waits on kernel launches, "
            f"which are not priced){'; and the reference model as DPO holds it' if recipe.grpo.beta else ''}"
        )

    @classmethod
    def fake_batch(cls, batch: MicroBatch) -> MicroBatch:
        """A window that is one completion trained on every position (the planner's shapes)."""
        inputs = batch.inputs
        rows, length = inputs.shape
        sequences = torch.arange(rows, device=inputs.device)[:, None].expand(rows, length).contiguous()
        trained = torch.arange(rows * length, device=inputs.device)
        return MicroBatch(inputs, batch.targets, torch.ones_like(inputs), sequences, trained=trained)


def policy_loss(cfg: GRPOConfig) -> PolicyLoss:
    """The loss the grpo section names."""
    return PolicyLoss(
        cfg.loss_type, cfg.importance_sampling_level, cfg.epsilon, cfg.epsilon_high, cfg.beta, cfg.temperature,
        cfg.max_completion_length, cfg.use_bias_correction_kl,
    )  # fmt: skip


def loss_units(step: GRPOStep, micro_batches: list[MicroBatch], world: int) -> torch.Tensor | float:
    """What the loss type averages over: the global batch's micro-batches, its sampled completions (those
    mask_truncated_completions keeps out too, as TRL counts them) or its trained tokens (with several steps a
    sampling, as TRL: the sampling's tokens over its steps)."""
    what, device, cfg = step.policy.units, micro_batches[0].inputs.device, step.cfg
    if what == "micro_batches":
        return float(len(micro_batches) * world)
    if what == "tokens" and cfg.steps_per_generation > 1 and step.step > 0:
        return torch.tensor(step.samplings.buffer.trained_tokens() / cfg.steps_per_generation, device=device)
    if what == "completions":
        local = sum(step.current[id(b.inputs)].sampled for b in micro_batches)
    else:
        local = sum(len(b.trained) for b in micro_batches)
    return sum_over_ranks(torch.tensor(float(local), device=device))


def planned_rollouts(model: nn.Module, batches: list[MicroBatch], plan: ShardingPlan, cfg: GRPOConfig) -> list[Rollout]:
    """The planner's step on fake tensors: what sampling the first micro-batch's prompts would allocate (nothing can
    be drawn there), then its micro-batches of completions (GRPO.fake_batch's) as rollouts whose advantages are 0."""
    inputs, g = batches[0].inputs, cfg.num_generations
    prompt = max(1, inputs.shape[1] - cfg.max_completion_length)
    rehearse(model, plan, inputs[: max(1, inputs.shape[0] // g), :prompt], g, inputs.shape[1])
    rows = inputs.shape[0]
    return [Rollout(batch, torch.zeros(rows, device=inputs.device), None, rows) for batch in batches]


class Samplings:
    """Which steps sample and what each step trains on: a step that samples reads the prompts of
    grpo.steps_per_generation steps and keeps their completions (`buffer`) for the steps that train on them,
    num_iterations times over; a checkpoint between them carries the buffer (state_dict, as a Stateful)."""

    def __init__(self, cfg: GRPOConfig, rollouts: Rollouts, data: Any, world_size: int, device, chunks: int = 1):
        self.cfg, self.rollouts, self.chunks, self.device = cfg, rollouts, chunks, device
        self.micro_batch_size, self.seq_len = data.micro_batch_size, data.seq_len
        self.per_step = data.micro_batch_size * data.grad_accum_steps * world_size  # a global batch's prompts
        self.buffer: RolloutBuffer | None = None
        self.step, self.files, self.loader = 0, {}, None

    def read(self, loader: Any, step: int) -> list[MicroBatch]:
        """At a step that samples, the prompts of grpo.steps_per_generation steps; none at the steps that train on
        what an earlier one sampled. (dynamic_sampling reads more from `loader` as it samples.)"""
        self.step, self.loader = step, loader
        if self.buffer is not None and self.buffer.covers(step):
            return []
        return [batch for _ in range(self.cfg.steps_per_generation) for batch in loader.next_batch()]

    def state_dict(self) -> dict[str, bytes]:
        """What the steps after this one train on, when a later step does (the buffer, whole)."""
        later = self.buffer is not None and self.buffer.covers(self.step + 1)
        return {"buffer": save_buffer(self.buffer if later else None)}

    def load_state_dict(self, state: dict[str, bytes]) -> None:
        self.buffer = load_buffer(self.cfg, state["buffer"], self.per_step)

    def at(self, step: int, model: nn.Module, batches: list[MicroBatch], plan: ShardingPlan, world: int):
        """(this rank's rollouts at `step`, the metrics of their sampling), sampling `batches` first if the step read
        any."""
        if batches:
            self.sample(model, batches, plan, world)
        return self.trained_at(step, model, world), self.buffer.stats

    def sample(self, model: nn.Module, batches: list[MicroBatch], plan: ShardingPlan, world: int) -> None:
        """The completions of the prompts read, scored (dynamic_sampling: refilled); the policy's log-probs of them
        now where kept; the buffer gathered whole where a later step trains on it."""
        self.buffer = buffer = self.sampled(model, batches, plan, world)
        if self.cfg.dynamic_sampling:
            self.buffer = buffer = refilled(self, model, buffer, plan, world)
        k = self.cfg.steps_per_generation
        if keeps_sampling_logps(self.cfg):
            for j in range(k):
                self.keep_old(model, self.step + j, world)
            reshard(model)
            buffer.stats.update(sampler_gap(buffer, self.cfg, self.device))
        if cycle(self.cfg) > 1:  # the groups this rank trains, with the log-probs it took of them, to every rank
            rank = dist.get_rank() if world > 1 else 0
            shares = [buffer.share(self.step + j, rank, world, self.micro_batch_size) for j in range(k)]
            buffer.gather([g for share in shares for chunk in share for g in chunk])

    def sampled(self, model: nn.Module, batches: list[MicroBatch], plan: ShardingPlan, world: int, first: int = 0):
        """The rank's completions of `batches` of prompts, scored, numbered from `first` on."""
        records = [self.files["train"].columns(batch.windows.tolist()) for batch in batches]
        return self.rollouts(model, batches, plan, self.step, records, len(batches) * world, first)

    @torch.no_grad()
    def keep_old(self, model: nn.Module, step: int, world: int) -> None:
        """The policy's log-probs, now, of the completions this rank trains at `step` (a forward without gradient)."""
        for rollout in self.trained_at(step, model, world):
            batch = rollout.batch
            objective = TokenLogProbs(batch.targets, batch.trained, self.cfg.temperature, self.chunks)
            self.buffer.keep_old(rollout, model(batch.inputs, batch.documents, loss=objective, shared=batch.shared))

    def trained_at(self, step: int, model: nn.Module, world: int) -> list[Rollout]:
        """This rank's rollouts of the buffer at `step`."""
        rank = dist.get_rank() if world > 1 else 0
        window = training_window(self.seq_len, self.cfg.num_generations, model.cfg.max_seq_len)
        share = self.buffer.share(step, rank, world, self.micro_batch_size)
        return self.buffer.rollouts(share, window, self.device)


def refilled(
    samplings: Samplings, model: nn.Module, buffer: RolloutBuffer, plan: ShardingPlan, world: int
) -> RolloutBuffer:
    """DAPO's dynamic sampling: the prompts of further global batches sampled until the groups whose rewards
    differ fill the sampling (or dynamic_sampling_batches more were read), then cut to it (rollouts.selected);
    every rank holds every group."""
    wanted = samplings.per_step * samplings.cfg.steps_per_generation
    buffer.gather(list(buffer.groups))
    for _ in range(samplings.cfg.dynamic_sampling_batches):
        if alike(buffer, samplings.rollouts.weights).count(False) >= wanted:
            break
        more = samplings.sampled(model, samplings.loader.next_batch(), plan, world, first=len(buffer.groups))
        more.gather(list(more.groups))
        buffer.groups.update(more.groups)
    return selected(samplings.rollouts, buffer, wanted)


class GRPOStep(GRPO, Step):
    """A step's rollouts (Samplings'), then the losses of its micro-batches of completions; the loss is averaged as
    grpo.loss_type says over the global batch, the metrics are TRL's."""

    def __init__(
        self, cfg: GRPOConfig, samplings: Samplings, reference: Reference | None, plan: ShardingPlan, chunks=1
    ):
        super().__init__()
        self.cfg, self.samplings, self.reference, self.plan, self.chunks = cfg, samplings, reference, plan, chunks
        self.policy = policy_loss(cfg)
        self.starts += reference.starts() if reference is not None else []
        self.step, self.current, self.gap = 0, {}, None

    @classmethod
    def build(cls, recipe: Any, env: DistEnv, policy: nn.Module) -> GRPOStep:
        scorer = RewardModel.build(recipe, env) if recipe.grpo.reward_model is not None else None
        rollouts = Rollouts(recipe.grpo, recipe.train.seed, recipe.data.tokenizer_path, scorer)
        chunks = recipe.train.loss_chunks
        samplings = Samplings(recipe.grpo, rollouts, recipe.data, env.world_size, env.device, chunks)
        reference = Reference.build(recipe, env, policy) if recipe.grpo.beta > 0 else None
        step = cls(recipe.grpo, samplings, reference, SHARDING[recipe.parallel.sharding], chunks)
        step.starts += [scorer.start()] if scorer else []
        return step

    def prepare(self, recipe: Any, env: DistEnv, files: dict[str, Any], records: dict[str, bytes]) -> None:
        self.samplings.files = files  # the prompts' records are read from them

    def begin(self, step: int) -> None:
        self.step = step

    def read(self, loader: Any) -> list[MicroBatch]:
        return self.samplings.read(loader, self.step)

    def carried(self) -> dict[str, Any]:
        return {"rollouts": self.samplings} if cycle(self.cfg) > 1 else {}

    def __call__(
        self, model: nn.Module, micro_batches: list[MicroBatch], plan: ShardingPlan, backward, world: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """Step.__call__ on the rollouts this step trains on: of its micro-batches of prompts, sampled now (a step
        that samples), or of an earlier step's (Samplings)."""
        self.plan, self.gap = plan, None
        if self.step == 0:  # a step never begun (the planner's, on fake tensors): its batches are completions
            rollouts, stats = planned_rollouts(model, micro_batches, plan, self.cfg), {}
        else:
            rollouts, stats = self.samplings.at(self.step, model, micro_batches, plan, world)
        self.current = {id(r.batch.inputs): r for r in rollouts}
        loss, numbers = accumulate(self, model, [r.batch for r in rollouts], plan, backward, world)
        if self.gap is not None:  # the sampler against this step's forward, the weights it sampled with
            dist.all_reduce(self.gap, op=dist.ReduceOp.MAX)
            stats = {**stats, "sampling/sampling_logp_difference/max": self.gap}
        return loss, {**trl_means(numbers, self.cfg), **stats}

    def units(self, micro_batches: list[MicroBatch], world: int) -> torch.Tensor | float:
        return loss_units(self, micro_batches, world)

    def sums(self, model: nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's loss summed as the loss type says; the sums of POLICY_METRICS and its completions)."""
        rollout, ref = self.current[id(batch.inputs)], None
        n = len(rollout.advantages)
        if self.reference is not None:  # its log-probs at the sampling temperature, as the policy's
            at = TokenLogProbs(batch.targets, batch.trained, self.cfg.temperature, self.chunks)
            ref = self.reference.logps(batch, at)
        sampled = rollout.sampled_logps if rollout.old_logps is None else None  # else measured at sampling
        objective = PolicyObjective(
            self.policy, batch.targets, batch.trained, batch.sequences, n, rollout.advantages, rollout.old_logps, ref,
            self.chunks, sampled, rollout.weights,
        )  # fmt: skip
        sums = model(batch.inputs, batch.documents, loss=objective, shared=batch.shared)
        if objective.gap is not None:
            self.gap = objective.gap if self.gap is None else torch.maximum(self.gap, objective.gap)
        completions = torch.tensor([float(n)], device=sums.device)
        return sums[:1], torch.cat([sums[1:].detach(), completions])

    @torch.no_grad()
    def evaluate(self, model: nn.Module, micro_batches: list[MicroBatch]) -> dict[str, torch.Tensor | float]:
        """The rewards of one greedy completion of each validation prompt, over every rank's: val_reward and each
        function's mean, and the completions' mean length."""
        records = [self.samplings.files["val"].columns(batch.windows.tolist()) for batch in micro_batches]
        return evaluate(self.samplings.rollouts, model, micro_batches, self.plan, records)
