"""Everything distributed that is applied to a built model from the outside, in a fixed order (see parallelize()):
activation checkpointing wraps each block, then torch.compile compiles it, then FSDP2 (`fully_shard`) shards each
block and finally the root. The model is built on the meta device, parallelized, then materialized shard by shard, so
no rank ever holds the full model. SHARDING is the one table of the user's sharding names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fsdp_trainer.config import ParallelConfig, compiles_experts, compute_dtype
from fsdp_trainer.distributed.expert_parallel import apply_expert_parallel, experts_mesh
from fsdp_trainer.model import Transformer
from fsdp_trainer.moe import routed_layers


@dataclass(frozen=True)
class ShardingPlan:
    """How one `parallel.sharding` name maps onto FSDP2."""

    replicas: str
    """How many copies of the model the world holds: `one` (shard over all ranks), `per_rank` (replicate over all
    ranks, shard over none) or `per_node` (shard within a node, replicate across nodes)."""
    reshard_after_forward: bool
    """Free the gathered parameters after forward (ZeRO-3) or keep them until backward (ZeRO-2)."""
    gathered_for_the_step: bool = False
    """Keep the gathered parameters over all micro-steps of an optimizer step, freed only after the last backward
    (ZeRO-1): gathered once per step instead of once per micro-step, the gradients accumulating unsharded until the
    last micro-step reduce-scatters them."""
    reduce_every_micro_step: bool = False
    """With gradient accumulation, reduce-scatter each micro-step's gradients into the shards, so that they stay
    sharded over the step as ZeRO-2/3 hold them, instead of accumulating the whole model's unsharded gradients until
    the last micro-step reduces them (parallel.accumulate_unsharded)."""

    def reductions(self, accum: int) -> int:
        """Gradient reductions (reduce-scatters within a shard group) an optimizer step of `accum` micro-steps makes."""
        return accum if self.reduce_every_micro_step else 1

    def mesh_shape(self, world_size: int, ranks_per_node: int) -> tuple[int, int]:
        """(replicas, shard group): how many copies of the model the world holds, and how many ranks share one."""
        replicas = {"one": 1, "per_rank": world_size, "per_node": world_size // ranks_per_node}[self.replicas]
        return replicas, world_size // replicas


# The only place the user's sharding names are spelled out. Data parallelism always spans the whole world; the plan
# decides how the ranks split into a (replicate, shard) mesh, which FSDP2 runs as HSDP when both are > 1.
SHARDING: dict[str, ShardingPlan] = {
    "FULL_SHARD": ShardingPlan(replicas="one", reshard_after_forward=True, reduce_every_micro_step=True),  # ZeRO-3
    "SHARD_GRAD_OP": ShardingPlan(replicas="one", reshard_after_forward=False, reduce_every_micro_step=True),  # ZeRO-2
    "SHARD_OP": ShardingPlan(replicas="one", reshard_after_forward=False, gathered_for_the_step=True),  # ZeRO-1
    # DDP semantics: a (world, 1) mesh replicates every parameter and all-reduces gradients in fp32, through the same
    # code path and mixed-precision policy as the other modes. With a shard group of 1 there is nothing to free.
    "NO_SHARD": ShardingPlan(replicas="per_rank", reshard_after_forward=False),
    "HYBRID_SHARD": ShardingPlan(replicas="per_node", reshard_after_forward=True, reduce_every_micro_step=True),
}


def sharding_plan(sharding: str, accumulate_unsharded: bool = False) -> ShardingPlan:
    """SHARDING[sharding], its gradients accumulated unsharded over a step's micro-steps if asked
    (parallel.accumulate_unsharded), as SHARD_OP and NO_SHARD always do."""
    plan = SHARDING[sharding]
    return replace(plan, reduce_every_micro_step=False) if accumulate_unsharded else plan


# Ops whose outputs selective AC keeps: the matmuls and attention are what is costly to recompute; norms,
# activations and elementwise ops are cheap to redo and account for most of the activation memory.
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _MATMULS.add(torch.ops.aten._grouped_mm.default)  # a mixture of experts' projections (moe.py)
_SAVE_OPS = set(_MATMULS)
for _name in (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
):
    if hasattr(torch.ops.aten, _name):
        _SAVE_OPS.add(getattr(torch.ops.aten, _name).default)

WIDENING = 8
"""Selective AC recomputes a matmul whose output is more than this many times as wide as what it contracts over: a
LoRA adapter's B (rank in, the projection's width out) costs 2 x rank FLOPs an output to redo and a whole projection's
width to keep. A model's own projections widen at most 6x (Gemma 3 1B's feed-forward, 6,912 from 1,152)."""


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in _MATMULS:
        x, weight = args[1:3] if op is torch.ops.aten.addmm.default else args[:2]
        if weight.shape[-1] > WIDENING * x.shape[-1]:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# Selective AC counts every op a block runs, to hand the recomputation what the forward kept; the profiler ranges
# FSDP's hooks open are ops too, and those of a module sharded inside a block (the experts under expert parallelism)
# run another number of times in the recomputation than in the forward: torch's SAC then fails the backward. They
# compute nothing, so they are not counted.
torch.utils.checkpoint.SAC_IGNORED_OPS |= {
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


def _selective_context():
    return create_selective_checkpoint_contexts(_save_matmuls_policy)


def _checkpoint_kwargs(mode: str) -> dict:
    """What torch's checkpoint takes for AC `mode`: `full` recomputes the whole block in backward, `selective` all but
    the matmul and attention outputs."""
    return {"preserve_rng_state": False, **({"context_fn": _selective_context} if mode == "selective" else {})}


def apply_ac(model: Transformer, mode: str, every: int = 1) -> None:
    """Wrap every `every`-th block in activation checkpointing of `mode`."""
    if mode == "none":
        return
    layers = model.model.layers
    for i, (name, block) in enumerate(list(layers.items())):
        if i % every == 0:
            layers[name] = checkpoint_wrapper(block, **_checkpoint_kwargs(mode))


def switch_ac(model: Transformer, mode: str) -> None:
    """The blocks apply_ac wrapped run under AC `mode` from their next forward, "none" as unwrapped blocks do: the
    planner's check measures each mode's step on one model (planner/fake.py)."""
    for block in model.model.layers.values():
        if not isinstance(block, CheckpointWrapper):
            continue
        if mode == "none":
            block.checkpoint_fn = lambda module, *args, **kwargs: module(*args, **kwargs)
        else:  # as checkpoint_wrapper makes it (its default, non-reentrant)
            block.checkpoint_fn = partial(checkpoint, use_reentrant=False, **_checkpoint_kwargs(mode))


def apply_compile(model: Transformer, mixed_precision: str) -> None:
    """torch.compile each block separately: same graph for all blocks, so one compile serves them all.

    A mixture of experts' block keeps its routing for the load-balancing loss (moe.py), a side effect that dynamo
    refuses inside a checkpointed block unless told not to replay it in the recomputation, which is what the routing
    needs (moe.recomputing). Its grouped matmuls compile in bf16 only (torch's meta kernel refuses other dtypes), and
    take their operands in the strides the trace saw: inductor's own rule for them (require_dense) lets a copy keep
    its source's order, a layout the kernel may refuse, on a GPU as on a CPU ("Invalid strides/sizes"). Under expert
    parallelism the all-to-all's sizes, read on the host, are traced as symbolic integers (capture_scalar_outputs)."""
    if model.cfg.moe is not None:
        compiles, why = compiles_experts(model.cfg, True, mixed_precision)
        if not compiles:
            raise ValueError(why)
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        torch._dynamo.config.capture_scalar_outputs = True
        from torch._inductor.lowering import add_layout_constraint, constrain_to_fx_strides  # 1.5 s: compiling only

        add_layout_constraint(torch.ops.aten._grouped_mm.default, constrain_to_fx_strides)
    layers = model.model.layers
    for name, block in list(layers.items()):
        layers[name] = torch.compile(block, fullgraph=True)


def apply_fsdp(
    model: Transformer,
    mesh: DeviceMesh,
    sharding: str,
    mixed_precision: str,
    prefetch_blocks: int = 1,
    cpu_offload: bool = False,
    experts: DeviceMesh | None = None,
    compiled: bool = False,
) -> None:
    """fully_shard each block, then the root (embedding, final norm, lm_head and what is left); with
    prefetch_blocks > 1, each block's hooks start the all-gathers of the next k blocks (the previous k in backward);
    with cpu_offload, the shards, their gradients and so the optimizer state stay in host memory. Under expert
    parallelism (`experts`, expert_parallel.experts_mesh) the experts are sharded over the ranks holding the same
    ones: eager, in an FSDP module of their own, gathered for their forward alone; `compiled`, in their block's
    (experts_placement), since an FSDP module's hooks inside a compiled block would break its graph."""
    plan = SHARDING[sharding]
    # The compute dtype for the parameter all-gather and the matmuls; master weights, optimizer state and the
    # gradient reduction stay fp32 whatever it is.
    mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype(mixed_precision), reduce_dtype=torch.float32)
    shard = partial(fully_shard, mesh=mesh, mp_policy=mp_policy)
    if mesh.size(mesh.ndim - 1) == 1 and not cpu_offload:
        # In a shard group of one, FSDP2 "gathers" by copying each parameter, and keeps the copy of the root and of
        # SHARD_GRAD_OP's blocks from forward to backward; a frozen weight (LoRA), already in the compute dtype, with
        # no gradient to reduce, needs neither, so it stays outside FSDP, whole on every rank. It must for a tensor
        # with all-gather hooks (NF4): torch 2.13's copy hands it only the first of its parts (pytorch#197999).
        frozen = {param for param in model.parameters() if not param.requires_grad}
        shard = partial(shard, ignored_params=frozen)
    if cpu_offload:
        # Pinned host memory lets the copies overlap compute; pinning needs an accelerator, so not on a CPU-only mesh.
        shard = partial(shard, offload_policy=CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda"))
    blocks = list(model.model.layers.values())
    if not blocks:
        raise ValueError("apply_fsdp found no Transformer block to wrap")
    if experts is not None and not compiled:  # each mixture's experts an FSDP module, gathered for their forward
        for layer in routed_layers(model):
            shard(layer.experts, mesh=experts["dp_mod_ep"], reshard_after_forward=plan.reshard_after_forward)
            divide_experts_as_the_rest(layer.experts, experts)
    placement = experts_placement(experts) if experts is not None and compiled else {}
    for i, block in enumerate(blocks):
        shard(block, reshard_after_forward=reshards_after_forward(plan, i, len(blocks)), **placement)
        if placement:
            divide_experts_as_the_rest(block, experts)
    shard(model, reshard_after_forward=False)
    if prefetch_blocks > 1:
        # On its own FSDP2 overlaps one block ahead (in forward as far as the CPU runs ahead, in backward by the
        # reversed forward order); an explicit list replaces that, so it starts with the adjacent block.
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + prefetch_blocks])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch_blocks) : i][::-1])


def experts_placement(experts: DeviceMesh) -> dict:
    """fully_shard's arguments for a compiled block under expert parallelism (`experts`, expert_parallel
    .experts_mesh): its experts' weights (DTensors over `ep`) sharded over the ranks holding the same ones
    (`dp_mod_ep`), the rest over the block's mesh, in one FSDP module (torchtitan's per-parameter mesh): no FSDP hook
    inside the block, so it compiles to one graph. Eager runs keep the experts an FSDP module of their own, which
    gathers them later and frees them sooner, and which torch 2.13's FSDPMemTracker (the planner's check) can
    instrument: it refuses a module of several parameter groups."""
    held, split = FSDPMeshInfo(experts["dp_mod_ep"], shard_mesh_dim=0), experts["ep"]

    def placement(param: nn.Parameter) -> ShardPlacementResult | None:
        on_experts = isinstance(param, DTensor) and param.device_mesh == split
        return ShardPlacementResult(Shard(0), held) if on_experts else None

    return {"shard_placement_fn": placement}


def divide_experts_as_the_rest(module: FSDPModule, experts: DeviceMesh) -> None:
    """The experts' gradients (of `module`: the experts' own FSDP module, or a compiled block's holding them) are
    reduced over fewer ranks than the rest and divided as the rest are: by the world (the step's scale expects it),
    which is the default over the rest. Gloo has no pre-multiplied sum: the experts' take a sum, then the division,
    but not over a group of one, where torch 2.13 would then divide twice (torch sets this a module at a time; here
    it is the experts' parameter group's alone)."""
    module.set_gradient_divide_factor(float(experts.size()))
    if experts.device_type == "cpu" and experts["dp_mod_ep"].size() > 1:
        experts_group = experts["dp_mod_ep"].get_group()
        for group in module._get_fsdp_state()._fsdp_param_groups:
            group.force_sum_reduction_for_comms = group.mesh_info.shard_process_group is experts_group


def reshards_after_forward(plan: ShardingPlan, block: int, blocks: int) -> bool:
    """Whether a block frees its gathered parameters after its forward. Backward starts with the last block, so
    freeing it would only mean gathering it again at once; the same holds for the root (embedding, final norm,
    lm_head), which never does."""
    return plan.reshard_after_forward and block < blocks - 1


def switch_sharding(model: Transformer, plan: ShardingPlan) -> None:
    """From their next forward, the FSDP modules apply_fsdp made of `model` free their gathered parameters after
    forward as `plan` says: the root never, the blocks by reshards_after_forward, a mixture's experts (eager expert
    parallelism) as the plan. FULL_SHARD, SHARD_GRAD_OP and SHARD_OP differ in that alone on one mesh, besides what
    the step does (set_gradient_sync): the planner's check measures their steps on one model (planner/fake.py)."""
    blocks = list(model.model.layers.values())
    for i, block in enumerate(blocks):
        block.set_reshard_after_forward(reshards_after_forward(plan, i, len(blocks)), recurse=False)
    for layer in routed_layers(model):
        if isinstance(layer.experts, FSDPModule):
            layer.experts.set_reshard_after_forward(plan.reshard_after_forward, recurse=False)
    model.set_reshard_after_forward(False, recurse=False)


@contextmanager
def held_gathered(model: Transformer, plan: ShardingPlan) -> Iterator[None]:
    """Within: each FSDP module keeps its parameters gathered from its first forward on, so forward passes after the
    first make no collective and the ranks need not make the same number of them (sampling a token per pass). After:
    all freed, and each module frees them after forward as `plan` says again. Holds the whole model in the compute
    dtype beside its shards. A model FSDP does not shard has nothing to keep."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_reshard_after_forward(False)  # every FSDP module below the root too
    try:
        yield
    finally:
        switch_sharding(model, plan)
        reshard(model)


@dataclass(frozen=True)
class Parallelized:
    """What parallelize() applied, for the rooms that act on it: materialize() places the shards by it, and the
    training step syncs gradients by its plan."""

    plan: ShardingPlan
    cpu_offload: bool
    """The shards, their gradients and the optimizer state live in host memory."""


def parallelize(model: Transformer, cfg: ParallelConfig, mesh: DeviceMesh) -> Parallelized:
    """Apply, in this order: activation checkpointing -> compile -> FSDP per block -> FSDP on the root.

    AC must wrap the block before FSDP does, so FSDP's hooks sit outside the recomputed region, and compile goes in
    between so it sees the checkpointed block whole (pytorch#148831).
    """
    experts = experts_mesh(cfg.expert_parallel, mesh.size(), mesh.device_type)
    if experts is not None:  # each rank's experts, and the dispatch of token copies to them
        apply_expert_parallel(model, experts)
    apply_ac(model, cfg.activation_checkpointing, cfg.ac_every)
    if cfg.compile:
        apply_compile(model, cfg.mixed_precision)
    apply_fsdp(
        model, mesh, cfg.sharding, cfg.mixed_precision, cfg.prefetch_blocks, cfg.cpu_offload, experts, cfg.compile
    )
    return Parallelized(sharding_plan(cfg.sharding, cfg.accumulate_unsharded), cfg.cpu_offload)


def uses_flex_attention(cfg: ParallelConfig, device: torch.device) -> bool:
    """Packed examples attend through flex_attention when the blocks are compiled on a GPU, compiled into a kernel
    that skips the blocks the mask empties; eager it is slower than the boolean mask, and torch 2.13 has no
    flex_attention backward on CPUs."""
    return cfg.compile and device.type == "cuda"


def fill_local_shard(param: nn.Parameter, values: torch.Tensor) -> None:
    """Write this rank's part of a full-shape tensor into a (possibly sharded) parameter, without communication."""
    if isinstance(param, DTensor):
        local = distribute_tensor(values, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(values)


def allocate(model: Transformer, device: torch.device | str) -> None:
    """The meta-device model's storage on `device`, uninitialized (to_empty), its tied output layer still the
    embedding: frozen weights left outside FSDP (a shard group of one) come out of to_empty as two tensors, which
    would hold the embedding twice."""
    model.to_empty(device=device)
    embedding = model.model.embed_tokens.weight
    if model.cfg.tied_output and model.lm_head.weight is not embedding:
        model.lm_head.weight = embedding


def materialize(
    model: Transformer, device: torch.device, seed: int, cpu_offload: bool = False, fill: Callable | None = None
) -> None:
    """Allocate the meta-device model's shards on `device` and initialise them: the same weights at any world size.

    With `cpu_offload` (what parallelize() applied), the shards are allocated in host memory, where FSDP2 requires
    them, and the buffers (the rotary tables) on the device, where the compute reads them; the values are still drawn
    on the device, so a run with offload starts from the same weights as one without. `fill` (default
    fill_local_shard) writes a parameter's full values into its shard.
    """
    allocate(model, "cpu" if cpu_offload else device)
    if cpu_offload:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, torch.empty_like(buffer, device=device))  # stays the same (non-)persistent buffer
    model.init_weights(seed=seed, fill=fill or fill_local_shard, device=device)


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters a forward without backward leaves behind (SHARD_GRAD_OP keeps them after
    forward, for a backward that does not come)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def set_gradient_sync(model: nn.Module, plan: ShardingPlan, last: bool) -> None:
    """Before each micro-step: reduce its gradients (the last micro-step, or every one where the plan reduces every
    micro-step, each one's then added to the shards) or accumulate them unsharded. Reducing every micro-step, HSDP
    reduce-scatters within the node each time and all-reduces across nodes at the last one only (FSDP2 sums the
    micro-steps' shards until then). Under SHARD_OP (ZeRO-1) the gathered parameters are also kept after backward
    until the last micro-step, so the next one does not gather them again; after the last they are freed, since the
    optimizer step is about to change their shards."""
    model.set_requires_gradient_sync(last or plan.reduce_every_micro_step)
    if plan.reduce_every_micro_step:
        model.set_requires_all_reduce(last)
    if plan.gathered_for_the_step:
        model.set_reshard_after_backward(last)
