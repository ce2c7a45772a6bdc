"""Processes, device mesh, and everything distributed that is applied to a built model from the outside.

Order matters and is fixed (see parallelize()): activation checkpointing wraps each block, then torch.compile
compiles it, then FSDP2 (`fully_shard`) shards each block and finally the root. The model is built on the meta
device, parallelized, then materialized shard by shard, so no rank ever holds the full model.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fsdp_trainer.config import AUTO, ParallelConfig, Precision, compute_dtype
from fsdp_trainer.model import Transformer

logger = logging.getLogger("fsdp_trainer")


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

    def mesh_shape(self, world_size: int, ranks_per_node: int) -> tuple[int, int]:
        """(replicas, shard group): how many copies of the model the world holds, and how many ranks share one."""
        replicas = {"one": 1, "per_rank": world_size, "per_node": world_size // ranks_per_node}[self.replicas]
        return replicas, world_size // replicas


# The only place the user's sharding names are spelled out. Data parallelism always spans the whole world; the plan
# decides how the ranks split into a (replicate, shard) mesh, which FSDP2 runs as HSDP when both are > 1.
SHARDING: dict[str, ShardingPlan] = {
    "FULL_SHARD": ShardingPlan(replicas="one", reshard_after_forward=True),  # ZeRO-3
    "SHARD_GRAD_OP": ShardingPlan(replicas="one", reshard_after_forward=False),  # ZeRO-2
    "SHARD_OP": ShardingPlan(replicas="one", reshard_after_forward=False, gathered_for_the_step=True),  # ZeRO-1
    # DDP semantics: a (world, 1) mesh replicates every parameter and all-reduces gradients in fp32, through the same
    # code path and mixed-precision policy as the other modes. With a shard group of 1 there is nothing to free.
    "NO_SHARD": ShardingPlan(replicas="per_rank", reshard_after_forward=False),
    "HYBRID_SHARD": ShardingPlan(replicas="per_node", reshard_after_forward=True),
}


@dataclass
class DistEnv:
    """Where this process stands: its rank, its device and the data-parallel mesh."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    mesh: DeviceMesh
    timeout: timedelta
    """How long a collective waits for a peer; every process group the run creates gets it."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO; the others only warn, each line tagged with its rank."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def _rendezvous_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The key-value store the process group meets in, with its keys kept apart per torchrun restart.

    After `torchrun --max-restarts` restarts the workers, the agent's store still holds the previous attempt's keys,
    and a new worker can read a dead worker's gloo address from them before its peer overwrites it: `Gloo
    connectFullMesh failed ... Connection refused` or a hang (torch 2.13 on CPU: 5 of 6 restarts failed without the
    prefix, 0 of 3 with it; pytorch#167288 reports the same with NCCL). A prefix per attempt gives fresh keys.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_hosts_store,
        timeout=timeout,
        multi_tenant=True,
    )
    return dist.PrefixStore(f"fsdp_trainer/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(cfg: ParallelConfig) -> DistEnv:
    """Create the process group and mesh from torchrun's environment (or a 1-rank group without torchrun).

    Raises ValueError, before any collective, for a backend the machine cannot run or a HYBRID_SHARD world that does
    not split into whole nodes.
    """
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world_size = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", world_size)
    setup_logging(rank)
    backend = process_group_backend(cfg, torch.cuda.is_available())
    use_cuda = backend != "gloo"
    if cfg.sharding == "HYBRID_SHARD" and world_size % local_world_size:
        raise ValueError(
            f"parallel.sharding=HYBRID_SHARD needs the world size ({world_size}) to be a multiple of the ranks per "
            f"node ({local_world_size}); launch the same --nproc_per_node on every node"
        )
    if use_cuda and cfg.expandable_segments:
        _use_expandable_segments()
    elif cfg.expandable_segments:
        logger.info("parallel.expandable_segments: CUDA's allocator only, nothing to do on cpu")
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if use_cuda and cfg.cpu_offload:
        _use_host_cores(local_world_size)

    timeout = timedelta(seconds=cfg.timeout_s)
    if "RANK" in os.environ:
        store = _rendezvous_store(rank, world_size, timeout)
        device_id = device if use_cuda else None
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
        )
    else:  # plain `python -m fsdp_trainer.train`: a 1-rank group keeps FSDP and DCP on the same code path
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)

    n_replicas, _ = SHARDING[cfg.sharding].mesh_shape(world_size, local_world_size)
    if n_replicas == 1:
        mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))
    else:
        mesh = init_device_mesh(
            device.type, (n_replicas, world_size // n_replicas), mesh_dim_names=("dp_replicate", "dp_shard")
        )
    for dim in range(mesh.ndim):
        # The mesh's sub-groups (HYBRID_SHARD, NO_SHARD) are created with torch's default timeout (30 min for gloo);
        # a dead peer must fail them as fast as the main group. Private, but the only way after creation (torchtitan
        # does the same).
        dist.distributed_c10d._set_pg_timeout(timeout, mesh.get_group(dim))
    return DistEnv(rank, world_size, local_rank, local_world_size, device, mesh, timeout)


# From the least to the most capable: ranks that disagree (a node of V100s beside A100s) all take the lowest choice.
_PRECISION_RANK = ("fp32", "fp16", "bf16")
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA) below AVX512_CORE_BF16: oneDNN then emulates bf16 matmuls even on a CPU that has
# the units (measured: 1024 x 1024, 2.07 s against 0.016 s in fp32 with the cap AVX2, on an AVX512-BF16 CPU).
_ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def cpu_bf16_units(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The name of this CPU's bf16 matrix units, or None where torch can only emulate bf16 (x86 with AVX2 alone:
    15-80x slower than fp32). x86: what torch detects (AVX512-BF16, AMX); ARM: the `bf16` feature Linux reports
    (BFDOT/BFMMLA, which oneDNN's ARM kernels use), since torch 2.13 reports none there. A oneDNN ISA cap below
    AVX512_CORE_BF16 (ONEDNN_MAX_CPU_ISA, as containers and benchmarks set it) leaves the units unused: None."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()
    if cap in _ONEDNN_ISAS_WITHOUT_BF16:
        return None
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX512-BF16"
    try:
        with open(cpuinfo) as f:
            features = [line for line in f if line.startswith("Features")]  # ARM's flags line (x86 says "flags")
    except OSError:
        return None
    return "ARM BF16" if any("bf16" in line.split(":", 1)[1].split() for line in features) else None


def native_precision(device: torch.device) -> tuple[Precision, str]:
    """(precision, why): what `device` computes natively, the choice of parallel.mixed_precision=auto."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "bf16", f"{name} (compute capability {major}.{minor}) computes bf16 natively"
        return "fp16", f"{name} (compute capability {major}.{minor}) has no bf16 units; fp16 with loss scaling"
    units = cpu_bf16_units()
    if units is not None:
        return "bf16", f"this CPU computes bf16 natively ({units})"
    capability = torch.backends.cpu.get_cpu_capability()
    return "fp32", f"this CPU ({capability}) has no bf16 units (AVX512-BF16, AMX): bf16 would be emulated, far slower"


def precision_on(requested: str, device_type: str) -> tuple[Precision, str]:
    """(precision, why) a run on this machine's `device_type` would compute in, for the tools that plan or compare
    runs without starting one (the planner, the benchmarks): resolve_precision's choice, without the ranks' vote.
    Planning for GPUs on a machine that has none, auto is taken as bf16, what every GPU since the A100 computes."""
    if requested != AUTO:
        return requested, "as set"
    if device_type == "cuda" and not torch.cuda.is_available():
        return "bf16", "auto: a GPU with bf16 units assumed (compute capability >= 8.0; V100 / T4: set fp16)"
    native, why = native_precision(torch.device(device_type))
    return native, f"auto: {why}"


def resolve_precision(requested: str, env: DistEnv) -> Precision:
    """parallel.mixed_precision as the run will compute: `auto` becomes what the device computes natively, the same
    on every rank (the least capable rank's choice: one all-reduce at start-up), said in one log line. An explicit
    precision the device only emulates runs as asked, with one warning per node naming what to set instead."""
    native, why = native_precision(env.device)
    if requested == AUTO:
        choice = torch.tensor([_PRECISION_RANK.index(native)], device=env.device)
        dist.all_reduce(choice, op=dist.ReduceOp.MIN)  # ranks must agree: FSDP all-gathers in this dtype
        resolved = _PRECISION_RANK[int(choice.item())]
        if resolved != native:
            why = f"{resolved} is what every rank computes natively (this one: {why})"
        if env.is_main:
            logger.info(f"parallel.mixed_precision: auto -> {resolved}: {why}")
        return resolved
    emulated = (requested == "bf16" and native != "bf16") or (
        requested == "fp16" and env.device.type == "cpu" and not torch.cpu._is_amx_fp16_supported()
    )
    if emulated and env.local_rank == 0:
        logger.warning(
            f"parallel.mixed_precision={requested} runs as asked, but {why}, where {requested} is emulated and slow: "
            f"set parallel.mixed_precision auto (here {native})"
        )
    return requested


def process_group_backend(cfg: ParallelConfig, cuda_available: bool) -> str:
    """The backend string for init_process_group: gloo on CPUs, NCCL on GPUs, and under parallel.cpu_offload NCCL for
    GPU tensors beside gloo for host ones (`cuda:nccl,cpu:gloo`): gradient clipping and Muon's exchanges meet the
    offloaded shards on the host, where NCCL cannot reduce. Raises ValueError for nccl without a GPU."""
    if cfg.backend == "nccl" and not cuda_available:
        raise ValueError("parallel.backend=nccl needs CUDA, and no GPU is visible; use auto or gloo")
    if cfg.backend == "gloo" or not cuda_available:
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cfg.cpu_offload else "nccl"


def _use_host_cores(ranks_per_node: int) -> None:
    """Give the optimizer step on the host (parallel.cpu_offload) this rank's share of the node's cores: torchrun
    starts workers with OMP_NUM_THREADS=1, which would leave the step on one core while the GPU waits."""
    threads = max(1, len(os.sched_getaffinity(0)) // ranks_per_node)
    torch.set_num_threads(threads)
    logger.info(f"parallel.cpu_offload: the optimizer steps on the host with {threads} threads per rank")


def _use_expandable_segments() -> None:
    """Switch CUDA's caching allocator to expandable segments, through its documented environment variable: read when
    the allocator starts, which is why this runs before the first CUDA call that allocates."""
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "parallel.expandable_segments: CUDA was initialized before the trainer could set it; export "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before launching instead"
        )
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" not in conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))


def close_distributed() -> None:
    """Destroy every process group, and free now, not at interpreter exit, whatever still holds one in a reference
    cycle (FSDP's mesh info holds its group). A gloo group freed at exit can abort the process: its worker thread,
    still releasing its last collective's tensor, needs the GIL the exiting interpreter no longer gives out, and
    "terminate called without an active exception" follows (rank 1 of 2, 2 of 45 runs on a loaded 2-core CPU,
    torch 2.13)."""
    dist.destroy_process_group()
    gc.collect()


def sum_over_ranks(x: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor over all ranks, queued on the device (no host sync)."""
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """The largest of each number over all ranks, in one all-reduce (a host sync: call it on log steps only)."""
    x = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.tolist()


class PreemptionFlag:
    """SIGTERM (what Slurm, Kubernetes and torchrun send before killing) asks the run to stop after the current step.

    Ranks can receive the signal steps apart, so they agree once per step with a MAX all-reduce of one integer on a
    gloo group of its own: a CPU round trip that never waits on the GPU, unlike reading a device tensor would.
    """

    def __init__(self, timeout: timedelta) -> None:
        self.received = False
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True

    def agreed(self) -> bool:
        flag = torch.tensor([int(self.received)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def close(self) -> None:
        """Give SIGTERM back and free the group now: the handler would keep the group alive until interpreter exit,
        where freeing it can abort the process (see close_distributed)."""
        signal.signal(signal.SIGTERM, self._previous_handler)
        dist.destroy_process_group(self.group)
        self.group = None


def silent_ranks(rank: int, world_size: int, wait_s: float = 5.0) -> list[int]:
    """After this rank failed: which ranks did not also report a failure within `wait_s`, i.e. the dead or hung ones.

    A collective that fails because a peer died names only the peer's address, and one that times out names nobody.
    Every failing rank writes a key to the rendezvous store (fresh per torchrun restart) and waits briefly for the
    others' keys; the ranks that never write one are the ones that exited or hang.
    """
    store = dist.distributed_c10d._get_default_store()
    store.set(f"failed/{rank}", "1")
    keys = [f"failed/{r}" for r in range(world_size)]
    deadline = time.monotonic() + wait_s
    while True:
        silent = [r for r, key in enumerate(keys) if not store.check([key])]
        if not silent or time.monotonic() > deadline:
            return silent
        time.sleep(0.1)


# Ops whose outputs selective AC keeps: the matmuls and attention are what is costly to recompute; norms,
# activations and elementwise ops are cheap to redo and account for most of the activation memory.
_SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
for _name in (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
):
    if hasattr(torch.ops.aten, _name):
        _SAVE_OPS.add(getattr(torch.ops.aten, _name).default)


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_save_matmuls_policy)


def apply_ac(model: Transformer, mode: str, every: int = 1) -> None:
    """Wrap every `every`-th block in activation checkpointing: `full` recomputes the whole block in backward,
    `selective` recomputes all but the matmul and attention outputs."""
    if mode == "none":
        return
    layers = model.model.layers
    for i, (name, block) in enumerate(list(layers.items())):
        if i % every:
            continue
        if mode == "full":
            layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            layers[name] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_context)


def apply_compile(model: Transformer) -> None:
    """torch.compile each block separately: same graph for all blocks, so one compile serves them all."""
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
) -> None:
    """fully_shard each block, then the root (embedding, final norm, lm_head and what is left); with
    prefetch_blocks > 1, each block's hooks start the all-gathers of the next k blocks (the previous k in backward);
    with cpu_offload, the shards, their gradients and so the optimizer state stay in host memory."""
    plan = SHARDING[sharding]
    # The compute dtype for the parameter all-gather and the matmuls; master weights, optimizer state and the
    # gradient reduction stay fp32 whatever it is.
    mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype(mixed_precision), reduce_dtype=torch.float32)
    shard = partial(fully_shard, mesh=mesh, mp_policy=mp_policy)
    if cpu_offload:
        # Pinned host memory lets the copies overlap compute; pinning needs an accelerator, so not on a CPU-only mesh.
        shard = partial(shard, offload_policy=CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda"))
    blocks = list(model.model.layers.values())
    if not blocks:
        raise ValueError("apply_fsdp found no Transformer block to wrap")
    for i, block in enumerate(blocks):
        # Backward starts with the last block, so freeing its gathered params after forward would only mean
        # gathering them again at once; the same holds for the root (embedding, final norm, lm_head).
        shard(block, reshard_after_forward=plan.reshard_after_forward and i < len(blocks) - 1)
    shard(model, reshard_after_forward=False)
    model.sharding_plan = plan  # set_gradient_sync reads it on every micro-step
    model.cpu_offload = cpu_offload  # materialize reads it: the shards must then be allocated on the host
    if prefetch_blocks > 1:
        # On its own FSDP2 overlaps one block ahead (in forward as far as the CPU runs ahead, in backward by the
        # reversed forward order); an explicit list replaces that, so it starts with the adjacent block.
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + prefetch_blocks])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch_blocks) : i][::-1])


def parallelize(model: Transformer, cfg: ParallelConfig, mesh: DeviceMesh) -> None:
    """Apply, in this order: activation checkpointing -> compile -> FSDP per block -> FSDP on the root.

    AC must wrap the block before FSDP does, so FSDP's hooks sit outside the recomputed region, and compile goes in
    between so it sees the checkpointed block whole (pytorch#148831).
    """
    apply_ac(model, cfg.activation_checkpointing, cfg.ac_every)
    if cfg.compile:
        apply_compile(model)
        # Packed examples then attend through flex_attention, compiled into a kernel that skips the blocks the mask
        # empties (eager, it is slower than the boolean mask); torch 2.13 has no flex_attention backward on CPUs.
        model.flex_attention = mesh.device_type == "cuda"
    apply_fsdp(model, mesh, cfg.sharding, cfg.mixed_precision, cfg.prefetch_blocks, cfg.cpu_offload)


def _fill_local_shard(param: nn.Parameter, values: torch.Tensor) -> None:
    """Write this rank's part of a full-shape tensor into a (possibly sharded) parameter, without communication."""
    if isinstance(param, DTensor):
        local = distribute_tensor(values, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(values)


def materialize(model: Transformer, device: torch.device, seed: int) -> None:
    """Allocate the meta-device model's shards on `device` and initialise them: the same weights at any world size.

    When parallelize() applied parallel.cpu_offload, the shards are allocated in host memory, where FSDP2 requires
    them, and the buffers (the rotary tables) on the device, where the compute reads them; the values are still drawn
    on the device, so a run with offload starts from the same weights as one without.
    """
    cpu_offload = getattr(model, "cpu_offload", False)
    model.to_empty(device="cpu" if cpu_offload else device)
    if cpu_offload:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, torch.empty_like(buffer, device=device))  # stays the same (non-)persistent buffer
    model.init_weights(seed=seed, fill=_fill_local_shard, device=device)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn FSDP's gradient reduction on (last micro-step) or off (accumulate locally). Under SHARD_OP (ZeRO-1) the
    gathered parameters are also kept after backward until then, so the next micro-step does not gather them again;
    after the last one they are freed, since the optimizer step is about to change their shards."""
    model.set_requires_gradient_sync(enabled)
    if model.sharding_plan.gathered_for_the_step:
        model.set_reshard_after_backward(enabled)
