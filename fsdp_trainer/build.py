"""The pieces of a run, built from its recipe: the model, its data, its checkpointer, its reference; and the checks
of a run before any process group exists (check_run) and the run directory's lock. train.py, launch.py and the
planner share them."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from fsdp_trainer.adapters.lora import apply_lora, init_lora, load_adapters
from fsdp_trainer.adapters.nf4 import check_nf4_shapes, fill_shard, quantize_frozen, require_torchao
from fsdp_trainer.checkpoint.checkpointer import Checkpointer, check_disk_room
from fsdp_trainer.checkpoint.storage import resolve_checkpoint
from fsdp_trainer.config import Recipe, compute_dtype
from fsdp_trainer.data.format import Tokens
from fsdp_trainer.data.loader import Mixture, TokenLoader, open_data
from fsdp_trainer.distributed.parallelize import (
    SHARDING,
    Parallelized,
    fill_local_shard,
    materialize,
    parallelize,
    uses_flex_attention,
)
from fsdp_trainer.distributed.runtime import (
    DistEnv,
    process_group_backend,
)
from fsdp_trainer.files import RunDirInUse, RunLock, check_run_dir_free, check_writable
from fsdp_trainer.hf import check_peft_adapter, load_peft_adapter
from fsdp_trainer.model import Transformer
from fsdp_trainer.sinks import require_wandb
from fsdp_trainer.steps.preference import Reference, frozen_copy
from fsdp_trainer.tokenizer import run_tokenizer_path

logger = logging.getLogger("fsdp_trainer")


def build_model(recipe: Recipe, env: DistEnv) -> tuple[Transformer, Parallelized]:
    """The recipe's model, parallelized and initialised: shapes on meta, then AC / compile / FSDP from outside, then
    each rank allocates and fills its own shards (the same weights at any world size); and what was applied. With
    lora.rank set, every weight is frozen and the blocks' projections get adapters (adapters/lora.py)."""
    with torch.device("meta"):
        model = Transformer(recipe.model, flex_attention=uses_flex_attention(recipe.parallel, env.device))
    lora = recipe.lora.rank is not None
    if lora:  # adapters beside the frozen weights, sharded with them
        apply_lora(model, recipe.lora, frozen_dtype=compute_dtype(recipe.parallel.mixed_precision))
    if recipe.lora.quantize_base == "nf4":  # QLoRA: FSDP2 shards the frozen projections in their 4-bit form
        quantize_frozen(model)
    applied = parallelize(model, recipe.parallel, env.mesh)
    materialize(model, env.device, recipe.train.seed, applied.cpu_offload, fill=fill_shard)
    if lora:
        init_lora(model, recipe.train.seed, fill_local_shard, env.device)
    return model, applied


def build_reference(recipe: Recipe, env: DistEnv, policy: Transformer) -> Reference:
    """A preference run's reference model: with LoRA the policy itself, its adapters switched off; otherwise a frozen
    copy of the model, built and sharded as the policy is, held in the compute dtype (what FSDP gathers anyway, so
    its forward is the policy's at step 0, bitwise), no gradients, no optimizer state; the checkpointer loads the
    weights the run started from into it."""
    if recipe.lora.rank is not None:
        return Reference(policy)
    frozen = frozen_copy(recipe, env.mesh, uses_flex_attention(recipe.parallel, env.device))
    materialize(frozen, env.device, recipe.train.seed, recipe.parallel.cpu_offload)
    return Reference(policy, frozen)


def build_loader(recipe: Recipe, env: DistEnv, tokens: Tokens | Mixture) -> TokenLoader:
    """This rank's share of every global batch of `tokens`, in the order the seed fixes."""
    data = recipe.data
    return TokenLoader(
        tokens,
        data.seq_len,
        data.micro_batch_size,
        data.grad_accum_steps,
        env.rank,
        env.world_size,
        seed=recipe.train.seed,
        device=env.device,
    )


def build_checkpointer(
    recipe: Recipe, env: DistEnv, states: dict[str, Stateful], reference: torch.nn.Module | None = None
) -> Checkpointer:
    """The checkpointer of `states`, which have been restored as checkpoint.resume says (auto | none | PATH), and of a
    preference run's frozen `reference`, loaded with the weights the run started from; a fresh LoRA run with
    lora.adapter starts its adapters from that PEFT adapter."""
    ckpt = Checkpointer(recipe, env, states, reference)
    if ckpt.load() is None and recipe.lora.adapter is not None:  # a fresh start from an existing PEFT adapter
        load_adapters(states["model"].model, load_peft_adapter(recipe.lora.adapter, recipe.lora), fill_local_shard)
        if env.is_main:
            logger.info(f"adapters loaded from {recipe.lora.adapter}")
    return ckpt


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


def check_preference_data(recipe: Recipe, train_file: Tokens | Mixture) -> None:
    """A preference run trains on preference pairs, and preference pairs train only a preference run."""
    pairs = train_file.preference
    if recipe.preference.loss is not None and not pairs:
        raise ValueError(
            f"preference.loss={recipe.preference.loss} trains on preference pairs, and {train_file.path} holds none: "
            "prepare the data with tools/prepare_data.py --format preference"
        )
    if recipe.preference.loss is None and pairs:
        raise ValueError(
            f"{train_file.path} holds preference pairs: set preference.loss (sigmoid for DPO, ipo or robust) to train "
            "on them"
        )


def check_run(recipe: Recipe) -> tuple[Tokens | Mixture, Tokens | None]:
    """Everything about a run that can be wrong before any process group exists: the token files against the
    tokenizer and the model, the W&B package, the output directory (its room, and no live run holding it), the
    backend. Returns the opened token files; raises ValueError / FileNotFoundError naming what to fix. fsdp-train calls
    it before it starts any worker, and every worker again."""
    # null: the tokenizer that travels with the checkpoint the run starts from, recorded resolved in config.yaml.
    data, resume = recipe.data, recipe.checkpoint.resume
    data.tokenizer_path = run_tokenizer_path(data.tokenizer_path, resume, recipe.train.out_dir)
    files = open_data(recipe)
    check_preference_data(recipe, files[0])
    require_wandb(recipe)
    check_writable(recipe.train.out_dir, int(os.environ.get("RANK", 0)))
    check_run_dir_free(recipe.train.out_dir)
    if recipe.checkpoint.every:
        check_disk_room(recipe)
    if resume not in ("auto", "none"):
        resolve_checkpoint(resume)  # a path that holds no checkpoint
    if recipe.lora.adapter is not None:
        check_peft_adapter(recipe.lora.adapter, recipe.lora)  # there, and made for this rank, scale and targets
    if recipe.lora.quantize_base == "nf4":
        require_torchao()
        # The launcher knows no world size yet: it checks the whole weights, each worker its shard group too
        world = int(os.environ.get("WORLD_SIZE", 1))
        _, shard_ranks = SHARDING[recipe.parallel.sharding].mesh_shape(
            world, int(os.environ.get("LOCAL_WORLD_SIZE", world))
        )
        check_nf4_shapes(recipe.model, recipe.lora, shard_ranks)
    process_group_backend(recipe.parallel, torch.cuda.is_available())
    return files
