"""What training minimizes, computed from the model's final hidden states and its output layer.

An objective is an object the model calls at the end of its forward, `loss(hidden, output)`, with the final hidden
states (B, T, dim) and the output layer (a module from them to the logits: the lm_head, with its adapter under LoRA).
It runs inside the model's forward, so FSDP gathers and frees the output layer there as it does every other
parameter, but it is written here: a second objective
(a preference loss, distillation) is a class in this file, not a branch in the model file. Objectives return a sum;
train_step divides it by the number of targets of the whole global batch (share_of_global_mean), so the gradient is
the same however the batch is split over ranks and micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100
"""A target that is not trained on (cross_entropy's ignore_index): a prompt's tokens in fine-tuning, padding."""


def _summed_loss(hidden: torch.Tensor, output: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output(hidden).float(), targets, ignore_index=IGNORE, reduction="sum")


def trained_rows(
    hidden: torch.Tensor, targets: torch.Tensor, trained: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The final hidden states (B, T, dim) and targets (B, T) as rows (N, dim) and (N,): of the positions `trained`
    names (found on the host: nothing waits for the device), or of every position."""
    hidden, targets = hidden.flatten(0, 1), targets.flatten()
    if trained is None:
        return hidden, targets
    return hidden.index_select(0, trained), targets.index_select(0, trained)


def chunked_cross_entropy(
    hidden: torch.Tensor, output: nn.Module, targets: torch.Tensor, chunks: int = 1, trained: torch.Tensor | None = None
) -> torch.Tensor:
    """Summed next-token loss of the output layer `output` on the final hidden states, over the targets that are not
    IGNORE, in fp32 whatever the compute dtype; with `trained` (MicroBatch.trained), the output layer runs on those
    positions alone: fine-tuning data's prompts make no logits.

    The logits are the model's largest activation (tokens x vocab: 2.1 GB in bf16 for 8k tokens of a 128k vocabulary,
    twice that as fp32 for the loss, and as much again for its gradient). With chunks > 1 the tokens are cut into that
    many slices; each slice's logits are made, reduced to a summed loss and freed, and made again in backward
    (activation checkpointing of the output layer), so one slice's logits exist at a time. The same loss and gradients
    as chunks = 1, to the order of the float sums.
    """
    hidden, targets = trained_rows(hidden, targets, trained)
    if chunks == 1:
        return _summed_loss(hidden, output, targets)
    pieces = zip(hidden.chunk(chunks), targets.chunk(chunks), strict=True)
    return sum(checkpoint(_summed_loss, h, output, t, use_reentrant=False) for h, t in pieces)


@dataclass
class NextTokenLoss:
    """Cross-entropy of the next token, summed over the targets (B, T) that are not IGNORE, with the output layer
    computed in `chunks` slices of the tokens (train.loss_chunks; see chunked_cross_entropy)."""

    targets: torch.Tensor
    chunks: int = 1
    trained: torch.Tensor | None = None
    """The positions with a target (MicroBatch.trained), or None for all of them."""

    def __call__(self, hidden: torch.Tensor, output: nn.Module) -> torch.Tensor:
        return chunked_cross_entropy(hidden, output, self.targets, self.chunks, self.trained)

    def count(self) -> torch.Tensor:
        """How many targets the sum is over."""
        return (self.targets != IGNORE).sum()


def share_of_global_mean(summed: torch.Tensor, global_count: torch.Tensor | float, world_size: int) -> torch.Tensor:
    """One micro-batch's part of the mean loss over the global batch's `global_count` targets, for backward.

    FSDP averages gradients over the ranks, so the sum is scaled by the world size to undo that division: the
    gradients are then those of the global mean, whatever the split into ranks and micro-batches, and a micro-batch
    with few targets (fine-tuning: few assistant tokens) weighs as little as it holds."""
    return summed * world_size / global_count


def sequence_sums(values: torch.Tensor, sequences: torch.Tensor, n_sequences: int) -> torch.Tensor:
    """Each sequence's sum of `values` (n_sequences,), given the number of the sequence each value belongs to
    (`sequences`, same shape; -1 for none: those values must be 0)."""
    # One slot past the last sequence collects the positions of none, so no mask is indexed by: the shapes are known
    # on the host, nothing waits for the device.
    slots = torch.where(sequences >= 0, sequences, n_sequences).flatten()
    summed = torch.zeros(n_sequences + 1, dtype=values.dtype, device=values.device)
    # A copy, not a view of `summed`: FSDP2 warns that an in-place op on a view a module returns would drop its
    # pre-backward hook (and the copy is of one number per sequence).
    return summed.index_add(0, slots, values.flatten())[:n_sequences].clone()


# --- preference tuning (DPO and its variants) -------------------------------------------------------------------------


def _token_logps(hidden: torch.Tensor, output: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) of each token (N, from hidden states N x dim), in fp32; 0 where the target is IGNORE: minus the
    cross-entropy of each, so it keeps what _summed_loss keeps for backward, no more."""
    return -F.cross_entropy(output(hidden).float(), targets, ignore_index=IGNORE, reduction="none")


@dataclass
class SequenceLogProbs:
    """The objective of a preference step's forward: each response's summed log-probability of its trained targets,
    its log-likelihood given its prompt (the prompt's targets are IGNORE), with the output layer computed in `chunks`
    slices of the tokens as NextTokenLoss does.

    Without `sequences`, a response per row (B,). With them (packed windows, several responses to a row), the number
    of the response each target belongs to (B, T), -1 where there is none, and their count `n_sequences`: the sums
    come out per response (n_sequences,), in that order."""

    targets: torch.Tensor
    sequences: torch.Tensor | None = None
    n_sequences: int = 0
    chunks: int = 1
    trained: torch.Tensor | None = None
    """The positions with a target (MicroBatch.trained; only with `sequences`), or None for all of them."""

    def __call__(self, hidden: torch.Tensor, output: nn.Module) -> torch.Tensor:
        # Slices of the tokens, as chunked_cross_entropy cuts them, not of the rows: a micro-batch has few rows.
        hidden, targets = trained_rows(hidden, self.targets, self.trained)
        if self.chunks == 1:
            logps = _token_logps(hidden, output, targets)
        else:
            pieces = zip(hidden.chunk(self.chunks), targets.chunk(self.chunks), strict=True)
            logps = torch.cat([checkpoint(_token_logps, h, output, t, use_reentrant=False) for h, t in pieces])
        if self.trained is None:
            return self._per_sequence(logps.view(self.targets.shape))
        return self._per_sequence(logps, self.sequences.flatten().index_select(0, self.trained))

    def _per_sequence(self, values: torch.Tensor, sequences: torch.Tensor | None = None) -> torch.Tensor:
        """Each response's sum of `values`, a value a position of `sequences` (default: every position's)."""
        sequences = self.sequences if sequences is None else sequences
        if sequences is None:
            return values.sum(-1)
        return sequence_sums(values, sequences, self.n_sequences)

    def count(self) -> torch.Tensor:
        """The trained targets of each response: its length in tokens."""
        return self._per_sequence((self.targets != IGNORE).long())


def label_smoothed(logits: torch.Tensor, e: float) -> torch.Tensor:
    """-log sigmoid(logits) when labels are flipped with probability e: -(1 - e) log sigmoid(x) - e log sigmoid(-x)
    (conservative DPO, and CPO / SimPO with label smoothing)."""
    return (1 - e) * -F.logsigmoid(logits) + e * -F.logsigmoid(-logits)


def pair_rewards(
    beta: float,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor | float = 0.0,
    ref_rejected: torch.Tensor | float = 0.0,
) -> dict[str, torch.Tensor]:
    """The implicit rewards beta * (policy - reference log-probability) of each pair (P,) (with no reference, as in
    SimPO and ORPO, beta * the log-probability), and what TRL logs of them: rewards/chosen, rewards/rejected,
    rewards/accuracies (chosen above rejected), rewards/margins, logps/chosen, logps/rejected, per pair, to be
    averaged over the pairs of a batch."""
    chosen_reward = beta * (chosen - ref_chosen).detach()
    rejected_reward = beta * (rejected - ref_rejected).detach()
    return {
        "rewards/chosen": chosen_reward,
        "rewards/rejected": rejected_reward,
        "rewards/accuracies": (chosen_reward > rejected_reward).float(),
        "rewards/margins": chosen_reward - rejected_reward,
        "logps/chosen": chosen.detach(),
        "logps/rejected": rejected.detach(),
    }


PREFERENCE_LOSSES = ("sigmoid", "ipo", "robust")


@dataclass
class PreferenceLoss:
    """The loss of preference pairs from the summed log-probabilities of each response under the policy and the
    reference model, as TRL's DPOTrainer defines them (its names for the same numbers):

    - `sigmoid` (DPO, Rafailov et al. 2023): -log sigmoid(beta * d), d = (policy - reference log-ratio of the chosen
      response) - (that of the rejected one); with label_smoothing e, conservative DPO (cDPO): -(1 - e) log
      sigmoid(beta * d) - e log sigmoid(-beta * d), for labels flipped with probability e;
    - `ipo` (Azar et al. 2023): (d' - 1 / (2 beta))^2, d' the difference of the log-ratios each divided by its
      response's length in tokens, as TRL normalizes it;
    - `robust` (rDPO, Chowdhury et al. 2024): the unbiased estimate for labels flipped with probability e,
      (-(1 - e) log sigmoid(beta * d) + e log sigmoid(-beta * d)) / (1 - 2e).
    """

    kind: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in PREFERENCE_LOSSES:
            raise ValueError(f"preference loss {self.kind!r}: choose among {', '.join(PREFERENCE_LOSSES)}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing={self.label_smoothing} must be in [0, 0.5)")

    def __call__(
        self,
        chosen: torch.Tensor,
        rejected: torch.Tensor,
        ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor,
        chosen_tokens: torch.Tensor | None = None,
        rejected_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of each pair (P,), from the summed log-probabilities of each response (P,) and, for `ipo`, the
        responses' lengths in tokens."""
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        if self.kind == "ipo":
            delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
            return (delta - 1 / (2 * self.beta)) ** 2
        logits = self.beta * (chosen_ratio - rejected_ratio)
        e = self.label_smoothing
        if self.kind == "robust":
            agree, flipped = -F.logsigmoid(logits), -F.logsigmoid(-logits)
            return ((1 - e) * agree - e * flipped) / (1 - 2 * e)
        return label_smoothed(logits, e)

    def rewards(self, chosen, rejected, ref_chosen, ref_rejected) -> dict[str, torch.Tensor]:
        """pair_rewards with this loss's beta."""
        return pair_rewards(self.beta, chosen, rejected, ref_chosen, ref_rejected)


# --- distillation -----------------------------------------------------------------------------------------------------


def divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float):
    """The generalized Jensen-Shannon divergence of each row's distributions (N,) at `temperature`, as TRL's GKD
    defines it: beta 0 is KL(teacher || student), beta 1 KL(student || teacher), between them the divergence of each
    from their mixture, weighted beta (teacher) and 1 - beta (student)."""
    student = F.log_softmax(student_logits / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        return F.kl_div(student, teacher, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(teacher, student, reduction="none", log_target=True).sum(-1)
    mixture = torch.logsumexp(torch.stack([student + math.log1p(-beta), teacher + math.log(beta)]), dim=0)
    to_teacher = F.kl_div(mixture, teacher, reduction="none", log_target=True).sum(-1)
    to_student = F.kl_div(mixture, student, reduction="none", log_target=True).sum(-1)
    return beta * to_teacher + (1 - beta) * to_student


def _distillation_sums(hidden, output, teacher_hidden, teacher_output, targets, beta, temperature, alpha):
    """(the weighted loss, the divergence, the cross-entropy, the teacher's cross-entropy), each summed over the
    targets that are not IGNORE."""
    logits = output(hidden).float()
    with torch.no_grad():
        teacher_logits = teacher_output(teacher_hidden).float()
        teacher_ce = F.cross_entropy(teacher_logits, targets, ignore_index=IGNORE, reduction="sum")
    kept = (targets != IGNORE).float()
    kd = (divergence(logits, teacher_logits, beta, temperature) * kept).sum()
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    return torch.stack([alpha * kd + (1 - alpha) * ce, kd.detach(), ce.detach(), teacher_ce])


@dataclass
class DistillationLoss:
    """The objective of a distillation step's forward: at each target that is not IGNORE, alpha x the divergence of
    the model's next-token distribution from the teacher's (divergence) + (1 - alpha) x the cross-entropy, summed;
    with the sums of the divergence, the cross-entropy and the teacher's own cross-entropy beside it (4,). The
    teacher's logits come from its final hidden states (B, T, teacher dim) through its output layer (gathered: the
    caller holds it unsharded), in `chunks` slices of the tokens, each slice's two logits made, reduced and freed, and
    made again in backward, as NextTokenLoss does: neither model's whole (tokens x vocab) logits exist at once."""

    targets: torch.Tensor
    teacher_hidden: torch.Tensor
    teacher_output: nn.Module
    beta: float
    temperature: float = 1.0
    alpha: float = 1.0
    chunks: int = 1
    trained: torch.Tensor | None = None
    """The positions with a target (MicroBatch.trained), or None for all of them."""

    def __call__(self, hidden: torch.Tensor, output: nn.Module) -> torch.Tensor:
        hidden, targets = trained_rows(hidden, self.targets, self.trained)
        teacher, _ = trained_rows(self.teacher_hidden, self.targets, self.trained)
        settings = (self.beta, self.temperature, self.alpha)
        if self.chunks == 1:
            return _distillation_sums(hidden, output, teacher, self.teacher_output, targets, *settings)
        pieces = zip(hidden.chunk(self.chunks), teacher.chunk(self.chunks), targets.chunk(self.chunks), strict=True)
        return sum(
            checkpoint(_distillation_sums, h, output, t, self.teacher_output, y, *settings, use_reentrant=False)
            for h, t, y in pieces
        )


# --- online RL (GRPO and its family) ----------------------------------------------------------------------------------

POLICY_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation of the values that are not NaN, with Bessel's correction (NaN for fewer than 2)."""
    mean = x.nanmean() if dim is None else x.nanmean(dim, keepdim=True)
    variance = ((x - mean) ** 2).nanmean() if dim is None else ((x - mean) ** 2).nanmean(dim)
    count = (~x.isnan()).sum() if dim is None else (~x.isnan()).sum(dim)
    return (variance * count / (count - 1)).where(count > 1, torch.nan).sqrt()


def weighted_rewards(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward (n,): the weighted sum of its functions' rewards (n, functions), the NaN of those
    that skipped it left out; NaN where every function skipped it."""
    return (rewards * weights).nansum(dim=1).masked_fill(rewards.isnan().all(dim=1), torch.nan)


def group_advantages(
    rewards: torch.Tensor, weights: torch.Tensor, group: int, scale: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each completion's advantage (n,), its weighted reward (n,), whether the std it is scaled by is 0 (n,)), from
    every reward function's rewards (n, functions; NaN where one skipped a completion) of a batch whose completions
    come in groups of `group` samples of one prompt, as TRL's GRPOTrainer computes them: the weighted sum of a
    completion's rewards minus its group's mean, divided by the std of its group (scale `group`, GRPO; Shao et al.
    2024) or of the whole batch (`batch`; Hu 2025, REINFORCE++) plus 1e-4, or not divided (`none`: Dr. GRPO, Liu et
    al. 2025). A completion every function skipped (reward NaN) counts in no mean and has advantage 0."""
    total = weighted_rewards(rewards, weights)
    grouped = total.view(-1, group)
    mean = grouped.nanmean(dim=1).repeat_interleave(group)
    std = nanstd(total).expand_as(total) if scale == "batch" else nanstd(grouped, 1).repeat_interleave(group)
    advantages = total - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return advantages.nan_to_num(0.0), total, std.isclose(torch.zeros_like(std))


def _logps_entropy(
    hidden: torch.Tensor, output: nn.Module, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), the entropy of the distribution) at each row, of the logits divided by `temperature`, fp32."""
    log_p = F.log_softmax(output(hidden).float() / temperature, dim=-1)  # one (rows, vocab) kept for backward
    logps = log_p.gather(-1, targets.clamp(min=0)[:, None])[:, 0].masked_fill(targets == IGNORE, 0.0)
    with torch.no_grad():  # one more (rows, vocab) for a moment, not three
        entropy = -log_p.exp().mul_(log_p).sum(-1)
    return logps, entropy


def token_logps(
    hidden: torch.Tensor,
    output: nn.Module,
    targets: torch.Tensor,
    trained: torch.Tensor,
    temperature: float = 1.0,
    chunks: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), the distribution's entropy) at each `trained` position (N,), of the logits / temperature,
    fp32; the output layer in `chunks` slices of the tokens, as chunked_cross_entropy computes it."""
    hidden, targets = trained_rows(hidden, targets, trained)
    if chunks == 1:
        return _logps_entropy(hidden, output, targets, temperature)
    pieces = zip(hidden.chunk(chunks), targets.chunk(chunks), strict=True)
    parts = [checkpoint(_logps_entropy, h, output, y, temperature, use_reentrant=False) for h, y in pieces]
    logps, entropy = (torch.cat(x) for x in zip(*parts, strict=True))
    return logps, entropy


@dataclass
class TokenLogProbs:
    """An objective: each trained target's log-probability (N,) at `temperature` (a reference's, no gradient)."""

    targets: torch.Tensor
    trained: torch.Tensor
    temperature: float = 1.0
    chunks: int = 1

    def __call__(self, hidden: torch.Tensor, output: nn.Module) -> torch.Tensor:
        return token_logps(hidden, output, self.targets, self.trained, self.temperature, self.chunks)[0]


@dataclass
class PolicyLoss:
    """The loss of the GRPO family on sampled completions, as TRL's GRPOTrainer defines it (its settings' names).

    Each completion token's loss, from its log-probability under the policy (at the sampling temperature), under
    the policy that sampled it (`old`; the policy itself, detached, when a rollout trains one step) and under the
    reference, and its completion's advantage A: with the ratio r = exp(log p - log p_old), per token
    (`importance_sampling_level` token) or the exp of its completion's mean log-ratio (sequence: GSPO, Zheng et al.
    2025), `-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)` (PPO's clipped surrogate; epsilon_high above
    epsilon is DAPO's clip-higher), or for `cispo` (MiniMax-M1, 2025) `-min(r, epsilon_high).detach() A log p`; plus
    beta x the k3 estimate of KL(policy || reference), exp(q - p) - (q - p) - 1 (Schulman 2020), where beta > 0,
    times r where use_bias_correction_kl (TRL's default: the KL gradient then unbiased off-policy, DeepSeek-V3.2).
    How they are summed is the loss type's (`summed`, `units`)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    temperature: float = 1.0
    max_completion_length: int = 256
    use_bias_correction_kl: bool = True

    def __post_init__(self) -> None:
        if self.loss_type not in POLICY_LOSSES:
            raise ValueError(f"policy loss {self.loss_type!r}: choose among {', '.join(POLICY_LOSSES)}")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon

    @property
    def units(self) -> str:
        """What the loss is a mean over: completions, micro_batches or tokens."""
        return {"grpo": "completions", "dr_grpo": "completions", "bnpo": "micro_batches"}.get(self.loss_type, "tokens")

    def token_losses(
        self,
        logps: torch.Tensor,
        old: torch.Tensor,
        ref: torch.Tensor | None,
        advantages: torch.Tensor,
        sequences: torch.Tensor,
        n_sequences: int,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(each token's loss (N,), the ratios r (a token's (N,), or at the sequence level a completion's
        (n_sequences,)), each token's k3 KL (zeros without a reference)), from the tokens' log-probs (N,), their
        sequence's number (N,), the sequences' advantages (n_sequences,) and `weights` of the policy terms (N,)."""
        ratios = ratio = (logps - old).exp()
        if self.importance_sampling_level == "sequence":
            lengths = sequence_sums(torch.ones_like(logps), sequences, n_sequences).clamp(min=1)
            ratios = (sequence_sums(logps - old, sequences, n_sequences) / lengths).exp()
            ratio = ratios.index_select(0, sequences)
        a = advantages.index_select(0, sequences)
        if self.loss_type == "cispo":
            loss = -ratio.clamp(max=self.epsilon_high).detach() * a * logps
        else:
            clipped = ratio.clamp(1 - self.epsilon, 1 + self.epsilon_high)
            loss = -torch.min(ratio * a, clipped * a)
        loss = loss if weights is None else loss * weights
        kl = torch.zeros_like(logps)
        if self.beta != 0:
            kl = (ref - logps).exp() - (ref - logps) - 1
            if self.use_bias_correction_kl:
                kl = kl * ratio
            loss = loss + self.beta * kl
        return loss, ratios, kl

    def summed(self, losses: torch.Tensor, sequences: torch.Tensor, n_sequences: int) -> torch.Tensor:
        """The token losses (N,) summed as the loss type says, for train_step's division by the global count of
        `units`, which makes them these means whatever the split over ranks and micro-batches: `grpo` the mean over
        each completion's tokens, averaged over the completions; `bnpo` the mean over a micro-batch's tokens, averaged
        over the micro-batches; `dr_grpo` the sum over each completion's tokens over max_completion_length, averaged
        over the completions (Dr. GRPO); `dapo` and `cispo` the mean over the global batch's tokens."""
        if self.loss_type == "grpo":
            lengths = sequence_sums(torch.ones_like(losses), sequences, n_sequences).clamp(min=1)
            return (sequence_sums(losses, sequences, n_sequences) / lengths).sum()
        if self.loss_type == "bnpo":
            return losses.sum() / max(len(losses), 1)
        if self.loss_type == "dr_grpo":
            return losses.sum() / self.max_completion_length
        return losses.sum()


def clipped_ratios(policy: PolicyLoss, ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """(low, high, region) (3, N): whether each ratio (a token's or a completion's) was clipped below (negative
    advantage), above (positive), either; for cispo, high and region where the ratio passes epsilon_high."""
    if policy.loss_type == "cispo":
        high = (ratio > policy.epsilon_high) & (advantages > 0)
        return torch.stack([torch.zeros_like(high), high, high]).float()
    low = (ratio < 1 - policy.epsilon) & (advantages < 0)
    high = (ratio > 1 + policy.epsilon_high) & (advantages > 0)
    return torch.stack([low, high, low | high]).float()


class PolicyObjective:
    """The objective of an online-RL step's forward over packed completions: their targets (the rest IGNORE), the
    positions with one (`trained`, MicroBatch.trained) and each target's completion in `sequences` (n_sequences of
    them, each whole in the micro-batch). It returns the loss summed as `policy` says, then the sums POLICY_METRICS
    names (tokens, KL, entropy; the clipped ratios over tokens, or over completions at the sequence level), (7,).
    `old` and `ref`: the trained positions' log-probs under the policy that sampled them and the reference (N,);
    `sampled`: those the sampler computed, whose largest difference from the policy's the forward leaves in `gap`;
    `weights`: each trained position's weight of its policy term (PolicyLoss.token_losses).

    Not a dataclass, on purpose: FSDP casts the floating tensors it finds in a forward's arguments, dataclasses'
    fields included (on a copy), to the compute dtype, and the advantages and log-probs must stay fp32."""

    def __init__(
        self,
        policy: PolicyLoss,
        targets: torch.Tensor,
        trained: torch.Tensor,
        sequences: torch.Tensor,
        n_sequences: int,
        advantages: torch.Tensor,
        old: torch.Tensor | None = None,
        ref: torch.Tensor | None = None,
        chunks: int = 1,
        sampled: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ):
        self.policy, self.targets, self.trained, self.sequences = policy, targets, trained, sequences
        self.n_sequences, self.advantages, self.old, self.ref = n_sequences, advantages, old, ref
        self.chunks, self.sampled, self.weights = chunks, sampled, weights
        self.gap: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor, output: nn.Module) -> torch.Tensor:
        sequences, n = self.sequences.flatten().index_select(0, self.trained), self.n_sequences
        logps, entropy = token_logps(hidden, output, self.targets, self.trained, self.policy.temperature, self.chunks)
        if self.sampled is not None:
            self.gap = (logps.detach() - self.sampled).abs().max() if len(logps) else logps.new_zeros(())
        old = logps.detach() if self.old is None else self.old
        losses, ratios, kl = self.policy.token_losses(logps, old, self.ref, self.advantages, sequences, n, self.weights)
        loss = self.policy.summed(losses, sequences, n)
        per_sequence = self.policy.importance_sampling_level == "sequence"  # one ratio a completion: count those
        advantages = self.advantages if per_sequence else self.advantages.index_select(0, sequences)
        clipped = clipped_ratios(self.policy, ratios.detach(), advantages)
        tokens = torch.tensor(float(len(logps)), device=logps.device)
        return torch.cat([loss[None], torch.stack([tokens, kl.sum().detach(), entropy.sum()]), clipped.sum(-1)])


POLICY_METRICS = ("tokens", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
"""The sums PolicyObjective returns after the loss, in order (the clipped ratios over completions at the sequence
level, else over tokens; cispo's clipped share in the last two)."""
