"""Knowledge distillation: the model learns a frozen teacher's next-token distributions (loss.DistillationLoss), on
the same token windows or packed examples as next-token prediction, over the same targets.

The teacher is a model of its own size and family, read from a checkpoint (any world size) and sharded over the
same mesh as the model: frozen, in the compute dtype, forward only, no gradients and no optimizer state. Each
micro-batch it runs forward to its final hidden states; its output layer, which the student's objective calls slice
by slice, stays gathered until the student's backward has recomputed those slices, then is freed
(`after_backward`). It is one of the run's starts: recorded with its fingerprint in every checkpoint, loaded again
on resume, and a changed teacher refused. With distill.lmbda, some steps train on the model's own answers instead
of the data's (on_policy.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fsdp_trainer.checkpoint.starts import Start
from fsdp_trainer.checkpoint.storage import checkpoint_tokenizer, resolve_checkpoint, saved_sections
from fsdp_trainer.config import DistillConfig, ModelConfig, compute_dtype
from fsdp_trainer.data.format import open_tokens
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import ShardingPlan, reshard, uses_flex_attention
from fsdp_trainer.distributed.runtime import DistEnv
from fsdp_trainer.generation import SamplingShape
from fsdp_trainer.loss import DistillationLoss
from fsdp_trainer.model import count_params
from fsdp_trainer.steps.base import Kind, frozen_copy
from fsdp_trainer.steps.next_token import NextTokenStep
from fsdp_trainer.steps.on_policy import OnPolicy, rehearse
from fsdp_trainer.tokenizer import fingerprint

TEACHER_FILE = "teacher.json"
"""In a distillation run's step directory: where its teacher's weights came from (checkpoint/starts.py)."""

BETAS = {"forward_kl": 0.0, "reverse_kl": 1.0}
"""distill.loss as the generalized JSD's beta; jsd takes distill.beta."""


def teacher_sections(recipe: Any) -> tuple[Path, dict]:
    """(the teacher's step directory, the recipe sections it was saved with), read without its weights."""
    path = resolve_checkpoint(recipe.distill.teacher, "distill.teacher")
    return path, saved_sections(path)


def teacher_config(recipe: Any) -> ModelConfig:
    """The teacher's model section."""
    return teacher_sections(recipe)[1]["model"]


def check_teacher(recipe: Any) -> None:
    """The teacher exists, is complete, and speaks the model's tokens: ValueError naming what differs."""
    path, sections = teacher_sections(recipe)
    vocab_size = sections["model"].vocab_size
    if vocab_size != recipe.model.vocab_size:
        raise ValueError(
            f"distill.teacher {path} has a vocabulary of {vocab_size} and this model {recipe.model.vocab_size}: a "
            "teacher must predict the same tokens"
        )
    tokenizer = checkpoint_tokenizer(path, sections["data"].tokenizer_path)
    if tokenizer is None:
        raise ValueError(f"distill.teacher {path} carries no tokenizer to check against data.tokenizer_path")
    if fingerprint(tokenizer) != fingerprint(recipe.data.tokenizer_path):
        raise ValueError(
            f"distill.teacher {path} was trained with the tokenizer {tokenizer}, not this run's "
            f"{recipe.data.tokenizer_path} (their files differ): a teacher must use the model's tokenizer"
        )
    if recipe.distill.lmbda > 0:
        paths = [source.path for source in recipe.data.mixture or []] or [recipe.data.train_path]
        for path in paths:
            if open_tokens(path).packed_seq_len is None:
                raise ValueError(
                    f"distill.lmbda={recipe.distill.lmbda} samples answers to the prompts of chat examples, and {path} "
                    "holds token windows: prepare chat data (tools/prepare_data.py --format chat) or set it to 0"
                )


STORED_TOP_K = 64
"""The teacher's logits per token a stored-logits alternative would keep (planner's note)."""


def stored_logits_note(recipe: Any) -> str:
    """When a teacher's top-k logits computed once before training and read from disk would be cheaper than the
    teacher held beside the model (not offered): its share of a step's FLOPs, and the bytes a token they take."""
    teacher, student = count_params(teacher_config(recipe)), count_params(recipe.model)
    share = 2 * teacher / (6 * student + 2 * teacher)  # forward 2 FLOPs a parameter a token; training 6
    return (
        f"Its top-{STORED_TOP_K} logits stored once ({STORED_TOP_K * 6} bytes a token: int32 ids, fp16 values) "
        f"would spare its shards and its forward ({share:.0%} of a step's FLOPs) for one pass of it over the data "
        "before training: less memory always, less compute from the data's second epoch on, exact only in the top "
        f"{STORED_TOP_K}, and no use to on-policy steps (distill.lmbda); this trainer does not offer it"
    )


def final_hidden(hidden: torch.Tensor, output: nn.Module) -> torch.Tensor:
    """An objective for the teacher's forward: its final hidden states, not its logits."""
    return hidden


class Distillation(Kind):
    """What the house asks of distillation before its step is built: its metrics, its teacher's checks and price."""

    name = "distillation"
    chosen_by = "set distill.teacher to a checkpoint"
    splits_windows = False  # not the next-token step's: the teacher and its sampler take windows whole
    metrics = ("kd_loss", "ce_loss", "teacher_ce_loss")  # the last the teacher's own, on the same targets: the floor
    shown = {"kd_loss": "kd"}

    @classmethod
    def wanted(cls, recipe: Any) -> bool:
        return getattr(recipe, "distill", None) is not None and recipe.distill.teacher is not None

    @classmethod
    def check(cls, recipe: Any) -> None:
        check_teacher(recipe)

    @classmethod
    def frozen_params(cls, recipe: Any, n_params: int, adapted: bool) -> int:
        return count_params(teacher_config(recipe))

    @classmethod
    def forward_params(cls, recipe: Any, n_params: int) -> int:
        return count_params(teacher_config(recipe))

    @classmethod
    def held_gathered_params(cls, recipe: Any) -> int:
        teacher = teacher_config(recipe)  # its FSDP root: the embedding and the output layer
        return teacher.vocab_size * teacher.dim * (1 if teacher.tie_embeddings else 2)

    @classmethod
    def plan_note(cls, recipe: Any, estimates: list) -> str:
        root_gb = cls.held_gathered_params(recipe) * compute_dtype(recipe.parallel.mixed_precision).itemsize / 1e9
        note = (
            f"distill.teacher: {count_params(teacher_config(recipe)):,} parameters, frozen in the compute dtype "
            "and sharded as the model; its forward each micro-step gathers its weights again (in `sent`), and its "
            f"embedding and output layer ({root_gb:.2f} GB) stay gathered from its forward to the model's backward "
            "(both in `reference`). " + stored_logits_note(recipe)
        )
        if recipe.distill.lmbda == 0:
            return note
        sampling = max(e.sampling_gb for e in estimates)
        return (
            f"{note}. distill.lmbda: an on-policy step first samples with the model gathered whole, a KV cache and a "
            f"decode pass's logits ({sampling:.2f} GB beside the sharded state: `sampling`, in each row's peak), its "
            f"{recipe.distill.max_new_tokens} decode passes a micro-batch priced by the bytes they read, in "
            f"{recipe.distill.lmbda:.0%} of the steps (in the predicted step time: a floor, kernel launches unpriced)"
        )

    @classmethod
    def sampling(cls, recipe: Any) -> SamplingShape | None:
        data, cfg = recipe.data, recipe.distill
        if cfg.lmbda == 0:
            return None
        positions = data.seq_len + cfg.max_new_tokens
        return SamplingShape(data.micro_batch_size, 1, positions, cfg.max_new_tokens, data.grad_accum_steps, cfg.lmbda)


class DistillStep(Distillation, NextTokenStep):
    """The teacher's forward (no gradient), then the model's forward and backward with DistillationLoss, micro-batch
    by micro-batch; the loss and kd_loss / ce_loss are means over the global batch's targets."""

    def __init__(
        self,
        cfg: DistillConfig,
        teacher: nn.Module,
        source: Path,
        chunks: int = 1,
        sampler: OnPolicy | None = None,
    ):
        super().__init__(chunks)
        self.cfg, self.teacher, self.sampler = cfg, teacher, sampler
        self.beta = BETAS.get(cfg.loss, cfg.beta)
        self.starts.append(Start(TEACHER_FILE, teacher, "teacher is", source=source))
        self.step, self.sampled = 0, False

    @classmethod
    def build(cls, recipe: Any, env: DistEnv, policy: nn.Module) -> DistillStep:
        """The step with its teacher built on the meta device from its checkpoint's model section, parallelized as
        the policy is (build.build_step materializes it; the checkpointer loads its weights)."""
        source, sections = teacher_sections(recipe)
        flex = uses_flex_attention(recipe.parallel, env.device)
        teacher = frozen_copy(sections["model"], recipe.parallel, env.mesh, flex)
        sampler = None
        if recipe.distill.lmbda > 0:
            sampler = OnPolicy(recipe.distill, recipe.train.seed, recipe.data.tokenizer_path)
        return cls(recipe.distill, teacher, source, recipe.train.loss_chunks, sampler)

    def begin(self, step: int) -> None:
        self.step = step

    def __call__(
        self, model: nn.Module, micro_batches: list[MicroBatch], plan: ShardingPlan, backward, world: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """Step.__call__, on the model's own answers on the steps the sampler draws."""
        # A step never begun (the planner's on fake tensors) trains on the batches it is given, after what sampling
        # them would allocate.
        self.sampled = self.sampler is not None and self.step > 0 and self.sampler.due(self.step)
        if self.sampler is not None and self.step == 0:
            inputs = micro_batches[0].inputs
            rehearse(model, plan, inputs, 1, inputs.shape[1] + self.cfg.max_new_tokens)
        if self.sampled:
            micro_batches = self.sampler.batches(model, micro_batches, plan, self.step)
        return super().__call__(model, micro_batches, plan, backward, world)

    def extra(self, micro_batches: list[MicroBatch], units: torch.Tensor | float) -> dict[str, torch.Tensor | float]:
        on_policy = {} if self.sampler is None else {"on_policy": float(self.sampled)}  # 1: the step's answers sampled
        return {**super().extra(micro_batches, units), **on_policy}

    def sums(self, model: nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha x the divergence + (1 - alpha) x the cross-entropy, summed over the targets; the sums of kd_loss,
        ce_loss and teacher_ce_loss)."""
        with torch.no_grad():
            teacher_hidden = self.teacher(batch.inputs, batch.documents, loss=final_hidden)
        self.teacher.unshard()  # its root (output layer, embedding) stays gathered until after_backward
        cfg = self.cfg
        objective = DistillationLoss(
            batch.targets, teacher_hidden, self.teacher.lm_head, self.beta, cfg.temperature, cfg.alpha, self.chunks,
            batch.trained,
        )  # fmt: skip
        sums = model(batch.inputs, batch.documents, loss=objective)
        return sums[0], sums[1:].detach()

    def after_backward(self) -> None:
        reshard(self.teacher)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, micro_batches: list[MicroBatch]) -> dict[str, torch.Tensor]:
        numbers = super().evaluate(model, micro_batches)
        reshard(self.teacher)
        return numbers
