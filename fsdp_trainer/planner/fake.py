"""One training step at a recipe's real shapes and world size, run without allocating memory or having the devices:
FakeTensorMode for the tensors, torch's fake process group for the collectives, FSDPMemTracker for the peak. It is
the planner's cross-check (`python -m fsdp_trainer.planner.plan ... --check`): an 8B model on 64 ranks runs in
seconds on a laptop's CPU.

What it measures is what the step allocates per rank (parameters, gradients, optimizer state, activations,
temporaries, collective buffers), as the caching allocator would be asked for it; not the CUDA context, NCCL's buffers
or allocator fragmentation, which the planner's `runtime` term stands for.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp_trainer.adapters import meta_model
from fsdp_trainer.adapters.nf4 import fill_shard, quantized_weights
from fsdp_trainer.config import Recipe, compute_dtype
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.context_parallel import context_group
from fsdp_trainer.distributed.expert_parallel import experts_mesh
from fsdp_trainer.distributed.parallelize import (
    SHARDING,
    allocate,
    parallelize,
    sharding_plan,
    switch_ac,
    switch_sharding,
)
from fsdp_trainer.optim import build_optimizer
from fsdp_trainer.steps import training_kind
from fsdp_trainer.train import train_step


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """This process as rank 0 of a fake process group of `world_size` ranks (collectives return at once), destroyed
    on leaving, so a caller in a longer-lived process (a test) is left no group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def measured_peak_gb(recipe: Recipe, nproc: int, nnodes: int) -> float:
    """Peak GB one rank allocates in a steady-state optimizer step (the second: AdamW's state exists) of `recipe`, on a
    fake world of nproc x nnodes ranks made for it: the recipe's model with its adapters, and the step of its training
    kind with the frozen models it holds, on that kind's data. The recipe's precision must be resolved."""
    mode = recipe.parallel.activation_checkpointing
    return measured_peaks_gb(recipe, nproc, nnodes, [mode])[mode]


def measured_peaks_gb(recipe: Recipe, nproc: int, nnodes: int, modes: list[str]) -> dict[str, float]:
    """measured_peak_gb of `recipe` under each AC mode in `modes`, on one model: built with its blocks wrapped for
    recomputation (unless every mode is "none"), a warm-up step of one micro-batch under the first mode, then each
    mode's step in turn (switch_ac). A step leaves the same state under any mode and however many micro-batches it
    took (shards, gradients, AdamW's), and a mode's step runs the ops a run built with it runs: each mode's peak is its
    own run's, for one build and a short warm-up instead of a build and a whole step each."""
    sharding = recipe.parallel.sharding
    return {mode: gb for (_, mode), gb in measured_rows_gb(recipe, nproc, nnodes, {sharding: modes}).items()}


def measured_rows_gb(
    recipe: Recipe, nproc: int, nnodes: int, rows: dict[str, list[str]]
) -> dict[tuple[str, str], float]:
    """measured_peaks_gb of `recipe` under each sharding of `rows` ({sharding: its AC modes}), by (sharding, mode).
    The shardings that split the world alike (one mesh: FULL_SHARD, SHARD_GRAD_OP and SHARD_OP) are measured on one
    model, warmed under the first: before another's steps, its FSDP modules free their gathered parameters after
    forward as it says (switch_sharding) and its training kind's step is built again for it. A step leaves the same
    state under any of them, so each row's peak is its own run's, for a build and a warm-up a mesh. Not where the
    step holds frozen models (its starts): one built again peaks higher in its first step than in later ones (DPO's
    reference, 1.3 MB at the debug recipe's widths), so each sharding gets a model and a warm-up of its own."""
    by_mesh: dict[tuple[int, int], dict[str, list[str]]] = {}
    for sharding, modes in rows.items():
        by_mesh.setdefault(SHARDING[sharding].mesh_shape(nproc * nnodes, nproc), {})[sharding] = modes
    peaks = {}
    for pending in by_mesh.values():
        while pending:
            case = copy.deepcopy(recipe)
            case.parallel.sharding = next(iter(pending))
            wrapped = [mode for modes in pending.values() for mode in modes if mode != "none"]
            case.parallel.activation_checkpointing = wrapped[0] if wrapped else "none"
            with fake_world(nproc * nnodes):
                peaks |= _measured_rows_gb(case, nproc, nnodes, pending)
            pending = {sharding: modes for sharding, modes in pending.items() if (sharding, modes[0]) not in peaks}
    return peaks


def _measured_rows_gb(
    recipe: Recipe, nproc: int, nnodes: int, rows: dict[str, list[str]]
) -> dict[tuple[str, str], float]:
    parallel, data = recipe.parallel, recipe.data
    replicas, group = SHARDING[parallel.sharding].mesh_shape(nproc * nnodes, nproc)
    if replicas == 1:
        mesh = init_device_mesh("cpu", (group,), mesh_dim_names=("dp_shard",))
    else:
        mesh = init_device_mesh("cpu", (replicas, group), mesh_dim_names=("dp_replicate", "dp_shard"))
    parallel.compile = False  # nothing to compile for fake tensors
    world = nproc * nnodes
    context = context_group(parallel.context_parallel, world, torch.device("cpu"))
    experts_mesh(parallel.expert_parallel, world, "cpu")  # made here, for parallelize: a mesh is no fake tensor
    env = SimpleNamespace(mesh=mesh, device=torch.device("cpu"), world_size=world, context=context)
    kind = training_kind(recipe)
    # Built on meta outside the fake mode: a meta tensor an op reads inside it is remembered by a weak reference, and
    # to_empty could not then swap the weights FSDP leaves alone (the frozen ones, in a shard group of one).
    dtype = compute_dtype(parallel.mixed_precision)
    model = meta_model(recipe.model, recipe.lora, frozen_dtype=dtype, quantize=True)
    parallelize(model, parallel, mesh)  # on meta, outside: a mesh FSDP makes is no fake tensor either
    with FakeTensorMode(allow_non_fake_inputs=True):
        allocate(model, "cpu")
        for weight in quantized_weights(model).values():  # QLoRA's: NF4 parts to_empty leaves on meta, made again
            fill_shard(weight, torch.zeros(weight.shape, dtype=dtype))
        optimizer = build_optimizer(model, recipe.optim)
        shape = (data.grad_accum_steps, kind.trained_rows(recipe), data.seq_len + 1)
        windows = torch.randint(0, recipe.model.vocab_size, shape)
        batches = [kind.fake_batch(MicroBatch(t[:, :-1], t[:, 1:], None)) for t in windows]
        if context is not None:  # this rank's share of each window
            batches = [context.shard(batch) for batch in batches]
        peaks = {}
        for sharding, modes in rows.items():
            case = copy.deepcopy(recipe)
            case.parallel.sharding = sharding
            plan = sharding_plan(sharding, parallel.accumulate_unsharded)
            switch_sharding(model, plan)
            step = kind.build(case, env, model)
            for start in step.starts:
                allocate(start.model, "cpu")
            args = (model, optimizer, batches, 1e-4, 1.0, recipe.train.loss_chunks, None, plan, step)
            if not peaks:  # the warm-up
                switch_ac(model, modes[0])
                train_step(model, optimizer, batches[:1], *args[3:])
            # The tracker counts FSDP's parameters and what ops make; weights FSDP leaves alone (frozen ones in a
            # shard group of one, a frozen model's) it would count only where a view of one is made, as a new
            # allocation.
            models = [model, *(start.model for start in step.starts)]
            outside = [p for m in models for p in m.parameters() if not isinstance(p, DTensor)]
            for mode in modes:
                switch_ac(model, mode)
                peaks[sharding, mode] = _tracked_peak_gb(model, optimizer, (batches[0].inputs, *outside), args)
            if step.starts:  # the other shardings on models of their own (measured_rows_gb)
                break
    return peaks


class _PeakTracker(FSDPMemTracker):
    """FSDPMemTracker for the one number the check reads, the step's peak (get_tracker_snapshot("peak")), at less
    than half its CPU (the 8B recipe's check on 64 ranks: 112 -> 48 s, every row the same). After each op the tracker
    passes over every module it knows to raise the peaks of those the op runs in, which the check never reads: here
    only the step's own peak is raised. And a fake tensor answers `.device` through the dispatcher (prim.device),
    which autograd's engine and the kernels ask of every input, half the ops a step dispatches: such a query
    allocates nothing, so it skips the tracker's bookkeeping altogether."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default and DTensor not in types:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_peak_stats(self, peak_state) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)


def _tracked_peak_gb(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: tuple, args: tuple) -> float:
    """The peak of one train_step(*args) by the check's FSDPMemTracker, which counts `inputs` too."""
    tracker = _PeakTracker(model, optimizer)
    tracker.track_inputs(inputs)
    with tracker:
        # The tracker takes the root's second forward for the next step's and refuses it; with accumulation, each
        # micro-batch's is one more. Its per-module numbers are cleared before each (the peak is kept), by a hook that
        # must run before FSDP's, which the tracker registered again on entering.
        each_micro_batch = model.register_forward_pre_hook(lambda *_: tracker.reset_mod_stats(), prepend=True)
        train_step(*args)
        each_micro_batch.remove()
    return max(by_kind["Total"] for by_kind in tracker.get_tracker_snapshot("peak").values()) / 1e9
