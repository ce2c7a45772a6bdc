"""The pieces of a run, built from its recipe: the model, its data, its step (the training kind's), its checkpointer;
the checks of a run before any process group exists (check_run); the run directory's lock. train.py, launch.py and
the planner share them."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_trainer.adapters import (
    adapter_kind,
    check_adapters,
    has_adapters,
    meta_model,
    read_only_meta_model,
    start_adapters,
)
from fsdp_trainer.adapters.lora import init_lora
from fsdp_trainer.adapters.nf4 import fill_shard
from fsdp_trainer.checkpoint.checkpointer import Checkpointer
from fsdp_trainer.checkpoint.holds import all_holds
from fsdp_trainer.checkpoint.starts import is_adapters_only, lora_base, lora_start
from fsdp_trainer.checkpoint.storage import (
    CheckpointError,
    checkpoint_recipe,
    is_complete,
    resolve_checkpoint,
    saved_entries,
)
from fsdp_trainer.checkpoint.weights import ModelState, check_shapes, saved_shapes
from fsdp_trainer.config import ModelConfig, Recipe, compute_dtype, load_sections
from fsdp_trainer.data.format import Tokens
from fsdp_trainer.data.loader import Mixture, TokenLoader, open_data
from fsdp_trainer.distributed.context_parallel import check_context_parallel
from fsdp_trainer.distributed.expert_parallel import check_expert_parallel
from fsdp_trainer.distributed.parallelize import (
    Parallelized,
    fill_local_shard,
    materialize,
    parallelize,
    uses_flex_attention,
)
from fsdp_trainer.distributed.runtime import DistEnv, process_group_backend
from fsdp_trainer.evaluation.tasks import check_tasks
from fsdp_trainer.files import (
    CHECKPOINTS_DIR,
    RunDirInUse,
    RunLock,
    check_run_dir_free,
    check_writable,
    published_step,
)
from fsdp_trainer.metrics import trained_params
from fsdp_trainer.model import Transformer
from fsdp_trainer.optim import MASTER_WEIGHT_BYTES, optimizer_state_bytes
from fsdp_trainer.sinks import require_wandb
from fsdp_trainer.steps import Step, check_data, training_kind
from fsdp_trainer.tokenizer import fingerprint, first_tokenizer, run_tokenizer_path

logger = logging.getLogger("fsdp_trainer")


def build_model(recipe: Recipe, env: DistEnv) -> tuple[Transformer, Parallelized]:
    """The recipe's model, parallelized and initialised: shapes on meta with the adapters the recipe asks for
    (adapters.meta_model), then AC / compile / FSDP from outside, then each rank allocates and fills its own shards
    (the same weights at any world size); and what was applied."""
    flex = uses_flex_attention(recipe.parallel, env.device)
    frozen_dtype = compute_dtype(recipe.parallel.mixed_precision)
    model = meta_model(recipe.model, recipe.lora, flex, frozen_dtype, quantize=True)
    applied = parallelize(model, recipe.parallel, env.mesh)
    materialize(model, env.device, recipe.train.seed, applied.cpu_offload, fill=fill_shard)
    if has_adapters(model):
        init_lora(model, recipe.train.seed, fill_local_shard, env.device)
    return model, applied


def build_step(recipe: Recipe, env: DistEnv, model: Transformer) -> Step:
    """The step of the kind the recipe trains, with the frozen models it holds built beside `model` and initialised
    as the recipe's model would be (the checkpointer then fills them with the weights the run started from)."""
    step = training_kind(recipe).build(recipe, env, model)
    for start in step.starts:
        materialize(start.model, env.device, recipe.train.seed, recipe.parallel.cpu_offload)
    return step


def build_scores(recipe: Recipe, env: DistEnv):
    """The eval section's tasks, scored on the model as it trains (evaluation/during.py); None without any."""
    if not recipe.eval.tasks:
        return None
    from fsdp_trainer.evaluation.during import TrainingScores  # lm-eval, an optional extra, imported only here

    return TrainingScores(recipe.eval, recipe.data.tokenizer_path, env)


def build_loader(recipe: Recipe, env: DistEnv, tokens: Tokens | Mixture) -> TokenLoader:
    """This rank's share of every global batch of `tokens`, in the order the seed fixes."""
    data = recipe.data
    return TokenLoader(
        tokens,
        data.seq_len,
        data.micro_batch_size,
        data.grad_accum_steps,
        env.data_rank,
        env.data_world,
        seed=recipe.train.seed,
        device=env.device,
        shard=env.shard,
    )


def run_kind(recipe) -> tuple[str, str]:
    """What a run is, for whether a checkpoint resumes it: its training kind and whether it trains adapters."""
    return training_kind(recipe).name, adapter_kind(recipe.lora)


def resumes(recipe: Recipe, path: Path) -> bool:
    """Whether checkpoint `path` is of the run's own kind, to be resumed whole (optimizer, data, step), rather than
    weights to start from: decided from the recipe it was saved with. A weights-only checkpoint (an import) and one
    without a recipe this trainer reads are weights; so is another run's checkpoint of this kind that trained on
    other data (pretraining, then full SFT from it: the next stage, not this run to go on with)."""
    try:
        saved = SimpleNamespace(**load_sections(checkpoint_recipe(path)))
    except (FileNotFoundError, ValueError):
        return False
    if saved_entries(path) == {"model"} or run_kind(saved) != run_kind(recipe):
        return False
    own = Path(path).resolve().is_relative_to(Path(recipe.train.out_dir).resolve())
    return own or training_data(saved.data) == training_data(recipe.data)


def training_data(data) -> list[str]:
    """The files a data section trains on (its train_path, or its mixture's), as absolute paths."""
    paths = [source.path for source in data.mixture] if data.mixture else [data.train_path]
    return [os.path.realpath(path) for path in paths]


def build_checkpointer(recipe: Recipe, env: DistEnv, states: dict[str, Stateful], step: Step) -> Checkpointer:
    """The checkpointer of `states` and of what the step carries, restored as checkpoint.resume says (auto | none |
    PATH), and of the models that hold the weights the run started from (a LoRA run's base, the step's frozen models);
    a fresh LoRA run with lora.adapter starts its adapters from that PEFT adapter."""
    model = states["model"].model
    starts = [*([lora_start(model)] if has_adapters(model) else []), *step.starts]
    states.update(step.carried())  # what the kind carries from step to step
    ckpt = Checkpointer(recipe, env, states, starts, lambda path: resumes(recipe, path))
    if ckpt.load() is None and start_adapters(model, recipe.lora) and env.is_main:
        logger.info(f"adapters loaded from {recipe.lora.adapter}")
    return ckpt


def model_state(model: Transformer) -> ModelState:
    """What a run's checkpoints hold of its model: every weight, or with adapters the adapters alone."""
    return ModelState(model, adapters_only=has_adapters(model))


def lock_out_dir(out_dir: str, env: DistEnv) -> RunLock | None:
    """One live run per train.out_dir: the job's first rank takes the directory's lock before anything is written
    there, and every rank learns whether it did (one broadcast at start-up), so all fail alike; RunDirInUse names the
    holder. Returns the lock on rank 0, None elsewhere."""
    lock, refusal = None, [None]
    if env.is_main:
        lock = RunLock(out_dir)
        try:
            lock.acquire()
        except RunDirInUse as e:
            refusal = [str(e)]
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise RunDirInUse(refusal[0])
    return lock


def check_disk_room(recipe: Recipe) -> None:
    """Fail before any collective, naming the directory, if its disk lacks room for one checkpoint of the recipe's
    model: fp32 weights and the optimizer's state of what it trains, as the planner counts them (gradients are not
    saved; a LoRA run's checkpoints hold its adapters and their state only)."""
    out_dir = recipe.train.out_dir
    model = read_only_meta_model(recipe.model, recipe.lora)
    saved = sum(p.numel() for p in model.parameters() if p.requires_grad)
    need = MASTER_WEIGHT_BYTES * saved + optimizer_state_bytes(recipe.optim, model)
    free = shutil.disk_usage(out_dir).free
    if free < need:
        raise ValueError(
            f"train.out_dir={out_dir} has {free / 1e9:.1f} GB free, and one checkpoint of this model takes "
            f"{need / 1e9:.1f} GB; free space or choose another directory"
        )


def check_start(recipe: Recipe) -> None:
    """The checkpoint the run starts from or resumes (named by checkpoint.resume, or the run's own latest) exists,
    everything its weights come from is there (a LoRA checkpoint's base, unchanged), and it holds the weights of the
    recipe's model: read from its metadata against the model built on the meta device, in seconds."""
    resume, own = recipe.checkpoint.resume, published_step(Path(recipe.train.out_dir) / CHECKPOINTS_DIR)
    fresh = resume == "none" or (resume == "auto" and (own is None or not is_complete(own)))
    held = all_holds(Path(recipe.train.out_dir) / CHECKPOINTS_DIR) if fresh else []
    if held:  # a fresh run there would save its steps over them
        raise CheckpointError(
            f"train.out_dir={recipe.train.out_dir} holds checkpoints other runs depend on ({held[0].step.name}: run "
            f"{held[0].describe()}), which a run starting afresh there would overwrite; choose another train.out_dir, "
            f"or release them (`python tools/verify_checkpoint.py {recipe.train.out_dir} --release RUN`)"
        )
    if fresh:
        return
    field = "checkpoint.resume" if resume != "auto" else "train.out_dir"
    path = resolve_checkpoint(resume, field) if resume != "auto" else own
    check_start_tokenizer(path, recipe.data.tokenizer_path, field)
    weights = path
    while weights is not None and is_adapters_only(weights):  # a LoRA checkpoint's weights are its base's (None: the
        weights = lora_base(weights)  # seeded init), and that base may be a LoRA checkpoint in turn
    if weights is None:
        return
    try:
        saved = saved_shapes(weights)
    except CheckpointError:  # damaged metadata: the workers' verification says so (resume auto falls back past it)
        return
    try:
        model = read_only_meta_model(recipe.model, recipe.lora)
        check_shapes(weights, saved, model.state_dict(), adapters_optional=True)
    except CheckpointError as e:
        raise CheckpointError(f"{field}: {e}; {model_fix(weights, recipe.model)}") from None


def check_start_tokenizer(path: Path, tokenizer_path: str, field: str) -> None:
    """The tokenizer a checkpoint carries (the one its weights learned) is the run's: other files mean its token ids
    would be read as other text."""
    carried = first_tokenizer([path])
    if carried is not None and fingerprint(carried) != fingerprint(tokenizer_path):
        raise ValueError(
            f"{field}: {path} was trained with the tokenizer it carries, and data.tokenizer_path={tokenizer_path} is "
            "another (their files differ), so its token ids would mean other text: set data.tokenizer_path to null "
            "(the checkpoint's own) and prepare the data with that tokenizer"
        )


def model_fix(path: Path, model: ModelConfig) -> str:
    """How a recipe takes the model of checkpoint `path`: the model.yaml of the import it is, else the model keys of
    the recipe it was saved with that differ from `model`'s."""
    imported = path.parents[1] / "model.yaml"
    if imported.is_file():
        return f"add `--recipe {imported}` after your recipe (the model section of that import)"
    saved = _flat(asdict(load_sections(checkpoint_recipe(path))["model"]), "model.")
    ours = _flat(asdict(model), "model.")
    flags = [
        f"--{key} {v if isinstance(v, str) else json.dumps(v)}" for key, v in saved.items() if ours.get(key, ...) != v
    ]
    return f"give the recipe the model it was saved with: {' '.join(flags)}"


def _flat(section: dict, prefix: str) -> dict:
    """A config section's keys as dotted flags (model.moe.experts), a null subsection as itself."""
    flat = {}
    for key, value in section.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def run_summary(recipe: Recipe) -> str:
    """What a run trains, for the line fsdp-train starts with: `sft + LoRA r16, training 2.1M of 494.0M params`."""
    adapters = f" + LoRA r{recipe.lora.rank}" if recipe.lora.rank is not None else ""
    trained = trained_params(read_only_meta_model(recipe.model, recipe.lora), recipe.model)
    return f"{training_kind(recipe).name}{adapters}, training {trained}"


def check_run(recipe: Recipe) -> tuple[Tokens | Mixture, Tokens | None]:
    """Everything about a run that can be wrong before any process group exists: the token files against the
    tokenizer, the model and the training kind, the W&B package, the eval tasks, the output directory (its room, and
    no live run holding it), the checkpoint it starts from, the adapters, the backend. Returns the opened token
    files; raises ValueError / FileNotFoundError naming what to fix. fsdp-train calls it before it starts any worker,
    and every worker again."""
    # null: the tokenizer that travels with the checkpoint the run starts from, recorded resolved in config.yaml.
    data, resume = recipe.data, recipe.checkpoint.resume
    data.tokenizer_path = run_tokenizer_path(data.tokenizer_path, resume, recipe.train.out_dir)
    files = open_data(recipe)
    check_data(recipe, files[0])
    training_kind(recipe).check(recipe)  # what the kind needs beside its data (a teacher that can teach the model)
    check_context_parallel(recipe, training_kind(recipe))
    check_expert_parallel(recipe)
    require_wandb(recipe)
    check_adapters(recipe.model, recipe.lora, recipe.parallel)
    if recipe.eval.tasks:
        try:
            check_tasks(recipe.eval.tasks, recipe.eval.include_path)
        except (ModuleNotFoundError, ValueError) as e:
            raise ValueError(f"eval.tasks: {e}") from None
    process_group_backend(recipe.parallel, torch.cuda.is_available())
    # Last, the checks of the output directory, which the first makes: a run refused by one leaves no empty
    # directory behind (another rank's files there are left).
    made = not os.path.isdir(recipe.train.out_dir)
    check_writable(recipe.train.out_dir, int(os.environ.get("RANK", 0)))
    try:
        check_run_dir_free(recipe.train.out_dir)
        if recipe.checkpoint.every:
            check_disk_room(recipe)
        check_start(recipe)
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(recipe.train.out_dir)
        raise
    return files
