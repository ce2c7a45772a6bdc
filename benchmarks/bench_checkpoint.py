"""What checksums cost a checkpoint: saving through fsdp_trainer's ChecksummedWriter against DCP's plain
FileSystemWriter, sync and async, and verifying before a resume with the files split over the ranks against every
rank reading every file.

    python benchmarks/bench_checkpoint.py --recipe recipes/125m.yaml --nproc 2 --repeats 10 [--work_dir DIR]

Launches itself under torchrun. Each rank builds the recipe's model with FSDP as training does and gives it AdamW
state (one update from zero gradients), so a save writes what a training checkpoint holds (weights and both moments).
After one unrecorded save of each kind, `repeats` times it saves with each writer in turn (the order alternating),
sync (training would be blocked for the whole save) and async (blocked until dcp.async_save returns; total until its
write has finished), with a barrier between saves; then it verifies the last checkpoint both ways. Rank 0 prints the
medians and writes every figure to --out as JSON. Any recipe key can be overridden as in training.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from runner import launch, report_header, torchrun_command

from fsdp_trainer.build import build_model
from fsdp_trainer.checkpoint.checkpointer import OptimState
from fsdp_trainer.checkpoint.storage import ChecksummedWriter
from fsdp_trainer.checkpoint.verify import verify_checkpoint
from fsdp_trainer.checkpoint.weights import ModelState
from fsdp_trainer.config import parse_args, recipe_parser
from fsdp_trainer.distributed.runtime import close_distributed, init_distributed, resolve_precision
from fsdp_trainer.optim import build_optimizer


def training_state(recipe, env) -> dict:
    model, _ = build_model(recipe, env)
    optimizer = build_optimizer(model, recipe.optim)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates both AdamW moments
    return {"model": ModelState(model), "optim": OptimState(model, optimizer)}


def timed_save(states: dict, path: Path, checksums: bool, mode: str, group) -> dict:
    writer = ChecksummedWriter(path, {}) if checksums else dcp.FileSystemWriter(path)
    dist.barrier()
    start = time.perf_counter()
    if mode == "sync":
        dcp.save(states, storage_writer=writer)
        blocked = time.perf_counter() - start
    else:
        future = dcp.async_save(states, storage_writer=writer, process_group=group)
        blocked = time.perf_counter() - start
        future.result()
    total = time.perf_counter() - start
    times = [None] * dist.get_world_size()
    dist.all_gather_object(times, (blocked, total))
    return {"blocked_s": max(t[0] for t in times), "total_s": max(t[1] for t in times)}  # the slowest rank's


def timed_verify(path: Path, split: bool) -> float:
    dist.barrier()
    start = time.perf_counter()
    rank, world = (dist.get_rank(), dist.get_world_size()) if split else (0, 1)
    assert verify_checkpoint(path, rank, world) == []
    seconds = time.perf_counter() - start
    times = [None] * dist.get_world_size()
    dist.all_gather_object(times, seconds)
    return max(times)


def worker(recipe, args) -> None:
    warnings.filterwarnings("ignore", "Detected an existing checkpoint")  # each path is saved to `repeats` times
    env = init_distributed(recipe.parallel)
    recipe.parallel.mixed_precision = resolve_precision(recipe.parallel.mixed_precision, env)
    states = training_state(recipe, env)
    group = dist.new_group(backend="gloo")  # as the Checkpointer does: async writes on a group of their own
    work = Path(args.work_dir)
    rows = []
    for mode in ("sync", "async"):  # warm-up, not counted: the first saves allocate the staging and file buffers
        for checksums in (False, True):
            timed_save(states, work / "warmup", checksums, mode, group)
    for repeat in range(args.repeats):
        for mode in ("sync", "async"):
            order = (False, True) if repeat % 2 == 0 else (True, False)
            for checksums in order:
                path = work / f"{mode}_{'crc' if checksums else 'plain'}"
                rows.append({"mode": mode, "checksums": checksums, **timed_save(states, path, checksums, mode, group)})
    verify = {split: [timed_verify(work / "sync_crc", split) for _ in range(args.repeats)] for split in (True, False)}
    if env.is_main:
        size = sum(f.stat().st_size for f in (work / "sync_crc").iterdir() if f.name.endswith(".distcp"))
        print(f"checkpoint: {size / 1e9:.2f} GB on {dist.get_world_size()} ranks; medians of {args.repeats} saves")
        print("| save | writer | training blocked | save total |")
        print("|---|---|---|---|")
        summary = {}
        for mode in ("sync", "async"):
            for checksums in (False, True):
                picked = [r for r in rows if r["mode"] == mode and r["checksums"] == checksums]
                blocked = statistics.median(r["blocked_s"] for r in picked)
                total = statistics.median(r["total_s"] for r in picked)
                summary[f"{mode}_{'crc' if checksums else 'plain'}"] = {"blocked_s": blocked, "total_s": total}
                name = "ChecksummedWriter" if checksums else "DCP FileSystemWriter"
                print(f"| {mode} | {name} | {blocked:.2f} s | {total:.2f} s |")
        for split, times in verify.items():
            how = "files split over the ranks" if split else "every rank reads every file"
            print(f"verify, {how}: {statistics.median(times):.2f} s (median of {len(times)})")
        Path(args.out).write_text(
            json.dumps(
                {
                    **args.header,
                    "bytes": size,
                    "saves": rows,
                    "summary": summary,
                    "verify_split_s": verify[True],
                    "verify_all_s": verify[False],
                },
                indent=1,
            )
        )
    close_distributed()


ARGV_ENV = "BENCH_CHECKPOINT_ARGV"  # how the workers get the arguments: torchrun's parser would take --nproc as its own


def main(argv: list[str] | None = None) -> None:
    parser = recipe_parser("benchmarks/bench_checkpoint.py", __doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--work_dir", type=str | None, help="where the checkpoints go (default: a temporary one)")
    parser.add_argument("--out", type=str, default="bench_checkpoint.json")
    if "LOCAL_RANK" in os.environ:  # a torchrun worker
        recipe, args = parse_args(parser, json.loads(os.environ[ARGV_ENV]))
        args.header = report_header(recipe, args, ("nproc", "repeats"))
        worker(recipe, args)
        return
    argv = sys.argv[1:] if argv is None else argv
    recipe, args = parse_args(parser, argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_checkpoint_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", ARGV_ENV: json.dumps([*argv, "--work_dir", str(work)])}
    try:
        proc = launch(torchrun_command([str(Path(__file__).resolve())], args.nproc), env=env)
        print(proc.stdout, end="")
        print(proc.stderr, end="", file=sys.stderr)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
