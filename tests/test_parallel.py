"""distributed/: parallelize() on 2 real gloo ranks (the init is the same at any world size, shards follow the
table) and the runtime: backends, host cores, the precision a device computes natively."""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

from fsdp_trainer.config import ModelConfig, ParallelConfig
from fsdp_trainer.distributed import parallelize as parallelize_module
from fsdp_trainer.distributed import runtime
from fsdp_trainer.distributed.parallelize import SHARDING, materialize, parallelize, set_gradient_sync
from fsdp_trainer.loss import NextTokenLoss
from fsdp_trainer.model import Transformer
from tests.helpers import run_distributed

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=77, max_seq_len=32)


def _check_sharded_model(rank, world_size, sharding, ac, cpu_offload=False):
    shape = (world_size,) if SHARDING[sharding].replicas == "one" else (world_size, 1)
    names = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with torch.device("meta"):
        model = Transformer(CFG)
    policies = []
    real_fully_shard = parallelize_module.fully_shard

    def fully_shard(module, **kwargs):  # records the offload policy each FSDP unit gets
        policies.append(kwargs.get("offload_policy"))
        return real_fully_shard(module, **kwargs)

    parallelize_module.fully_shard = fully_shard
    cfg = ParallelConfig(
        sharding=sharding, activation_checkpointing=ac, mixed_precision="fp32", cpu_offload=cpu_offload
    )
    applied = parallelize(model, cfg, mesh)
    parallelize_module.fully_shard = real_fully_shard
    materialize(model, torch.device("cpu"), seed=5, cpu_offload=applied.cpu_offload)
    # Every block and the root: offloaded, unpinned (pinning needs an accelerator), or not at all.
    expected = CPUOffloadPolicy(pin_memory=False) if cpu_offload else None
    assert policies == [expected] * (CFG.n_layers + 1)

    # The full weights equal a single-process init with the same seed, under the HF names.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    reference = Transformer(CFG)
    reference.init_weights(seed=5)
    assert set(full) == set(reference.state_dict())
    for name, tensor in reference.state_dict().items():
        assert torch.equal(full[name], tensor), name

    # Each rank holds 1/world of each matrix (FULL_SHARD, SHARD_GRAD_OP) or all of it (NO_SHARD).
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        rows = p.shape[0] if sharding == "NO_SHARD" else len(torch.arange(p.shape[0]).chunk(world_size)[rank])
        assert p.to_local().shape == (rows, *p.shape[1:]), name

    # And the sharded forward equals the reference forward.
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OP", "NO_SHARD"])
def test_sharded_init_equals_single_process_init(sharding):
    run_distributed(_check_sharded_model, sharding, "none")


def test_cpu_offload_shards_in_host_memory_with_the_same_init():
    run_distributed(_check_sharded_model, "FULL_SHARD", "none", True)


def _gathered_between_micro_steps(rank, world_size, sharding):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        model = Transformer(CFG)
    applied = parallelize(model, ParallelConfig(sharding=sharding, mixed_precision="fp32"), mesh)
    materialize(model, torch.device("cpu"), seed=5)
    weight = lambda: model.model.layers["0"].mlp.gate_proj.weight  # noqa: E731 (the registered tensor changes)
    tokens = torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    kept = []
    for last in (False, True):  # two micro-steps of one optimizer step
        set_gradient_sync(model, applied.plan, last)
        model(tokens, loss=NextTokenLoss(tokens)).backward()
        kept.append(not isinstance(weight(), DTensor))  # FSDP registers the unsharded tensor while gathered
    # ZeRO-1 keeps the block gathered from the first micro-step into the next (no second all-gather) and frees it
    # after the last, before the optimizer changes its shards; ZeRO-2 frees it after every backward.
    assert kept == ([True, False] if sharding == "SHARD_OP" else [False, False])
    assert isinstance(weight().grad, DTensor)  # reduce-scattered once, on the last micro-step


@pytest.mark.parametrize("sharding", ["SHARD_OP", "SHARD_GRAD_OP"])
def test_zero1_keeps_parameters_gathered_over_the_micro_steps(sharding):
    run_distributed(_gathered_between_micro_steps, sharding)


def test_wrapped_blocks_keep_hf_names():
    run_distributed(_check_sharded_model, "FULL_SHARD", "selective")


def test_expandable_segments_joins_the_users_allocator_settings(monkeypatch):
    """The allocator reads PYTORCH_CUDA_ALLOC_CONF once, when CUDA starts: set it before, keeping the user's options,
    and refuse once it is too late rather than silently do nothing."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    runtime._use_expandable_segments()
    assert runtime.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512,expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # the user's explicit choice wins
    runtime._use_expandable_segments()
    assert runtime.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    runtime._use_expandable_segments()
    assert runtime.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA was initialized before the trainer could set it; export"):
        runtime._use_expandable_segments()


@pytest.mark.parametrize(
    "backend, offload, cuda, expected",
    [
        ("auto", False, True, "nccl"),
        ("auto", True, True, "cuda:nccl,cpu:gloo"),  # clipping and Muon reduce the offloaded host tensors
        ("nccl", True, True, "cuda:nccl,cpu:gloo"),
        ("auto", True, False, "gloo"),  # a CPU-only machine: one memory, one backend
        ("gloo", True, True, "gloo"),
    ],
)
def test_process_group_backend(backend, offload, cuda, expected):
    assert runtime.process_group_backend(ParallelConfig(backend=backend, cpu_offload=offload), cuda) == expected


def test_nccl_without_a_gpu_is_refused_by_name():
    with pytest.raises(ValueError, match="parallel.backend=nccl needs CUDA"):
        runtime.process_group_backend(ParallelConfig(backend="nccl"), cuda_available=False)


def test_offload_gives_the_hosts_optimizer_step_a_share_of_the_cores(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1; under offload each of a node's ranks gets its share of the cores instead."""
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(16)))
    before = torch.get_num_threads()
    try:
        runtime._use_host_cores(ranks_per_node=4)
        assert torch.get_num_threads() == 4
        runtime._use_host_cores(ranks_per_node=32)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# --- parallel.mixed_precision: auto -----------------------------------------------------------------------------------


def _fake_cpu(monkeypatch, tmp_path, amx=False, avx512_bf16=False, arm_features=None):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    cpuinfo = tmp_path / "cpuinfo"  # ARM's /proc/cpuinfo names its features on a `Features` line
    cpuinfo.write_text(f"processor\t: 0\nFeatures\t: {arm_features}\n" if arm_features else "flags\t\t: fpu avx2\n")
    real = runtime.cpu_bf16_units
    monkeypatch.setattr(runtime, "cpu_bf16_units", lambda: real(str(cpuinfo)))


def _fake_gpu(monkeypatch, name, capability):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability >= (8, 0))


@pytest.mark.parametrize(
    "cpu, expected, named",
    [
        ({"amx": True, "avx512_bf16": True}, "bf16", "AMX"),  # Sapphire Rapids and later
        ({"avx512_bf16": True}, "bf16", "AVX512-BF16"),  # Cooper Lake, Zen 4
        ({}, "fp32", "no bf16 units"),  # AVX2 only: bf16 is emulated, 15-80x slower than fp32
        ({"arm_features": "fp asimd sve bf16 i8mm"}, "bf16", "ARM BF16"),  # Graviton 3, Neoverse V1
        ({"arm_features": "fp asimd evtstrm crc32"}, "fp32", "no bf16 units"),  # Graviton 2
    ],
)
def test_auto_precision_on_each_kind_of_cpu(monkeypatch, tmp_path, cpu, expected, named):
    _fake_cpu(monkeypatch, tmp_path, **cpu)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    precision, why = runtime.native_precision(torch.device("cpu"))
    assert precision == expected and named in why


def test_a_onednn_isa_cap_below_bf16_means_no_bf16_units(monkeypatch, tmp_path):
    """ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN emulate bf16 on a CPU that has the units: auto must not pick it."""
    _fake_cpu(monkeypatch, tmp_path, amx=True, avx512_bf16=True)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert runtime.native_precision(torch.device("cpu"))[0] == "fp32"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert runtime.native_precision(torch.device("cpu"))[0] == "bf16"


@pytest.mark.parametrize(
    "name, capability, expected",
    [("NVIDIA H100 80GB HBM3", (9, 0), "bf16"), ("NVIDIA A100-SXM4-80GB", (8, 0), "bf16"),
     ("Tesla V100-SXM2-32GB", (7, 0), "fp16"), ("Tesla T4", (7, 5), "fp16")],
)  # fmt: skip
def test_auto_precision_on_each_kind_of_gpu(monkeypatch, name, capability, expected):
    _fake_gpu(monkeypatch, name, capability)
    precision, why = runtime.native_precision(torch.device("cuda", 0))
    assert precision == expected and name in why and f"{capability[0]}.{capability[1]}" in why


def _resolve_on_ranks(rank, world_size, bf16_ranks, requested, expected):
    os.environ.pop("ONEDNN_MAX_CPU_ISA", None)  # the CPU is faked here, whatever the run's environment says
    torch.cpu._is_amx_tile_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: rank in bf16_ranks
    runtime.cpu_bf16_units.__defaults__ = ("/nonexistent",)  # no ARM features line on this x86 test machine
    env = runtime.DistEnv(rank, world_size, rank, world_size, torch.device("cpu"), None, None)
    assert runtime.resolve_precision(requested, env) == expected


@pytest.mark.parametrize(
    "bf16_ranks, requested, expected",
    [((0, 1), "auto", "bf16"), ((0,), "auto", "fp32"), ((), "auto", "fp32"), ((), "bf16", "bf16")],
)
def test_auto_precision_is_the_same_on_every_rank(bf16_ranks, requested, expected):
    """Ranks vote: one rank without bf16 units makes every rank compute in fp32 (FSDP gathers in one dtype); an
    explicit choice is kept as asked."""
    run_distributed(_resolve_on_ranks, bf16_ranks, requested, expected)


def test_explicit_bf16_where_it_is_emulated_runs_with_one_warning(monkeypatch, tmp_path, caplog):
    _fake_cpu(monkeypatch, tmp_path)
    env = runtime.DistEnv(0, 1, 0, 1, torch.device("cpu"), None, None)
    with caplog.at_level("INFO", logger="fsdp_trainer"):
        assert runtime.resolve_precision("bf16", env) == "bf16"
        assert runtime.resolve_precision("fp32", env) == "fp32"
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "parallel.mixed_precision=bf16 runs as asked" in warning and "set parallel.mixed_precision auto" in warning
    assert "(here fp32)" in warning


def test_the_planner_and_the_tools_see_what_a_run_would_resolve(monkeypatch, tmp_path):
    _fake_cpu(monkeypatch, tmp_path)
    assert runtime.precision_on("auto", "cpu")[0] == "fp32"
    assert runtime.precision_on("fp16", "cpu") == ("fp16", "as set")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # planning for GPUs from a machine without one
    assert runtime.precision_on("auto", "cuda")[0] == "bf16"
