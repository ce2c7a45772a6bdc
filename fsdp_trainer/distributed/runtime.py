"""The processes of a run: the process group and device mesh from torchrun's environment, the precision the device
computes natively, reductions over ranks, SIGTERM (preemption) and the ranks that went silent after a failure.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_trainer.config import AUTO, ParallelConfig, Precision
from fsdp_trainer.distributed.context_parallel import ContextParallel, context_group
from fsdp_trainer.distributed.expert_parallel import experts_mesh
from fsdp_trainer.distributed.parallelize import SHARDING

logger = logging.getLogger("fsdp_trainer")


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
    context: ContextParallel | None = None
    """This rank's context-parallel group (parallel.context_parallel > 1), whose ranks read the same windows."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which share of the global batch's windows this rank reads: a context-parallel group reads one."""
        return self.rank // (self.context.degree if self.context else 1)

    @property
    def data_world(self) -> int:
        """The ranks that read different windows (data-parallel ranks)."""
        return self.world_size // (self.context.degree if self.context else 1)

    @property
    def shard(self) -> Callable | None:
        """What a loader does to each micro-batch it reads: context parallelism's cut to this rank's share, or None."""
        return self.context.shard if self.context else None


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
    check_groups(cfg, world_size)
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
    context = context_group(cfg.context_parallel, world_size, device)
    experts = experts_mesh(cfg.expert_parallel, world_size, device.type)  # kept for parallelize() to find
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)] + ([context.group] if context else [])
    groups += [experts.get_group(dim) for dim in range(experts.ndim)] if experts is not None else []
    for group in groups:
        # The mesh's sub-groups (HYBRID_SHARD, NO_SHARD; context and expert parallelism's) are created with torch's
        # default timeout (30 min for gloo); a dead peer must fail them as fast as the main group. Private, but the
        # only way after creation (torchtitan does the same).
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    return DistEnv(rank, world_size, local_rank, local_world_size, device, mesh, timeout, context)


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


def check_groups(cfg: ParallelConfig, world_size: int) -> None:
    """ValueError unless the world splits into whole context- and expert-parallel groups (before any collective)."""
    for name in ("context_parallel", "expert_parallel"):
        degree = getattr(cfg, name)
        if world_size % degree:
            raise ValueError(
                f"parallel.{name}={degree} needs the world size ({world_size}) to be a multiple of it; launch a "
                "multiple of it as processes"
            )


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


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher() -> None:
    """A worker started by torchrun's agent (torchrun, fsdp-train) dies the moment its launcher dies: a `kill -9` of the
    launcher, or the OOM killer picking it, would otherwise leave the workers training on (torchrun starts each in a
    session of its own) and saving into the run directory beside the next attempt. On Linux the kernel sends SIGKILL
    (prctl's parent-death signal), not SIGTERM: a worker must not publish a checkpoint its dead launcher's peers may
    never finish; if the launcher died before the call (the worker then has a new parent), the worker exits at once.
    Elsewhere a watchdog thread polls the parent instead. Plain `python -m` and Slurm's srun without torchrun: nothing
    changes."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != launcher or launcher == 1:  # reparented: the launcher is already gone
                os._exit(1)
            return
        logger.warning(f"prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): watching torchrun by polling")
    watch_launcher(launcher)


def watch_launcher(launcher: int, every_s: float = 1.0) -> threading.Thread:
    """A daemon thread that ends the process (exit 1, no checkpoint published) within `every_s` of its parent, pid
    `launcher`, dying (at once if that is init's pid 1: the parent is gone already): the parent-death signal where the
    kernel has none."""

    def watch() -> None:
        while os.getppid() == launcher != 1:
            time.sleep(every_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="watch_launcher", daemon=True)
    thread.start()
    return thread


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

    Ranks can receive the signal steps apart, so they agree once per step with a MAX all-reduce of a few integers on
    a gloo `group` (the caller's, apart from training's): a CPU round trip that never waits on the GPU, unlike reading
    a device tensor would.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.received = False
        self.group = group
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = True

    def agreed(self, *flags: bool) -> list[bool]:
        """[SIGTERM reached some rank, then for each of the caller's `flags`: true on some rank], in one all-reduce."""
        values = torch.tensor([int(self.received), *map(int, flags)])
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in values.tolist()]

    def close(self) -> None:
        """Give SIGTERM back: the handler would keep the group alive until interpreter exit, where freeing it can
        abort the process (see close_distributed)."""
        signal.signal(signal.SIGTERM, self._previous_handler)
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
