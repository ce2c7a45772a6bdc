"""What the forkserver of tests/helpers/forked.py imports once, for every run forked from it: torch, the trainer and
its tools' modules, transformers (which the tools import to verify an export), and what a run imports on its way
(about 1 s of CPU a forked rank otherwise spends on each), and what the test extras add to it; then two steps of the
tests' tiny model on one fake rank and two as rank 0 of two, which leave DTensor's sharding rules for its ops cached
(0.3 s of CPU a forked 1-process run otherwise spends finding them on its first step, 0.05-0.1 s rank 0 of two)."""

import gc
import logging
from pathlib import Path


def _import_the_package() -> None:
    import pytest  # noqa: F401  (a rank running a test module's function imports that module, and it pytest)
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (a model built on the meta device reaches it: torch._refs' ops disable dynamo)
    import torch._inductor.config  # noqa: F401  (each forked run sets its vectorization switch: forked._run)
    import torch.distributed.run  # noqa: F401  (torchrun's agents, and fsdp-train's, forked from here)
    import transformers  # noqa: F401

    import fsdp_trainer.convert  # noqa: F401
    import fsdp_trainer.train  # noqa: F401
    from fsdp_trainer.config import parse_recipe
    from fsdp_trainer.launch import name_rendezvous_events_cheaply

    # imports jsonargparse and the modules it loads on its first parser and parse, and leaves each key's type check
    # ready (inspected on its first use: 4 ms of a forked run's first parse)
    parse_recipe(["--recipe", str(Path(__file__).parents[2] / "recipes" / "debug.yaml")])
    name_rendezvous_events_cheaply()  # as fsdp-train does: in a process that imported this much, 0.4 s an event
    try:  # every run writes TensorBoard events where the package is installed (the test extras install it)
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        pass


def _import_test_extras() -> None:
    """What the forked runs of tools and tests import from the test extras, each otherwise again in every run (about
    1.5 s of CPU in a run that verifies an export): torchao (quietly, as a QLoRA run does), transformers' model code
    for each family an export is loaded into, peft (which the test modules of adapters import), lm-eval's tasks."""
    import transformers

    from fsdp_trainer.hf import FAMILIES

    logging.disable(logging.WARNING)  # torchao's notes on GPU kernels a CPU build lacks, which a run never prints
    try:
        import torchao  # noqa: F401
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        for model_type in FAMILIES:
            getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
        import lm_eval.tasks  # noqa: F401
        import peft  # noqa: F401
    except ImportError:  # the package alone, without its test extras
        pass
    finally:
        logging.disable(logging.NOTSET)


def _warm_sharding_rules() -> None:
    """Two training steps of the tests' tiny recipe (tests/conftest.py's tiny_data: fp32, TINY_BATCH's micro-batches)
    on a fake process group of one rank, then as rank 0 of two. DTensor's C++ dispatch caches each op's sharding by
    its arguments' specs, which name the mesh by its ranks, not by which of them this process is: a 1-process run or
    rank 0 of a 2-process one forked later finds them (on 2 ranks, 0.05-0.1 s of CPU a forked rank otherwise spends
    finding them on its first step: a third of a 1-step run's). What it holds for two ranks is rank 0's own: a rank 1
    that used it computed another first loss than one process, and DCP refused its checkpoint's plan: a forked process
    of another rank forgets it (forked.forget_rank_0s_shardings)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_trainer.build import build_model, build_step
    from fsdp_trainer.config import DataConfig, ModelConfig, ParallelConfig, Recipe
    from fsdp_trainer.data.loader import MicroBatch
    from fsdp_trainer.distributed.runtime import DistEnv
    from fsdp_trainer.optim import build_optimizer
    from fsdp_trainer.train import train_step
    from tests.helpers import TINY_BATCH, TINY_MODEL

    recipe = Recipe(
        model=ModelConfig(**TINY_MODEL), parallel=ParallelConfig(mixed_precision="fp32"), data=DataConfig(**TINY_BATCH)
    )
    shape = (TINY_BATCH["micro_batch_size"], TINY_BATCH["seq_len"] + 1)
    tokens = torch.randint(0, TINY_MODEL["vocab_size"], shape, generator=torch.Generator().manual_seed(0))
    batch = MicroBatch(tokens[:, :-1], tokens[:, 1:])
    for world in (1, 2):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
            env = DistEnv(0, world, 0, world, torch.device("cpu"), mesh, timedelta(seconds=60))
            model, applied = build_model(recipe, env)
            optimizer, step = build_optimizer(model, recipe.optim), build_step(recipe, env, model)
            for _ in range(2):
                train_step(model, optimizer, [batch], 1e-3, 1.0, plan=applied.plan, step_losses=step)
        finally:
            dist.destroy_process_group()


# A collection while importing walks everything imported so far, again and again (about 1 s of CPU here); what is loaded
# lives as long as the server and every fork: kept out of each run's collections (a run's gc.collect() otherwise walks
# it all, 0.2 s at a run's end) and out of the pages a collection would copy.
gc.disable()
_import_the_package()
_import_test_extras()
_warm_sharding_rules()
gc.collect()
gc.freeze()
gc.enable()
