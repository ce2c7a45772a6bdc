"""What every training kind is asked, and the loop they share.

A kind is a subclass of Step in a file of its own beside this one. The rest of the house never reads a kind's recipe
section: it asks the kind, through these class attributes and methods,

- whether a recipe asks for it (`wanted`), and how a user would ask (`chosen_by`), for the one line that names it;
- what data it trains on (`trains_on`: token windows and packed examples, or preference pairs), checked before any
  process group exists;
- for the step itself (`build`): the losses of one optimizer step's micro-batches, their backward, and its evaluation;
- the models it holds frozen beside the one it trains (`starts`): each takes the weights the run started from, and
  the checkpointer records where they came from and loads them again on resume (checkpoint/starts.py);
- its metrics beside the loss (`metrics`), which metrics.jsonl, TensorBoard and W&B carry under these names, and
  those the log line shows (`shown`);
- its price for the planner: the weights it holds frozen beside the policy (`frozen_params`), the weights it runs
  forward without gradient each micro-step (`forward_params`), and a micro-batch of its data at given shapes
  (`fake_batch`): a frozen copy of the model, or a teacher of another size, priced without the planner knowing which.

The accumulation over micro-batches is written once, here (`__call__`); so is the evaluation (`evaluate`). A kind
says what one micro-batch contributes (`sums`) and how many units the global batch holds (`units`: the targets, the
pairs), so every number is a mean over the global batch however it is split over ranks and micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_trainer.checkpoint.starts import Start
from fsdp_trainer.config import ModelConfig, ParallelConfig, compute_dtype
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import ShardingPlan, parallelize, reshard, set_gradient_sync
from fsdp_trainer.distributed.runtime import DistEnv, sum_over_ranks
from fsdp_trainer.generation import SamplingShape
from fsdp_trainer.loss import share_of_global_mean
from fsdp_trainer.model import Transformer, on_meta
from fsdp_trainer.moe import aux_loss, forget_routing

DataKind = Literal["tokens", "pairs", "unpaired", "prompts"]
"""What a token file holds: token windows or packed examples, packed preference pairs, packed unpaired answers, or
prompts (a window each) with their records."""
DATA_KINDS: dict[str, str] = {
    "tokens": "token windows or examples",
    "pairs": "preference pairs",
    "unpaired": "unpaired answers (prompt, completion, label)",
    "prompts": "prompts (a prompt and its columns a record)",
}


def data_kind(tokens: Any) -> DataKind:
    """The kind of data a token file (or a mixture) holds."""
    return {"preference": "pairs", "unpaired": "unpaired", "prompts": "prompts"}.get(tokens.records, "tokens")


class Kind:
    """What the house asks a training kind before anything is built, answered from the recipe: whether it is
    wanted, its data, its metrics, how to build its step; and what the planner (planner/memory.py) prices beside what
    every run costs: a frozen copy of the model, or a teacher of another size, priced without knowing which."""

    name: ClassVar[str]
    """What the kind is called in log lines and checkpoints' kind checks."""
    chosen_by: ClassVar[str]
    """How a recipe asks for this kind, for a line that tells a user how."""
    trains_on: ClassVar[DataKind]
    prepared_with: ClassVar[str]
    """The command that prepares its data, for a line that tells a user how."""
    metrics: ClassVar[tuple[str, ...]] = ()
    """What a step reports beside its loss (means over the global batch), under these names."""
    shown: ClassVar[dict[str, str]] = {}
    """The metrics the log line carries beside the loss, with their labels."""
    splits_windows: ClassVar[bool] = False
    """Whether its step can train on a share of each window (context parallelism: distributed/context_parallel.py),
    each micro-batch's `context` passed to the model."""

    @classmethod
    def wanted(cls, recipe: Any) -> bool:
        """Whether `recipe` (a Recipe, or a checkpoint's recipe sections as attributes) trains this kind."""
        raise NotImplementedError

    @classmethod
    def check(cls, recipe: Any) -> None:
        """What this kind needs that can be checked before any process group exists (a teacher that can teach the
        model): ValueError / FileNotFoundError naming what to fix."""

    @classmethod
    def build(cls, recipe: Any, env: DistEnv, policy: nn.Module) -> Step:
        """The step of a run that trains `policy` (built, parallelized and initialised), with the frozen models it
        holds (its `starts`) built beside it, parallelized as the policy is, on the meta device: the caller
        materializes them (build.build_step), and the checkpointer fills them."""
        raise NotImplementedError

    @classmethod
    def frozen_params(cls, recipe: Any, n_params: int, adapted: bool) -> int:
        """The parameters of the models this kind holds frozen beside the policy (in the compute dtype, sharded as the
        policy is), for a policy of `n_params`; `adapted`: the policy carries adapters."""
        return 0

    @classmethod
    def forward_params(cls, recipe: Any, n_params: int) -> int:
        """The parameters it runs forward without gradient each micro-step beside the policy's forward and backward
        (each gathered again, at 2 FLOPs a token each)."""
        return 0

    @classmethod
    def held_gathered_params(cls, recipe: Any) -> int:
        """The parameters of its frozen models it keeps gathered through the policy's forward and backward (a
        teacher's output layer), beyond their shards."""
        return 0

    @classmethod
    def trained_rows(cls, recipe: Any) -> int:
        """The windows a micro-batch trains on, for the planner (its activations, logits and FLOPs): the data's."""
        return recipe.data.micro_batch_size

    @classmethod
    def sampling(cls, recipe: Any) -> SamplingShape | None:
        """What a step samples with the model before it trains (an online kind), for the planner; None: nothing."""
        return None

    @classmethod
    def plan_note(cls, recipe: Any, estimates: list) -> str | None:
        """A line for the planner's table (planner.memory.Estimate rows) on what this kind's frozen models cost."""
        return None

    @classmethod
    def fake_batch(cls, batch: MicroBatch) -> MicroBatch:
        """A micro-batch of this kind's data with the shapes of `batch` (random windows), for the planner's check."""
        return batch


class Step(Kind):
    """A training kind's step: the losses of one optimizer step's micro-batches for train.train_step, with backward,
    and the same numbers without gradient for evaluation."""

    weights: tuple[float, ...] = (1.0,)
    """The loss is a weighted sum of means, each over its own units (a pair loss over the pairs, an NLL term over the
    chosen answers' tokens): one weight per term; `units`, `batch_units` and `sums` give a count and a sum per term."""
    terms: tuple[str, ...] = ()
    """The names under which the means of the terms after the first are logged, unweighted (e.g. nll_loss)."""

    def __init__(self) -> None:
        self.starts: list[Start] = []  # the frozen models it holds that take the weights the run started from

    def units(self, micro_batches: list[MicroBatch], world: int) -> torch.Tensor | float:
        """What the global batch's means are over (its targets, its pairs; one count per term), the same on every rank:
        the metrics are means over the first."""
        raise NotImplementedError

    def batch_units(self, batch: MicroBatch) -> torch.Tensor | int:
        """How many units one micro-batch holds (one count per term)."""
        raise NotImplementedError

    def sums(self, model: nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's loss terms, each summed over its units, with gradient where enabled; the sums of
        `metrics` over its units of the first term, a 1-d tensor)."""
        raise NotImplementedError

    def extra(self, micro_batches: list[MicroBatch], units: torch.Tensor | float) -> dict[str, torch.Tensor | float]:
        """Numbers about the global batch to log beside the loss (its supervised tokens, its pairs)."""
        return {}

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """(the global batch's mean loss, its metrics), after backward of every micro-batch: accumulate(self, model,
        micro_batches, plan, backward, world)."""
        return accumulate(self, *args, **kwargs)

    def prepare(self, recipe: Any, env: DistEnv, files: dict[str, Any], records: dict[str, bytes]) -> None:
        """Called once before the first step, when the frozen models hold the weights the run started from (their
        `records`, checkpoint/starts.py), with the run's token files by split (train, val: None without one): for a
        kind that computes something of its data first (a cached reference)."""

    def begin(self, step: int) -> None:
        """Called before optimizer step `step` (from 1, counted across resumes), for a kind whose step depends on which
        it is (on-policy distillation samples on the steps (seed, step) draws)."""

    def read(self, loader: Any) -> list[MicroBatch]:
        """This step's micro-batches from the run's data loader (data.loader.TokenLoader), after `begin`: its next
        global batch; a kind that trains several steps on what one step made of its data (online RL sampling for
        grpo.steps_per_generation steps) reads more at that step and none at the others."""
        return loader.next_batch()

    def carried(self) -> dict[str, Any]:
        """What a resume needs of this step beyond the model, optimizer and data (online RL's completions that later
        steps train on): Stateful objects by name, saved and restored with the run's states."""
        return {}

    def after_backward(self) -> None:
        """Free what a micro-batch's forward kept for its backward beside the model (a teacher's output layer)."""

    @torch.no_grad()
    def evaluate(self, model: nn.Module, micro_batches: list[MicroBatch]) -> dict[str, torch.Tensor]:
        """The mean loss and metrics over the units of every rank's micro-batches (one all-reduce)."""
        totals = None
        for batch in micro_batches:
            terms, metrics = self.sums(model, batch)
            units = torch.as_tensor(self.batch_units(batch), dtype=terms.dtype, device=terms.device)
            row = torch.cat([terms.reshape(-1), metrics, units.reshape(-1)])
            totals = row if totals is None else totals + row
        reshard(model)
        totals, k = sum_over_ranks(totals), len(self.weights)
        loss, numbers = global_means(self, totals[:-k], totals[-k:] if k > 1 else totals[-1])
        return {"loss": loss, **numbers}


def accumulate(
    step: Step,
    model: nn.Module,
    micro_batches: list[MicroBatch],
    plan: ShardingPlan,
    backward: Callable[[torch.Tensor], None],
    world: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
    """Step.__call__: each micro-batch's forward and backward, its loss terms scaled to their share of the global
    batch's means; gradients are reduced across ranks after each micro-batch or after the last only, as the plan says
    (set_gradient_sync).
    A mixture of experts adds its router's load-balancing loss, moe.aux_loss_coef x its mean over the global batch's
    micro-batches (each micro-batch's as transformers computes it for one batch), logged as aux_loss."""
    units = step.units(micro_batches, world)  # one all-reduce, queued before the first backward
    totals, routed = None, False
    for i, batch in enumerate(micro_batches):
        set_gradient_sync(model, plan, i == len(micro_batches) - 1)
        terms, metrics = step.sums(model, batch)
        loss = weighted(step.weights, share_of_global_mean(terms.reshape(-1), units, world))
        router = aux_loss(model, batch.context and batch.context.summed)  # None for a dense model
        if router is not None:
            routed, coef = True, model.cfg.moe.aux_loss_coef
            loss = loss + coef * share_of_global_mean(router, len(micro_batches) * world, world)
        backward(loss)
        step.after_backward()
        forget_routing(model)
        row = torch.cat([terms.detach().reshape(-1), metrics, *([] if router is None else [router.detach()[None]])])
        totals = row if totals is None else totals + row
    totals = sum_over_ranks(totals)  # the loss terms, the metrics and the router's loss: one all-reduce
    loss, numbers = global_means(step, totals[:-1] if routed else totals, units)
    numbers = {**step.extra(micro_batches, units), **numbers}
    if not routed:
        return loss, numbers
    aux = totals[-1] / (len(micro_batches) * world)
    return loss + coef * aux, {**numbers, "aux_loss": aux}


def global_means(
    step: Step, totals: torch.Tensor, units: torch.Tensor | float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the loss, the step's metrics and its terms after the first, by name) from the global batch's sums of the loss
    terms and the metrics (`totals`), and its units."""
    k = len(step.weights)
    means, metrics = totals[:k] / units, totals[k:] / (units if k == 1 else units[0])
    named = {**dict(zip(step.metrics, metrics, strict=True)), **dict(zip(step.terms, means[1:], strict=True))}
    return weighted(step.weights, means), named


def weighted(weights: tuple[float, ...], means: torch.Tensor) -> torch.Tensor:
    """A loss from its terms' means (k,): their weighted sum."""
    if len(weights) == 1:
        return means[0]
    return sum(weight * mean for weight, mean in zip(weights, means.unbind(), strict=True))


def frozen_copy(
    cfg: ModelConfig, parallel: ParallelConfig, mesh: DeviceMesh, flex_attention: bool = False
) -> Transformer:
    """A model a kind holds frozen beside the policy (a reference, a teacher) on the meta device, parallelized as the
    policy is, to be materialized: every parameter frozen and held in the compute dtype (what FSDP gathers anyway, so
    a copy of the policy computes its forward bitwise); the buffers (RoPE's tables) stay fp32. Each block frees its
    gathered weights after its forward under every sharding."""
    with on_meta():
        frozen = Transformer(cfg, flex_attention=flex_attention)
    frozen.requires_grad_(False)
    for param in frozen.parameters():
        param.data = param.data.to(compute_dtype(parallel.mixed_precision))
    parallelize(frozen, parallel, mesh)
    for block in frozen.model.layers.values():
        # No backward comes to keep its gathered weights for (SHARD_GRAD_OP would hold them all after its forward).
        block.set_reshard_after_forward(True, recurse=False)
    return frozen
