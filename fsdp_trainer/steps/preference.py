"""Preference tuning (DPO and its variants): what a training step and an evaluation compute on pairs of answers.

A micro-batch of preference data (data/loader.py) is packed windows in which each pair's two conversations sit side
by side, the chosen one first, attended to block-causally, so no answer sees another. Its forward gives each answer's
summed log-probability (loss.SequenceLogProbs) under the policy (the model being trained) and, with no gradient,
under the reference (the model the run started from); loss.PreferenceLoss turns the four numbers of each pair into
its loss and TRL's reward metrics.

Every number is a mean over the pairs of the whole global batch, whatever its split over ranks and micro-batches:
each micro-batch's summed loss is scaled by the global number of pairs (share_of_global_mean), counted in one
all-reduce queued before the first backward, and the metrics are summed and all-reduced once, on the device.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_trainer.adapters import has_adapters
from fsdp_trainer.adapters.lora import adapters_disabled
from fsdp_trainer.checkpoint.starts import Start
from fsdp_trainer.config import PreferenceConfig, Recipe, compute_dtype
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import parallelize, reshard, uses_flex_attention
from fsdp_trainer.distributed.runtime import DistEnv, sum_over_ranks
from fsdp_trainer.loss import IGNORE, PreferenceLoss, SequenceLogProbs
from fsdp_trainer.model import Transformer
from fsdp_trainer.steps.base import Step

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""What a preference step reports beside its loss, under TRL's names (means over the global batch's pairs)."""


def frozen_copy(recipe: Recipe, mesh: DeviceMesh, flex_attention: bool = False) -> Transformer:
    """A full fine-tuning run's reference on the meta device, parallelized as the policy is, to be materialized: every
    parameter frozen and held in the compute dtype (what FSDP gathers anyway, so its forward is the policy's at step 0,
    bitwise); the buffers (RoPE's tables) stay as the policy's."""
    with torch.device("meta"):
        frozen = Transformer(recipe.model, flex_attention=flex_attention)
    frozen.requires_grad_(False)
    for param in frozen.parameters():
        param.data = param.data.to(compute_dtype(recipe.parallel.mixed_precision))
    parallelize(frozen, recipe.parallel, mesh)
    return frozen


class Reference:
    """The model the rewards are measured against: the policy with its adapters off (LoRA: no second copy of the
    weights), or `frozen`, a copy of the model the run started from with no gradients and no optimizer state."""

    def __init__(self, policy: nn.Module, frozen: nn.Module | None = None):
        self.policy, self.frozen = policy, frozen

    @torch.no_grad()
    def logps(self, batch: MicroBatch, chunks: int = 1) -> torch.Tensor:
        """Each answer's summed log-probability under the reference (2 x pairs,), chosen and rejected alternating."""
        model = self.frozen if self.frozen is not None else self.policy
        with adapters_disabled(self.policy) if self.frozen is None else nullcontext():
            logps = model(batch.inputs, batch.documents, loss=_objective(batch, chunks))
        if self.frozen is not None:
            reshard(self.frozen)
        return logps


def _objective(batch: MicroBatch, chunks: int) -> SequenceLogProbs:
    return SequenceLogProbs(batch.targets, batch.sequences, 2 * batch.pairs, chunks)


REFERENCE_FILE = "reference.json"
"""In a full fine-tuning preference run's step directory: where its frozen reference model's weights came from, the
model the run started from (checkpoint/starts.py)."""


class PreferenceStep(Step):
    """The losses of one optimizer step's micro-batches of preference pairs: the reference's log-probabilities
    (no gradient), then the policy's forward and backward, micro-batch by micro-batch; the loss and TRL's reward
    metrics are means over the global batch's pairs."""

    name = "preference"
    chosen_by = "set preference.loss (sigmoid for DPO, ipo or robust)"
    trains_on = "pairs"
    prepared_with = "tools/prepare_data.py --format preference"
    metrics = METRICS
    shown = {"rewards/accuracies": "reward accuracy", "rewards/margins": "margin"}

    def __init__(self, cfg: PreferenceConfig, reference: Reference, chunks: int = 1):
        super().__init__()
        self.loss = PreferenceLoss(cfg.loss, cfg.beta, cfg.label_smoothing)
        self.reference, self.chunks = reference, chunks
        if reference.frozen is not None:  # the frozen copy holds the weights the run started from
            self.starts.append(Start(REFERENCE_FILE, reference.frozen, "reference model is"))

    @classmethod
    def wanted(cls, recipe: Any) -> bool:
        return recipe.preference.loss is not None

    @classmethod
    def build(cls, recipe: Any, env: DistEnv, policy: nn.Module) -> PreferenceStep:
        """The step with its reference: with adapters, the policy itself with them switched off; otherwise a frozen
        copy of the model, built and sharded as the policy is, held in the compute dtype (what FSDP gathers anyway, so
        its forward is the policy's at step 0, bitwise), no gradients, no optimizer state; the checkpointer loads the
        weights the run started from into it."""
        frozen = None
        if not has_adapters(policy):  # on meta: build.build_step materializes it
            frozen = frozen_copy(recipe, env.mesh, uses_flex_attention(recipe.parallel, env.device))
        return cls(recipe.preference, Reference(policy, frozen), recipe.train.loss_chunks)

    @classmethod
    def frozen_params(cls, recipe: Any, n_params: int, adapted: bool) -> int:
        return 0 if adapted else n_params  # with adapters, the reference is the policy's own weights

    @classmethod
    def forward_params(cls, recipe: Any, n_params: int) -> int:
        return n_params  # the reference's forward

    @classmethod
    def plan_note(cls, recipe: Any, estimates: list) -> str:
        """What the reference costs in the planner's rows, and what the other way of having it would."""
        sharded = min((e for e in estimates if not e.offload), key=lambda e: e.reference_gb)
        if sharded.reference_gb == 0:
            held = "the policy with its adapters off: no memory of its own"
        else:
            held = f"a frozen copy in the compute dtype, {sharded.reference_gb:.2f} GB per rank sharded (`reference`)"
        return (
            f"preference.loss {recipe.preference.loss}: the reference model is {held}; its forward each micro-step "
            "gathers the weights again (in `sent`) and adds a third of a step's compute (in the predicted step time). "
            "Log-probabilities computed once before training and stored beside the data (8 bytes a pair) would cost "
            "neither during training, but one forward pass over every pair first; this trainer does not offer it yet."
        )

    @classmethod
    def fake_batch(cls, batch: MicroBatch) -> MicroBatch:
        """Windows each holding one pair: two sequences of half the window, each a prompt (its first half, untrained)
        and an answer. Attention is left causal over the window: on a GPU the block-causal mask goes through
        flex_attention's kernel, which, like the causal one, makes no scores matrix, while the boolean mask a CPU uses
        would make one per layer (B x heads x T x T), a memory no GPU run has."""
        rows, length = batch.inputs.shape
        half = length // 2
        position = torch.arange(length)
        second = (position >= half).long()
        answer = (position % half) >= half // 2
        sequences = torch.where(answer, 2 * torch.arange(rows)[:, None] + second, -1)
        return MicroBatch(batch.inputs, batch.targets.masked_fill(~answer, IGNORE), None, sequences, rows)

    def units(self, micro_batches: list[MicroBatch], world: int) -> torch.Tensor:
        """The pairs of the global batch, on the device (one all-reduce)."""
        pairs = float(sum(self.batch_units(batch) for batch in micro_batches))
        return sum_over_ranks(torch.tensor(pairs, device=micro_batches[0].inputs.device))

    def batch_units(self, batch: MicroBatch) -> int:
        return batch.pairs

    def sums(self, model: nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's loss summed over its pairs and its sums of METRICS: the reference's log-probabilities of
        its answers (no gradient), then the policy's (with gradient, where enabled)."""
        reference = self.reference.logps(batch, self.chunks)
        objective = _objective(batch, self.chunks)
        policy = model(batch.inputs, batch.documents, loss=objective)
        lengths = objective.count()
        chosen, rejected, ref_chosen, ref_rejected = policy[0::2], policy[1::2], reference[0::2], reference[1::2]
        losses = self.loss(chosen, rejected, ref_chosen, ref_rejected, lengths[0::2], lengths[1::2])
        rewards = self.loss.rewards(chosen, rejected, ref_chosen, ref_rejected)
        return losses.sum(), torch.stack([rewards[name].sum() for name in METRICS])

    def extra(self, micro_batches: list[MicroBatch], units: torch.Tensor | float) -> dict[str, torch.Tensor | float]:
        return {"pairs": units}
