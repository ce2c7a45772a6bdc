"""Recipes: typed sections (sections.py, tuning.py; recipe.py the whole), which jsonargparse turns into the CLI and
their attribute docstrings into `--help`, and the one parser every tool reads them with (parse.py).

A recipe is a YAML file with one mapping per section (model, parallel, data, optim, lora, preference, reward, distill,
train, eval, checkpoint, wandb); any key can be overridden on the command line as `--section.key value`. Every check
that can fail does so here, with one `error: ...` line naming the key, before any process group exists.
"""

from fsdp_trainer.config.parse import (
    RecipeError,
    fail,
    load_sections,
    one_line_errors,
    parse_args,
    parse_recipe,
    read_recipe,
    recipe_parser,
    recipe_to_yaml,
    sections_to_yaml,
    write_config,
)
from fsdp_trainer.config.recipe import SECTIONS, Recipe, compiles_experts
from fsdp_trainer.config.sections import (
    AUTO,
    COMPUTE_DTYPES,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    MixtureSource,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    Precision,
    RopeScaling,
    TrainConfig,
    WandbConfig,
    compute_dtype,
    local_layers,
)
from fsdp_trainer.config.tuning import (
    LORA_PROJECTIONS,
    LORA_TARGETS,
    DistillConfig,
    LoraConfig,
    PreferenceConfig,
    RewardConfig,
)

__all__ = [
    "AUTO",
    "COMPUTE_DTYPES",
    "CheckpointConfig",
    "DataConfig",
    "DistillConfig",
    "EvalConfig",
    "LORA_PROJECTIONS",
    "LORA_TARGETS",
    "LoraConfig",
    "MixtureSource",
    "ModelConfig",
    "MoEConfig",
    "OptimConfig",
    "ParallelConfig",
    "Precision",
    "PreferenceConfig",
    "Recipe",
    "RecipeError",
    "RewardConfig",
    "RopeScaling",
    "SECTIONS",
    "TrainConfig",
    "WandbConfig",
    "compiles_experts",
    "compute_dtype",
    "local_layers",
    "fail",
    "load_sections",
    "one_line_errors",
    "parse_args",
    "parse_recipe",
    "read_recipe",
    "recipe_parser",
    "recipe_to_yaml",
    "sections_to_yaml",
    "write_config",
]
