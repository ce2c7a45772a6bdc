"""Optimizer step time: Muon against AdamW on the recipe's model, sharded as in training. Run it under torchrun:

    torchrun --standalone --nproc_per_node=2 benchmarks/bench_optimizer.py --recipe recipes/125m.yaml --repeats 5

Builds the model as train.py does (meta, parallelize, materialize), gives every parameter a random gradient, and
times optimizer.step() of AdamW and of Muon (its Newton-Schulz, gathers and scatters included), `steps` steps per
round after a warm-up, alternating which goes first. Rank 0 prints the median seconds per step of each and their
ratio, as a markdown table.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from fsdp_trainer.build import build_model
from fsdp_trainer.config import parse_args, recipe_parser
from fsdp_trainer.distributed.runtime import close_distributed, init_distributed, resolve_precision
from fsdp_trainer.optim import build_optimizer


def main(argv: list[str] | None = None) -> None:
    parser = recipe_parser("benchmarks/bench_optimizer.py", __doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    recipe, args = parse_args(parser, argv)
    env = init_distributed(recipe.parallel)
    recipe.parallel.mixed_precision = resolve_precision(recipe.parallel.mixed_precision, env)
    recipe.train.seed = 0
    model, _ = build_model(recipe, env)
    generator = torch.Generator(device=env.device).manual_seed(env.rank)
    for p in model.parameters():
        local = torch.randn(p.to_local().shape, generator=generator, device=env.device) * 1e-3
        p.grad = torch.distributed.tensor.DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
    optimizers = {}
    for name in ("adamw", "muon"):
        recipe.optim.name = name
        optimizers[name] = build_optimizer(model, recipe.optim)
        optimizers[name].step()  # warm-up: state allocated

    def timed(optimizer) -> float:
        dist.barrier()  # rounds start together, so one rank's lead is not timed as another's wait
        start = time.perf_counter()
        for _ in range(args.steps):
            optimizer.step()
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.steps

    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for repeat in range(args.repeats):
        for name in list(optimizers) if repeat % 2 == 0 else list(optimizers)[::-1]:
            times[name].append(timed(optimizers[name]))
    if env.is_main:
        n_params = sum(p.numel() for p in model.parameters())
        adamw, muon = (statistics.median(times[n]) for n in ("adamw", "muon"))
        ratio = statistics.median(m / a for m, a in zip(times["muon"], times["adamw"], strict=True))
        print(f"{n_params / 1e6:.1f}M parameters, {env.world_size} rank(s), {recipe.parallel.sharding}, {env.device}")
        print("| optimizer | step, ms | ratio to AdamW |")
        print("|---|---|---|")
        print(f"| AdamW (fused) | {adamw * 1e3:.0f} | 1.00 |")
        print(f"| Muon (+ AdamW for embeddings, head, norms) | {muon * 1e3:.0f} | {ratio:.2f} |")
    close_distributed()


if __name__ == "__main__":
    main()
