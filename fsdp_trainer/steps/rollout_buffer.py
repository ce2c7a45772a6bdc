"""What online RL keeps of a sampling for the optimizer steps that train on it (grpo.steps_per_generation of them,
grpo.num_iterations times over), and what a checkpoint taken between them carries.

A sampling's completions are kept by group (a prompt and its num_generations completions), numbered in the order one
process holds them: group g is the g-th prompt of the global batches the sampling read, so step j of the cycle trains
groups [j x P, (j + 1) x P) (P prompts a global batch), and rank r's micro-step m holds the micro_batch_size groups
from (m x world + r) x micro_batch_size on: the loader's own order. Each rank keeps the groups it sampled; when the
buffer outlives its step it is gathered to every rank, so that a checkpoint holds it whole, once, and a run resumed
on another number of ranks takes its own share of it.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_trainer.config import GRPOConfig
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.steps.examples import packed, packed_tree


@dataclass
class Rollout:
    """A micro-batch of prompts' completions, packed to train on, and what the loss needs of them beside the tokens."""

    batch: MicroBatch
    """The completions (those that train: mask_truncated_completions drops the cut ones) packed into windows, each
    after its prompt, block-causal; `sequences` numbers them in order."""
    advantages: torch.Tensor
    """Each packed completion's advantage."""
    sampled_logps: torch.Tensor | None
    """The log-probability the sampler gave each trained token (MicroBatch.trained's order)."""
    sampled: int
    """The completions sampled, those mask_truncated_completions keeps out of `batch` too."""
    old_logps: torch.Tensor | None = None
    """Each trained token's log-probability under the policy when it was sampled (None: the policy's own, detached:
    the step that sampled them trains them once)."""
    weights: torch.Tensor | None = None
    """grpo.sampler_correction's weight of each trained token (None: 1)."""
    kept: tuple[tuple[int, int], ...] = ()
    """The packed completions, as (group, completion index)."""


def cycle(cfg: GRPOConfig) -> int:
    """The optimizer steps that train on one sampling."""
    return cfg.steps_per_generation * cfg.num_iterations


def keeps_sampling_logps(cfg: GRPOConfig) -> bool:
    """Whether the policy's log-probs of the completions are taken (a forward without gradient) when they are sampled:
    where a later step trains on them or the sampler's are corrected; else a step takes its own, detached."""
    return cycle(cfg) > 1 or cfg.sampler_correction != "none"


def as_group(prompt, completions: list[list[int]], logps: list[list[float]], rewards, advantages, cut) -> dict:
    """A prompt and its completions as the buffer keeps them, with their rewards (completions, functions) and
    advantages: plain tensors and lists, so that a checkpoint reads it back with torch.load(weights_only=True)."""
    return {
        "prompt": torch.as_tensor(prompt, dtype=torch.int64).cpu(),
        "completions": [torch.tensor(ids, dtype=torch.int64) for ids in completions],
        "sampled": [torch.tensor(lp, dtype=torch.float32) for lp in logps],
        "rewards": rewards.float().cpu(),
        "advantages": advantages.float().cpu(),
        "cut": list(cut),
        "old": None,
    }


class RolloutBuffer:
    """One sampling's groups (by number, see the module's doc), its metrics, and which steps train on it."""

    def __init__(self, cfg: GRPOConfig, step: int, per_step: int, groups: dict[int, dict], stats: dict[str, float]):
        self.cfg, self.step, self.per_step, self.groups, self.stats = cfg, step, per_step, groups, stats

    def covers(self, step: int) -> bool:
        """Whether optimizer step `step` trains on this sampling."""
        return self.step <= step < self.step + cycle(self.cfg)

    def share(self, step: int, rank: int, world: int, micro_batch_size: int) -> list[list[int]]:
        """The groups rank `rank` trains at `step`, by micro-step."""
        j = (step - self.step) % self.cfg.steps_per_generation
        micro_steps = self.per_step // (micro_batch_size * world)
        starts = [j * self.per_step + (m * world + rank) * micro_batch_size for m in range(micro_steps)]
        return [list(range(start, start + micro_batch_size)) for start in starts]

    def rollouts(self, numbers: list[list[int]], window: int, device: torch.device) -> list[Rollout]:
        """The micro-batches of groups `numbers` packed to train on (see pack)."""
        return [pack(self.cfg, [(g, self.groups[g]) for g in chunk], window, device) for chunk in numbers]

    def trained_tokens(self) -> int:
        """The tokens the whole sampling trains on (every group's; the buffer must be whole)."""
        every = lengths_and_cuts(self.groups.values())
        cut = every[:, 1].bool() if self.cfg.mask_truncated_completions else torch.zeros(len(every), dtype=torch.bool)
        return int(every[~cut, 0].double().sum())  # exact: fp32 sums of many lengths would round

    def keep_old(self, rollout: Rollout, logps: torch.Tensor) -> None:
        """Record the policy's log-probs of a rollout's trained tokens (its `kept` completions' in order)."""
        at = 0
        for g, i in rollout.kept:
            group = self.groups[g]
            if group["old"] is None:
                group["old"] = [None] * len(group["completions"])
            n = len(group["completions"][i])
            group["old"][i] = logps[at : at + n].detach().float().cpu().clone()
            at += n

    def gather(self, owned: list[int]) -> None:
        """Each rank's `owned` groups (as it holds them: those it sampled, or trains with their log-probs at sampling)
        on every rank (one all_gather_object)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, {g: self.groups[g] for g in owned})
        for part in parts:
            self.groups.update(part)
        self.groups = dict(sorted(self.groups.items()))


def lengths_and_cuts(groups) -> torch.Tensor:
    """Every completion of `groups` (as the buffer keeps them) as (its length, whether it was cut at the length limit)
    (n, 2), float."""
    every = [(float(len(ids)), float(cut)) for g in groups for ids, cut in zip(g["completions"], g["cut"], strict=True)]
    return torch.tensor(every).reshape(-1, 2)


def pack(cfg: GRPOConfig, groups: list[tuple[int, dict]], window: int, device: torch.device) -> Rollout:
    """Groups' completions packed after their prompts into windows of `window` tokens (share_prompts: a prompt once
    for its completions, packed_tree; mask_truncated_completions: the cut ones left out), with their advantages,
    the sampler's log-probs of their tokens, the policy's at sampling where kept (`old`), and
    grpo.sampler_correction's weights from the two."""
    trees, advantages, sampled, old, kept, count = [], [], [], [], [], 0
    for g, group in groups:
        count += len(group["completions"])
        trees.append((group["prompt"].numpy(), []))
        for i, ids in enumerate(group["completions"]):
            if group["cut"][i] and cfg.mask_truncated_completions:
                continue
            trees[-1][1].append(ids.numpy())
            advantages.append(group["advantages"][i])
            sampled.append(group["sampled"][i])
            old.append(group["old"][i] if group["old"] is not None else None)
            kept.append((g, i))
    if cfg.share_prompts:
        batch = packed_tree(trees, window, device)
    else:
        batch = packed([(prompt, ids) for prompt, answers in trees for ids in answers], window, device)
    kept_advantages = torch.stack(advantages).to(device) if advantages else torch.zeros(0, device=device)
    sampled_logps = torch.cat(sampled).to(device) if sampled else torch.zeros(0, device=device)
    old_logps = weights = None
    if old and old[0] is not None:
        old_logps = torch.cat(old).to(device)
        weights = sampler_weights(cfg, [o - s for o, s in zip(old, sampled, strict=True)], device)
    return Rollout(batch, kept_advantages, sampled_logps, count, old_logps, weights, tuple(kept))


def sampler_weights(cfg: GRPOConfig, differences: list[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """grpo.sampler_correction's weight of each token, from each completion's log-prob differences between the
    trainer's forward and the sampler (TRL's vLLM importance sampling): exp of the token's (token_*) or of its
    completion's summed (sequence_*) difference, clipped into [min, max] (*_truncate) or zeroed outside it (*_mask)."""
    mode = cfg.sampler_correction
    if mode == "none":
        return None
    if mode.startswith("sequence"):
        differences = [d.sum().expand_as(d) for d in differences]
    ratios = torch.cat(differences).exp() if differences else torch.zeros(0)
    low = -math.inf if cfg.sampler_correction_min is None else cfg.sampler_correction_min
    high = math.inf if cfg.sampler_correction_max is None else cfg.sampler_correction_max
    if mode.endswith("truncate"):
        ratios = ratios.clamp(low, high)
    else:
        ratios = ratios.masked_fill((ratios < low) | (ratios > high), 0.0)
    return ratios.to(device)


def sampler_gap(buffer: RolloutBuffer, cfg: GRPOConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs of the completions are from the policy's forward at sampling (`old`), over
    every rank's (TRL's sampling/... metrics): the largest and mean |difference| a token, and with
    grpo.sampler_correction its weights' min, mean and max."""
    pairs = [zip(g["old"], g["sampled"], strict=True) for g in buffer.groups.values() if g["old"] is not None]
    differences = [o - s for pair in pairs for o, s in pair if o is not None]
    gaps = torch.cat(differences).abs() if differences else torch.zeros(0)
    weights = sampler_weights(cfg, differences, torch.device("cpu"))

    def largest(values: torch.Tensor | None) -> torch.Tensor:
        return values.max() if values is not None and len(values) else torch.tensor(-math.inf)

    tops = torch.stack([largest(gaps), largest(weights), largest(None if weights is None else -weights)]).to(device)
    sums = torch.tensor([gaps.sum(), len(gaps), 0.0 if weights is None else weights.sum()], device=device)
    if dist.is_initialized():
        dist.all_reduce(tops, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums)
    count = sums[1].clamp(min=1)
    out = {"sampling/sampling_logp_difference/max": tops[0], "sampling/sampling_logp_difference/mean": sums[0] / count}
    if weights is not None:
        out["sampling/importance_sampling_ratio/min"] = -tops[2]
        out["sampling/importance_sampling_ratio/mean"] = sums[2] / count
        out["sampling/importance_sampling_ratio/max"] = tops[1]
    return out


def save_buffer(buffer: RolloutBuffer | None) -> bytes:
    """The buffer as a checkpoint holds it (empty when no step after the checkpoint's trains on it)."""
    if buffer is None:
        return b""
    out = io.BytesIO()
    state = {"step": buffer.step, "per_step": buffer.per_step, "stats": buffer.stats, "groups": buffer.groups}
    state["cycle"] = [buffer.cfg.steps_per_generation, buffer.cfg.num_iterations, buffer.cfg.num_generations]
    torch.save(state, out)
    return out.getvalue()


def load_buffer(cfg: GRPOConfig, content: bytes, per_step: int) -> RolloutBuffer | None:
    """A checkpoint's buffer, for a run whose grpo section and global batch of prompts are as the checkpoint's."""
    if not content:
        return None
    state = torch.load(io.BytesIO(content), weights_only=True)
    ours = [cfg.steps_per_generation, cfg.num_iterations, cfg.num_generations]
    if state["cycle"] != ours or state["per_step"] != per_step:
        raise ValueError(
            f"the checkpoint's steps {state['step']}.. train on completions sampled for grpo.steps_per_generation, "
            f"num_iterations, num_generations = {state['cycle']} and {state['per_step']} prompts a step (now {ours} "
            f"and {per_step}): resume with those, or from a checkpoint at the end of a sampling's steps"
        )
    return RolloutBuffer(cfg, state["step"], per_step, state["groups"], state["stats"])
