"""A whole recipe: its sections, and the checks that involve several of them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from fsdp_trainer.config.sections import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    WandbConfig,
    require,
)
from fsdp_trainer.config.tuning import DistillConfig, GRPOConfig, LoraConfig, PreferenceConfig, RewardConfig


@dataclass
class Recipe:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        require(
            not (self.checkpoint.export_hf and self.lora.rank is not None),
            "checkpoint.export_hf writes the model without adapters; with lora.rank set, export with "
            "tools/consolidate.py RUN OUT (merged) or --lora adapter (PEFT)",
        )
        require(
            self.lora.quantize_base is None or not self.parallel.cpu_offload,
            "lora.quantize_base nf4 does not run with parallel.cpu_offload yet; set one of them off",
        )
        tied = sorted({"lm_head", "embed_tokens"} & set(self.lora.targets)) if self.model.tied_output else []
        require(
            self.lora.rank is None or not tied,
            f"lora.targets has {', '.join(tied)}, but model.tie_embeddings ties the output layer to the embedding: an "
            f"adapter on one could not be merged into the weight they share; leave {' and '.join(tied)} out",
        )
        require(
            self.model.num_labels is None or (self.preference.loss is None and self.distill.teacher is None),
            "model.num_labels 1 trains a reward model (on preference pairs, as TRL's RewardTrainer); preference.loss "
            "and distill.teacher train a language model: set them null, or model.num_labels null",
        )
        others = [key for key, on in (("preference.loss", self.preference.loss is not None),
                  ("distill.teacher", self.distill.teacher is not None),
                  ("model.num_labels", self.model.num_labels is not None)) if on]  # fmt: skip
        require(
            not self.grpo.rewards or not others,
            f"grpo.rewards trains by online RL, and {', '.join(others)} asks for another kind: set "
            f"{' and '.join(others)} null, or grpo.rewards []",
        )
        require(
            self.model.num_labels is None or not self.eval.tasks,
            "eval.tasks score a language model, and a reward model (model.num_labels) has no output layer: set "
            "eval.tasks []",
        )
        require(
            self.model.num_labels is None or "lm_head" not in self.lora.targets,
            "lora.targets has lm_head, and a reward model (model.num_labels) has none: its score head trains whole; "
            "leave lm_head out",
        )
        require(
            self.data.seq_len <= self.model.max_seq_len,
            f"data.seq_len={self.data.seq_len} must be <= model.max_seq_len={self.model.max_seq_len}",
        )
        if self.parallel.mixed_precision != "auto":  # auto is checked once resolved (parallelize.apply_compile)
            require(*compiles_experts(self.model, self.parallel.compile, self.parallel.mixed_precision))
        require(
            self.parallel.ac_every == 1 or self.parallel.activation_checkpointing != "none",
            f"parallel.ac_every={self.parallel.ac_every} needs parallel.activation_checkpointing full or selective",
        )


def compiles_experts(model: ModelConfig, compile: bool, mixed_precision: str) -> tuple[bool, str]:
    """(whether the blocks compile in this precision, the error line if not): a mixture of experts' grouped matmuls
    compile in bf16 only (torch's meta kernel refuses other dtypes)."""
    ok = not compile or model.moe is None or mixed_precision == "bf16"
    return ok, (
        f"parallel.compile with a mixture of experts (model.moe) computes in bf16 only (torch compiles its grouped "
        f"matmuls for bf16 alone), and parallel.mixed_precision is {mixed_precision}: set it bf16, or "
        "parallel.compile false"
    )


# `from __future__ import annotations` makes field types strings; resolve them once here.
SECTIONS = {f.name: globals()[f.type] for f in fields(Recipe)}
