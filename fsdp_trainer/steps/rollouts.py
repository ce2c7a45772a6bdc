"""Online RL's rollouts: the completions the model being trained samples from a step's prompts, their rewards and
advantages, kept by group for the steps that train on them (rollout_buffer.py).

A micro-batch of prompts data holds a prompt a window (prepared with --format prompts), each with its record (the
prompt as the user wrote it, text or messages, and the other columns the reward functions read). Every rank samples
num_generations completions of each of its prompts with its model's weights gathered once for all of a sampling (the
prompts of grpo.steps_per_generation steps; held_gathered), each prompt read once into the KV cache and shared by its
completions (generation.sample_groups). Completion i of a prompt draws from a generator seeded by (train.seed, the
step that samples, the prompt's window in its file, i): its tokens do not depend on the rank, micro-batch or
neighbours it was given, so 2 ranks sample what 1 process does and a resumed run samples what the uninterrupted one
did.

The reward functions run on each rank's own completions; the rewards (a number per completion and function) are then
gathered to every rank in the order one process would hold them, so the advantages (whole groups on one rank; with
scale_rewards batch, the std of the global batch) and the reward metrics are the same everywhere, bitwise.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_trainer.config import GRPOConfig
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import ShardingPlan, held_gathered
from fsdp_trainer.generation import sample_groups
from fsdp_trainer.loss import group_advantages, nanstd, weighted_rewards
from fsdp_trainer.rewards import Reward, score
from fsdp_trainer.steps.on_policy import stop_ids as answer_ends
from fsdp_trainer.steps.reward_model import RewardModel
from fsdp_trainer.steps.rollout_buffer import RolloutBuffer, as_group, lengths_and_cuts
from fsdp_trainer.tokenizer import Tokenizer, load_tokenizer


def rewards_of(cfg: GRPOConfig) -> list[Reward]:
    """The recipe's reward functions (imported when first called)."""
    return [Reward(r.function, r.weight, dict(r.args)) for r in cfg.rewards]


def prompts_of(batch: MicroBatch) -> list[np.ndarray]:
    """The prompt of each window of a micro-batch of prompts data: its tokens before the padding's START."""
    inputs, documents = batch.inputs.cpu().numpy(), batch.documents.cpu().numpy()
    return [inputs[row, documents[row] == documents[row, 0]] for row in range(inputs.shape[0])]


class Rollouts:
    """A step's sampling, scoring and advantages (`__call__`), for the rank's micro-batches of prompts."""

    def __init__(self, cfg: GRPOConfig, seed: int, tokenizer_path: str, reward_model: RewardModel | None = None):
        self.cfg, self.seed, self.tokenizer_path, self.reward_model = cfg, seed, tokenizer_path, reward_model
        self.rewards = rewards_of(cfg)
        self.scorers = [*self.rewards, *([reward_model] if reward_model is not None else [])]  # a reward column each
        self.weights = torch.tensor([r.weight for r in self.scorers], dtype=torch.float32)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """Read at the first rollout (a step the planner builds never samples)."""
        return load_tokenizer(self.tokenizer_path)

    @functools.cached_property
    def stop_ids(self) -> list[int]:
        return answer_ends(self.tokenizer)

    @torch.no_grad()
    def sample(
        self, model: nn.Module, batches: list[MicroBatch], plan: ShardingPlan, step: int, temperature: float
    ) -> list[tuple[list[np.ndarray], list[list[int]], list[list[float]]]]:
        """(prompts, completions, their sampled log-probs) of each micro-batch: num_generations of each prompt (one,
        greedy, at temperature 0), completions in prompt order, sample index fastest."""
        n = self.cfg.num_generations if temperature > 0 else 1
        out = []
        with held_gathered(model, plan):
            for batch in batches:
                device, length = batch.inputs.device, batch.inputs.shape[1]
                prompts = prompts_of(batch)
                limits = [min(self.cfg.max_completion_length, length - len(prompt)) for prompt in prompts]
                completions, logps = sample_groups(
                    model, [torch.from_numpy(p).to(device) for p in prompts], n, limits, temperature,
                    self.cfg.top_k or None, self.cfg.top_p, torch.tensor(self.stop_ids, device=device),
                    generators(self.seed, step, batch.windows.tolist(), n, device),
                )  # fmt: skip
                out.append((prompts, completions, logps))
        return out

    def text(self, ids: list[int]) -> str:
        """A completion's text, without the token that ended it (TRL decodes skipping special tokens)."""
        return self.tokenizer.decode(ids[:-1] if ids and ids[-1] in self.stop_ids else ids)

    def truncated(self, ids: list[int], limit: int) -> bool:
        """Whether a completion was cut at its length limit rather than ended by a stop token."""
        return len(ids) >= limit and (not ids or ids[-1] not in self.stop_ids)

    def __call__(
        self,
        model: nn.Module,
        batches: list[MicroBatch],
        plan: ShardingPlan,
        step: int,
        records: list[list[dict]],
        micro_steps: int,
        first: int = 0,
    ) -> RolloutBuffer:
        """The rank's micro-batches of prompts sampled and scored: a buffer of its groups, numbered as the module says
        from `first` on, with their advantages, and the sampling's reward and completion metrics (the global batch's,
        the same on every rank). `micro_steps`: the micro-batches of every rank."""
        sampled = self.sample(model, batches, plan, step, self.cfg.temperature)
        device = batches[0].inputs.device
        local_rewards = torch.from_numpy(scored(self, sampled, records)).float().to(device)
        rewards = gathered(local_rewards, len(batches), micro_steps).cpu()
        cfg, world = self.cfg, micro_steps // len(batches)
        advantages, total, std_zero = group_advantages(rewards, self.weights, cfg.num_generations, cfg.scale_rewards)
        local, local_rewards = local_rows(advantages, len(batches), micro_steps), local_rewards.cpu()
        rank, n, groups = (dist.get_rank() if world > 1 else 0), cfg.num_generations, {}
        for q, (batch, (prompts, completions, logps)) in enumerate(zip(batches, sampled, strict=True)):
            for i, prompt in enumerate(prompts):
                limit = min(cfg.max_completion_length, batch.inputs.shape[1] - len(prompt))
                ids, row = completions[i * n : (i + 1) * n], (q * len(prompts) + i) * n  # its first local row
                cuts, rows = [self.truncated(c, limit) for c in ids], slice(row, row + n)
                group = as_group(prompt, ids, logps[i * n : (i + 1) * n], local_rewards[rows], local[rows], cuts)
                groups[first + (q * world + rank) * len(prompts) + i] = group
        stats = reward_stats(self.scorers, rewards, total, std_zero)
        every = lengths_and_cuts(groups.values()).to(device)
        stats.update(completion_stats(gathered(every, len(batches), micro_steps).cpu()))
        per_step = micro_steps * len(batches[0].inputs) // cfg.steps_per_generation  # it read that many steps'
        return RolloutBuffer(cfg, step, per_step, groups, stats)


def selected(rollouts: Rollouts, buffer: RolloutBuffer, wanted: int) -> RolloutBuffer:
    """A buffer holding every sampled group (of several batches of prompts) cut to `wanted` groups (DAPO's dynamic
    sampling): the first whose rewards differ, in order, then if too few the first whose rewards are all equal;
    renumbered in that order, their advantages and the reward and completion metrics taken over them."""
    n, order, same = rollouts.cfg.num_generations, sorted(buffer.groups), alike(buffer, rollouts.weights)
    differ = [g for g, a in zip(order, same, strict=True) if not a]
    chosen = (differ + [g for g, a in zip(order, same, strict=True) if a])[:wanted]
    groups = {k: buffer.groups[g] for k, g in enumerate(chosen)}
    rewards = torch.cat([group["rewards"] for group in groups.values()])
    advantages, total, std_zero = group_advantages(rewards, rollouts.weights, n, rollouts.cfg.scale_rewards)
    for k, group in groups.items():
        group["advantages"] = advantages[k * n : (k + 1) * n]
    stats = reward_stats(rollouts.scorers, rewards, total, std_zero)
    stats.update(completion_stats(lengths_and_cuts(groups.values())))
    stats["sampling/prompts_sampled"] = float(len(order))
    return RolloutBuffer(rollouts.cfg, buffer.step, buffer.per_step, groups, stats)


def alike(buffer: RolloutBuffer, weights: torch.Tensor) -> list[bool]:
    """Whether each group's weighted rewards are all equal (in the groups' order): its advantages are all 0."""
    order = sorted(buffer.groups)
    if not order:
        return []
    rewards = torch.cat([buffer.groups[g]["rewards"] for g in order])
    n = len(buffer.groups[order[0]]["completions"])
    return group_advantages(rewards, weights, n, "group")[2].view(-1, n)[:, 0].tolist()


def scored(rollouts: Rollouts, sampled: list, records: list[list[dict]]) -> np.ndarray:
    """Every reward's score of each of this rank's completions (completions, rewards: the functions', then the reward
    model's), NaN where a function skipped it; RewardError naming a function that failed."""
    rows = []
    for (prompts, completions, _), batch_records in zip(sampled, records, strict=True):
        n = len(completions) // len(prompts)
        records_each = [record for record in batch_records for _ in range(n)]
        texts = raw = [rollouts.text(ids) for ids in completions]
        prompt_values = [record["prompt"] for record in records_each]
        if records_each and isinstance(prompt_values[0], list):  # conversations: TRL's completion messages
            texts = [[{"role": "assistant", "content": text}] for text in texts]
        keys = [key for key in records_each[0] if key != "prompt"] if records_each else []
        columns = {key: [record.get(key) for record in records_each] for key in keys}
        row = np.zeros((len(completions), 0))
        if rollouts.rewards:
            row = score(rollouts.rewards, prompt_values, texts, completions, columns)
        if rollouts.reward_model is not None:
            row = np.concatenate([row, rollouts.reward_model(prompt_values, raw)[:, None]], axis=1)
        rows.append(row)
    return np.concatenate(rows) if rows else np.zeros((0, len(rollouts.scorers)))


def generators(seed: int, step: int, windows: list[int], n: int, device: torch.device) -> list[torch.Generator]:
    """Completion i (of n) of the prompt in window w draws from a generator seeded by (seed, step, w, i)."""
    return [
        torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}:{step}:{w}:{i}".encode()))
        for w in windows
        for i in range(n)
    ]


def gathered(rows: torch.Tensor, micro_batches: int, micro_steps: int) -> torch.Tensor:
    """Every rank's rows (each rank's in micro-batches of equal size), in the order one process with all the
    micro-batches would hold them: micro-batch m of rank r is global micro-batch m x world + r."""
    world = micro_steps // micro_batches
    if world == 1:
        return rows
    parts = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(parts, rows)
    per = rows.shape[0] // micro_batches
    return torch.cat([parts[r][m * per : (m + 1) * per] for m in range(micro_batches) for r in range(world)])


def local_rows(rows: torch.Tensor, micro_batches: int, micro_steps: int) -> torch.Tensor:
    """This rank's rows of `gathered`'s order."""
    world = micro_steps // micro_batches
    if world == 1:
        return rows
    rank, per = dist.get_rank(), rows.shape[0] // micro_steps
    return torch.cat([rows[(m * world + rank) * per : (m * world + rank + 1) * per] for m in range(micro_batches)])


def reward_stats(
    rewards: list[Reward], per_function: torch.Tensor, total: torch.Tensor, std_zero: torch.Tensor
) -> dict[str, float]:
    """TRL's reward metrics of a global batch: each function's mean and std (of the completions it scored), the
    weighted sum's (of the completions some function scored), and the share of completions whose group's rewards
    were all equal (they teach nothing)."""
    stats = {}
    for k, reward in enumerate(rewards):
        stats[f"rewards/{reward.name}/mean"] = float(per_function[:, k].nanmean())
        stats[f"rewards/{reward.name}/std"] = float(nanstd(per_function[:, k]))
    stats.update(reward=float(total.nanmean()), reward_std=float(nanstd(total)))
    stats["frac_reward_zero_std"] = float(std_zero.float().mean())
    return stats


def completion_stats(every: torch.Tensor) -> dict[str, float]:
    """The completion lengths (mean, min, max) and the share cut at the length limit (TRL's completions/...), from
    every completion's (length, cut) (n, 2)."""
    n = every[:, 0]
    return {
        "completions/mean_length": float(n.mean()),
        "completions/min_length": float(n.min()),
        "completions/max_length": float(n.max()),
        "completions/clipped_ratio": float(every[:, 1].mean()),
    }


def training_window(seq_len: int, num_generations: int, max_seq_len: int) -> int:
    """The windows a micro-batch's completions are packed into to train: as long as its num_generations prompt
    windows together (the model's max_seq_len at most), so that a window holds several prompt + completion examples
    (block-causal) instead of one and the padding after it; the longest the windows may be, then cut as short as
    keeps their number (examples.tightest). A micro-batch of G x prompts windows of seq_len tokens at most, as the
    planner prices it; usually fewer tokens."""
    return seq_len * max(1, min(num_generations, max_seq_len // seq_len))


@torch.no_grad()
def evaluate(rollouts: Rollouts, model: nn.Module, batches: list[MicroBatch], plan: ShardingPlan, records: list):
    """The rewards of one greedy completion of each prompt, over every rank's: the weighted sum's mean, each
    function's, and the completions' mean length."""
    sampled = rollouts.sample(model, batches, plan, 0, temperature=0.0)
    micro_steps, device = len(batches) * dist.get_world_size(), batches[0].inputs.device
    local = torch.from_numpy(scored(rollouts, sampled, records)).float().to(device)
    rewards = gathered(local, len(batches), micro_steps).cpu()
    total = weighted_rewards(rewards, rollouts.weights)
    stats = reward_stats(rollouts.scorers, rewards, total, torch.zeros(len(total), dtype=torch.bool))
    lengths = torch.tensor([[float(len(ids)), 0.0] for _, completions, _ in sampled for ids in completions])
    mean_length = completion_stats(gathered(lengths.to(device), len(batches), micro_steps).cpu())
    mean_length = mean_length["completions/mean_length"]
    keep = ("reward", *(f"rewards/{r.name}/mean" for r in rollouts.scorers))
    return {**{k: stats[k] for k in keep}, "completions/mean_length": mean_length}
