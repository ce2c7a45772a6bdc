"""Expert parallelism on 2 gloo ranks: a Qwen3-MoE shape with many experts trained with and without it, FSDP over both
ranks either way. Per configuration: tokens/s, the elements each rank all-gathers (FSDP's parameters) and puts into
all-to-alls (EP's token copies) in one step, and the peak torch's FSDPMemTracker counts on a rank.

    python benchmarks/bench_expert_parallel.py --repeats 3 --steps 5

fp32; `repeats` rounds, each timing `steps` steps of EP 1 and of EP 2, alternating which goes first; the counts and
peaks from the first round (they do not vary).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist
from runner import on_two_ranks
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_trainer.config import ModelConfig, MoEConfig, OptimConfig, ParallelConfig
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import materialize, parallelize
from fsdp_trainer.model import Transformer
from fsdp_trainer.optim import build_optimizer
from fsdp_trainer.train import train_step

SHAPE = ModelConfig(family="qwen3_moe", dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512,
                    vocab_size=4096, max_seq_len=256, moe=MoEConfig(experts=32, top_k=4, ffn_dim=256))  # fmt: skip
"""Qwen3-30B-A3B's proportions scaled down: many narrow experts (32 of width 256 here, 128 of 768 there), top 4."""


class Moved(TorchDispatchMode):
    """Elements a rank all-gathers (the gathered outputs) and puts into all-to-alls, by kind."""

    def __init__(self):
        super().__init__()
        self.elements: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d" and name == "_allgather_base_":
            self.elements["all_gather"] += args[0].numel()
        elif func.namespace == "_c10d_functional" and name == "all_to_all_single":
            self.elements["all_to_all"] += args[0].numel()
        return func(*args, **(kwargs or {}))


def _built(ep: int, mesh):
    with torch.device("meta"):
        model = Transformer(SHAPE)
    parallel = ParallelConfig(mixed_precision="fp32", expert_parallel=ep)
    applied = parallelize(model, parallel, mesh)
    materialize(model, torch.device("cpu"), 0, applied.cpu_offload)
    return model, build_optimizer(model, OptimConfig()), applied.plan


def measured(rank: int, world: int, repeats: int, steps: int) -> dict:
    """Per EP degree (1, `world`): step times, elements moved, peak GB, on this rank."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    tokens = torch.randint(0, SHAPE.vocab_size, (4, 257), generator=torch.Generator().manual_seed(rank))
    batches = [MicroBatch(tokens[:, :-1], tokens[:, 1:], None)]
    built = {ep: _built(ep, mesh) for ep in (1, world)}
    found = {ep: {"seconds": []} for ep in built}
    for ep, (model, optimizer, plan) in built.items():
        train_step(model, optimizer, batches, 1e-4, 1.0, plan=plan)  # warm
        with Moved() as moved:
            train_step(model, optimizer, batches, 1e-4, 1.0, plan=plan)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((batches[0].inputs,))
        with tracker:
            train_step(model, optimizer, batches, 1e-4, 1.0, plan=plan)
        peak = max(kind["Total"] for kind in tracker.get_tracker_snapshot("peak").values())
        found[ep].update(moved.elements, peak_gb=peak / 1e9)
    for r in range(repeats):
        for ep in list(built) if r % 2 == 0 else list(built)[::-1]:
            model, optimizer, plan = built[ep]
            dist.barrier()  # both ranks start a configuration together: its collectives wait for the slower
            start = time.perf_counter()
            for _ in range(steps):
                stats = train_step(model, optimizer, batches, 1e-4, 1.0, plan=plan)
            stats["loss"].item()
            found[ep]["seconds"].append((time.perf_counter() - start) / steps)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    found = on_two_ranks(measured, args.repeats, args.steps)
    tokens = 2 * 4 * 256  # a step's: 2 ranks x 4 windows of 256
    shape = f"Qwen3-MoE shape ({SHAPE.moe.experts} experts, top {SHAPE.moe.top_k})"
    print(f"{shape}, 2 ranks, fp32, {tokens} tokens a step, CPU {torch.backends.cpu.get_cpu_capability()}")
    print("| expert parallel | s / step (median) | tokens/s | M elements all-gathered / rank | M elements all-to-all / "
          "rank | peak GB / rank |\n|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for ep, row in sorted(found.items()):
        seconds = statistics.median(row["seconds"])
        print(f"| {ep} | {seconds:.3f} | {tokens / seconds:,.0f} | {row.get('all_gather', 0) / 1e6:.2f} | "
              f"{row.get('all_to_all', 0) / 1e6:.2f} | {row['peak_gb']:.3f} |")  # fmt: skip
    ratio = statistics.median(found[1]["seconds"]) / statistics.median(found[2]["seconds"])
    print(f"EP 2 / EP 1 tokens/s: {ratio:.2f} (rounds: {found[1]['seconds']} vs {found[2]['seconds']})")


if __name__ == "__main__":
    main()
