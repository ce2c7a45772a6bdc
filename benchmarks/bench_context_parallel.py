"""Context parallelism's memory per rank on real CPU tensors: one optimizer step of the debug recipe's model on 2 gloo
ranks (FSDP over both), each rank holding a whole window of `seq_len` tokens (CP 1, data-parallel), then the two
holding halves of one window (CP 2); the peak torch's FSDPMemTracker counts (parameters, gradients, optimizer state,
activations, temporaries) beside the planner's estimate of the same step, and the planner's activations and logits.

    python benchmarks/bench_context_parallel.py --seq_len 4096

fp32; the second step is measured (AdamW's state exists). tests/test_context_parallel.py runs it at a smaller shape.
"""

from __future__ import annotations

import argparse

import torch
from runner import on_two_ranks
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh

from fsdp_trainer.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, Recipe
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.context_parallel import context_group
from fsdp_trainer.distributed.parallelize import materialize, parallelize
from fsdp_trainer.model import Transformer
from fsdp_trainer.optim import build_optimizer
from fsdp_trainer.planner.memory import estimate
from fsdp_trainer.train import train_step

DEBUG = {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 768, "vocab_size": 4096}
"""recipes/debug.yaml's model."""


def peaks(rank: int, world: int, seq_len: int, model: dict) -> dict[int, dict[str, float]]:
    """Per CP degree (1, 2) on this group of `world` ranks: the measured peak GB of this rank and the planner's (no
    runtime term), its activations and logits."""
    cfg = ModelConfig(**model, max_seq_len=seq_len)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    context = context_group(world, world, torch.device("cpu"))
    found = {}
    for cp in (1, world):
        g = torch.Generator().manual_seed(rank if cp == 1 else 0)  # a window each, or one window for the group
        tokens = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), generator=g)
        batch = MicroBatch(tokens[:, :-1], tokens[:, 1:], None)
        batch = context.shard(batch) if cp > 1 else batch
        with torch.device("meta"):
            net = Transformer(cfg)
        parallel = ParallelConfig(mixed_precision="fp32", context_parallel=cp)
        applied = parallelize(net, parallel, mesh)
        materialize(net, torch.device("cpu"), 0, applied.cpu_offload)
        optimizer = build_optimizer(net, OptimConfig())
        train_step(net, optimizer, [batch], 1e-3, 1.0, plan=applied.plan)
        tracker = FSDPMemTracker(net, optimizer)
        tracker.track_inputs((batch.inputs,))
        with tracker:
            train_step(net, optimizer, [batch], 1e-3, 1.0, plan=applied.plan)
        measured = max(by_kind["Total"] for by_kind in tracker.get_tracker_snapshot("peak").values()) / 1e9
        recipe = Recipe(model=cfg, parallel=parallel, data=DataConfig(seq_len=seq_len, micro_batch_size=1))
        planned = estimate(recipe, world, 1, "FULL_SHARD", "none", "cpu")
        found[cp] = {"measured": measured, "planned": planned.total_gb - planned.runtime_gb,
                     "activations": planned.activations_gb, "logits": planned.logits_gb}  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq_len", type=int, default=4096)
    args = parser.parse_args()
    found = on_two_ranks(peaks, args.seq_len, DEBUG)
    print(f"debug model, {args.seq_len} tokens a window, 2 ranks, fp32, CPU {torch.backends.cpu.get_cpu_capability()}")
    print("| context parallel | measured peak GB / rank | planned | planned activations | planned logits |")
    print("|---|---:|---:|---:|---:|")
    for cp, row in sorted(found.items()):
        cells = [row[k] for k in ("measured", "planned", "activations", "logits")]
        print(f"| {cp} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
