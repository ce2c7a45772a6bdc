"""KTO (Ethayarajh et al. 2024), as TRL's KTOTrainer computes it: preference tuning on single answers labelled good
or bad (data prepared with --format unpaired), against a reference model as DPO's.

An answer's implicit reward is r = beta x (policy - reference log-probability of it). Its loss is measured from a
reference point z0, the KL divergence of the policy from the reference, estimated on the batch's prompts each paired
with another example's answer (the one before it in its micro-batch, the first with the last, as TRL rotates them
within a device's batch): z0 is the mean of those mismatched pairs' policy - reference log-probabilities over the
global batch, clamped at 0 and detached (one all-reduce before the first backward, so 2 ranks equal 1 process; TRL
averages each device's mean, the same when the devices hold as many answers). A desirable answer's loss is
desirable_weight x (1 - sigmoid(beta (r - z0))), an undesirable one's undesirable_weight x (1 - sigmoid(beta (z0 -
r))); the loss is their mean over the global batch's answers. The mismatched pairs cost two forward passes without
gradient per micro-batch, the policy's and the reference's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_trainer.config import PreferenceConfig
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import ShardingPlan
from fsdp_trainer.distributed.runtime import sum_over_ranks
from fsdp_trainer.loss import IGNORE, SequenceLogProbs
from fsdp_trainer.steps.base import Step
from fsdp_trainer.steps.examples import examples_of, packed
from fsdp_trainer.steps.reference import AgainstReference, Reference, held

SUMS = ("rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected", "count/chosen", "count/rejected")
"""What a micro-batch sums over its answers, the desirable ones' and the undesirable ones' apart, and their counts:
from their means over the global batch, TRL's metrics (reported)."""


def answers(batch: MicroBatch, chunks: int = 1) -> SequenceLogProbs:
    """The objective that sums each answer's log-probability, in the order of `batch.sequences`."""
    return SequenceLogProbs(batch.targets, batch.sequences, len(batch.desirable), chunks, batch.trained)


def mismatched(batch: MicroBatch) -> MicroBatch:
    """The micro-batch's prompts, each with the answer of the example before it (the first with the last's), packed
    into windows of its length, an answer cut where its window ends; `desirable` only counts them."""
    examples = examples_of(batch, last_answer=False)
    length = batch.inputs.shape[1]
    others = [answer for _, answer in examples[-1:] + examples[:-1]]
    pairs = [(prompt, answer[: length - len(prompt)]) for (prompt, _), answer in zip(examples, others, strict=True)]
    return packed(pairs, length, batch.inputs.device)._replace(desirable=torch.zeros(len(pairs), dtype=torch.bool))


class KTO(AgainstReference):
    """What the house asks of KTO before its step is built: its data, its metrics, the reference's price."""

    name = "kto"
    chosen_by = "set preference.loss kto"
    trains_on = "unpaired"
    prepared_with = "tools/prepare_data.py --format unpaired"
    metrics = SUMS
    shown = {"kl": "kl", "rewards/margins": "margin"}

    @classmethod
    def wanted(cls, recipe: Any) -> bool:
        return recipe.preference.loss == "kto"

    @classmethod
    def forward_params(cls, recipe: Any, n_params: int) -> int:
        return 3 * n_params  # the reference on the answers; the policy and the reference on the mismatched pairs

    @classmethod
    def plan_note(cls, recipe: Any, estimates: list) -> str:
        return (
            f"preference.loss kto: the reference model is {held(estimates)}; each micro-step runs it forward twice "
            "(the answers; the prompts with other answers) and the policy once more without gradient (the KL reference "
            "point), each gathering the weights again (in `sent` and in the predicted step time). The planner's check "
            "on fake tensors leaves out the reference point's two forward passes (their windows are taken apart on "
            "the host); without gradient, their memory stays below the step's backward"
        )

    @classmethod
    def fake_batch(cls, batch: MicroBatch) -> MicroBatch:
        """Windows each holding one example, its first half the prompt, alternately desirable."""
        rows, length = batch.inputs.shape
        answer = torch.arange(length) >= length // 2
        sequences = torch.where(answer, torch.arange(rows)[:, None], -1)
        desirable = torch.arange(rows) % 2 == 0
        return MicroBatch(batch.inputs, batch.targets.masked_fill(~answer, IGNORE), None, sequences, 0, desirable)


class KTOStep(KTO, Step):
    """KTO's loss and TRL's metrics (kl, rewards/..., logps/...), means over the global batch's answers, the rewards and
    log-probabilities over its desirable (chosen) or undesirable (rejected) ones."""

    def __init__(self, cfg: PreferenceConfig, reference: Reference, chunks: int = 1):
        super().__init__()
        self.beta, self.weights_by_label = cfg.beta, (cfg.desirable_weight, cfg.undesirable_weight)
        self.reference, self.chunks = reference, chunks
        self.starts += reference.starts()
        self.step, self.kl = 0, torch.zeros(())

    def units(self, micro_batches: list[MicroBatch], world: int) -> torch.Tensor:
        """The answers of the global batch, on the device (one all-reduce)."""
        return sum_over_ranks(sum(self.batch_units(batch) for batch in micro_batches))

    def batch_units(self, batch: MicroBatch) -> torch.Tensor:
        return torch.tensor(float(len(batch.desirable)), device=batch.inputs.device)

    def begin(self, step: int) -> None:
        self.step = step

    @torch.no_grad()
    def reference_point(self, model: nn.Module, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """z0: the mean over the global batch of its mismatched pairs' policy - reference log-probabilities,
        clamped at 0 (one all-reduce)."""
        total = None
        for batch in micro_batches:
            pairs = mismatched(batch)
            gap = model(pairs.inputs, pairs.documents, loss=answers(pairs, self.chunks))
            gap = gap - self.reference.logps(pairs, answers(pairs, self.chunks))
            row = torch.stack([gap.sum(), torch.tensor(float(len(gap)), device=gap.device)])
            total = row if total is None else total + row
        total = sum_over_ranks(total)
        return (total[0] / total[1]).clamp(min=0)

    def __call__(
        self, model: nn.Module, micro_batches: list[MicroBatch], plan: ShardingPlan, backward, world: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """Step.__call__ after the reference point. A step never begun (the planner's on fake tensors, whose windows
        cannot be taken apart on the host) takes z0 = 0."""
        device = micro_batches[0].inputs.device
        self.kl = self.reference_point(model, micro_batches) if self.step > 0 else torch.zeros((), device=device)
        loss, numbers = super().__call__(model, micro_batches, plan, backward, world)
        return loss, self.reported(numbers)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, micro_batches: list[MicroBatch]) -> dict[str, torch.Tensor]:
        self.kl = self.reference_point(model, micro_batches)
        return self.reported(super().evaluate(model, micro_batches))

    def reported(self, numbers: dict) -> dict:
        """TRL's metrics from the means over the global batch's answers of SUMS: each kind of answer's mean (0 when
        the batch holds none), the margin between them, and kl (z0)."""
        chosen, rejected = numbers.pop("count/chosen"), numbers.pop("count/rejected")
        for name, count in (("chosen", chosen), ("rejected", rejected)):
            for value in ("rewards", "logps"):
                numbers[f"{value}/{name}"] = numbers[f"{value}/{name}"] / count.clamp(min=1e-12)
        numbers["rewards/margins"] = numbers["rewards/chosen"] - numbers["rewards/rejected"]
        numbers["kl"] = self.kl
        return numbers

    def sums(self, model: nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's summed loss over its answers, and its sums of SUMS."""
        reference = self.reference.logps(batch, answers(batch, self.chunks))
        policy = model(batch.inputs, batch.documents, loss=answers(batch, self.chunks))
        ratio, good = policy - reference, batch.desirable
        desirable_weight, undesirable_weight = self.weights_by_label
        losses = torch.where(
            good,
            desirable_weight * (1 - F.sigmoid(self.beta * (ratio - self.kl))),
            undesirable_weight * (1 - F.sigmoid(self.beta * (self.kl - ratio))),
        )
        rewards, logps, chosen = self.beta * ratio.detach(), policy.detach(), good.float()
        rejected = 1 - chosen
        sums = [(rewards * chosen).sum(), (logps * chosen).sum(), (rewards * rejected).sum(), (logps * rejected).sum()]
        return losses.sum(), torch.stack([*sums, chosen.sum(), rejected.sum()])
