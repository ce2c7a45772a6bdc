"""What the benchmark scripts share: the torchrun command line (the tests build theirs here too), a token file of
random ids, and one trainer run under torchrun, read back from its metrics.jsonl."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from fsdp_trainer.config import fail, parse_args, recipe_parser, recipe_to_yaml
from fsdp_trainer.data.format import write_token_file
from fsdp_trainer.files import METRICS_FILE, file_sha256
from fsdp_trainer.sinks import STATE_KEYS

TRAINER = ["-m", "fsdp_trainer.train"]
BASELINE = [str(Path(__file__).with_name("baseline_loop.py"))]


def torchrun_command(
    target: list[str], nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None, flags: tuple[str, ...] = ()
) -> list[str]:
    """Run `target` (`-m module args` or `script args`) on `nproc` processes: one standalone node, or with
    `rdzv_endpoint` one of `nnodes` agents that meet through c10d rendezvous there, as a cluster's nodes do."""
    if rdzv_endpoint is None:
        launch = ["--standalone"]
    else:
        launch = [
            f"--nnodes={nnodes}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={rdzv_endpoint}",
            f"--rdzv_id=run{rdzv_endpoint.rsplit(':', 1)[-1]}",
        ]
    return [sys.executable, "-m", "torch.distributed.run", *launch, f"--nproc_per_node={nproc}", *flags, *target]


def train_command(args: list[str], nproc: int = 1) -> list[str]:
    """fsdp_trainer.train with `args`: a plain `python -m` process for one, torchrun for more."""
    if nproc == 1:
        return [sys.executable, *TRAINER, *args]
    return torchrun_command([*TRAINER, *args], nproc)


def synthetic_data(tmp: Path, vocab_size: int, n_tokens: int) -> tuple[str, str]:
    """A token file of uniform random ids, and a stand-in tokenizer file whose hash the token file's meta names."""
    tokenizer = tmp / "synthetic.tokenizer"
    tokenizer.write_bytes(b"synthetic tokens: no tokenizer\n")
    tokens = np.random.default_rng(0).integers(0, vocab_size, n_tokens)
    write_token_file(tmp / "train.bin", tokens, vocab_size, file_sha256(tokenizer))
    return str(tmp / "train.bin"), str(tokenizer)


def job_inputs(recipe, tmp: Path, nproc: int, steps: int) -> tuple[str, int, tuple[str, str]]:
    """What a benchmark's jobs share: the recipe written to `tmp`, the tokens of one optimizer step over `nproc`
    ranks, and random token data for 4 x `steps` steps (with its stand-in tokenizer)."""
    recipe_path = tmp / "recipe.yaml"
    recipe_path.write_text(recipe_to_yaml(recipe))
    data = recipe.data
    tokens_per_step = data.micro_batch_size * data.seq_len * data.grad_accum_steps * nproc
    return (
        str(recipe_path),
        tokens_per_step,
        synthetic_data(tmp, recipe.model.vocab_size, 4 * steps * tokens_per_step + 1),
    )


def report_header(recipe, args, names: tuple[str, ...]) -> dict:
    """What a benchmark's JSON output opens with: its own arguments and the resolved recipe it ran."""
    return {"args": {name: args[name] for name in names}, "recipe": recipe_to_yaml(recipe)}


def launch(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a job's command line (torchrun's, or `python ...`) to its end, its output captured: every benchmark starts
    its jobs here, so that the tests can start them otherwise (forked from a process that imported torch already)."""
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def run(cmd: list[str]) -> str:
    """Run a benchmark job and return its output; if it fails, exit naming it, with the end of its output."""
    proc = launch(cmd)
    if proc.returncode:
        sys.exit(
            f"error: {' '.join(cmd[:8])} ... exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    return proc.stdout + proc.stderr


def run_ours(
    recipe_path,
    train_path,
    tokenizer_path,
    nproc,
    steps,
    log_every,
    tokens_per_step,
    tmp: Path,
    flags=(),
    keep_log: bool = False,
) -> dict:
    """Train under torchrun (`flags` override the recipe) for a warmup of `log_every` steps and `steps` measured
    ones, and read throughput, peak memory and the training state per rank from the run's metrics.jsonl."""
    out = tmp / "ours_run"
    args = [
        "--recipe",
        recipe_path,
        "--data.train_path",
        train_path,
        "--data.val_path",
        "null",
        "--data.tokenizer_path",
        tokenizer_path,
        "--train.steps",
        str(log_every + steps),
        "--train.log_every",
        str(log_every),
        "--train.eval_every",
        "0",
        "--checkpoint.every",
        "0",
        "--checkpoint.resume",
        "none",
        "--train.out_dir",
        str(out),
        *flags,
    ]
    log = run(torchrun_command([*TRAINER, *args], nproc))
    records = [json.loads(line) for line in open(out / METRICS_FILE)]
    lines = [r for r in records if "loss" in r and r["step"] >= log_every]  # (step 1 is always logged too)
    first, last = lines[0], lines[-1]  # logged after the warmup steps, and after the last step
    elapsed = last["elapsed_s"] - first["elapsed_s"]
    state = next(r for r in records if "state_gb" in r)
    tokens = (last["step"] - first["step"]) * tokens_per_step
    measured = lines[1:]  # the log windows after the warmup's
    return {
        "tokens_per_s": tokens / elapsed,
        "tokens_per_cpu_s": tokens / (last["cpu_s"] - first["cpu_s"]),
        "peak_mem_gb": max(r["peak_mem_gb"] for r in lines),
        **({"peak_host_mem_gb": max(r["peak_host_mem_gb"] for r in lines)} if "peak_host_mem_gb" in last else {}),
        "mfu": last["mfu"],
        "loss": last["loss"],
        # A window logs its median step time; the median of those is the run's within a step or two.
        "step_time_s": statistics.median(r["step_time_s"] for r in measured),
        "step_time_max_s": max(r["step_time_max_s"] for r in measured),
        **{k: state[k] for k in (*STATE_KEYS, "state_gb")},
        **({"log": log} if keep_log else {}),  # the trainer's output (its checkpoint lines, say)
    }


def run_baseline(recipe_path, train_path, nproc, steps, warmup, tmp: Path) -> dict:
    """The hand-written loop (baseline_loop.py) under torchrun on the same recipe and data; its JSON result."""
    out = tmp / "baseline.json"
    args = [
        "--recipe",
        recipe_path,
        "--data.train_path",
        train_path,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--out",
        str(out),
    ]
    run(torchrun_command([*BASELINE, *args], nproc))
    return json.loads(out.read_text())


def parse_kinds_args(name: str, doc: str, kinds, default: list[str], out: str, argv: list[str] | None = None):
    """(recipe, args) of a benchmark that runs one training job per --kinds entry, in that order (bench_lora,
    bench_dpo): --nproc, --steps (>= 3: the first is a warmup), --kinds among `kinds`, --out; a bad one is one line."""
    parser = recipe_parser(name, doc)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--kinds", nargs="+", default=default)
    parser.add_argument("--out", default=out)
    recipe, args = parse_args(parser, argv)
    if args.steps < 3:
        fail("--steps must be >= 3 (the first step is the warmup)")
    unknown = sorted(set(args.kinds) - set(kinds))
    if unknown:
        fail(f"--kinds: {unknown} are not among {', '.join(kinds)}")
    return recipe, args


def nearest_run(rows: list[dict], i: int, kind: str) -> dict | None:
    """The row of `kind` that ran nearest to row i (a ratio's baseline, alternating orders), None if none ran."""
    runs = [j for j, row in enumerate(rows) if row["kind"] == kind]
    return rows[min(runs, key=lambda j: abs(j - i))] if runs else None


def write_rows(out: str, args, rows: list[dict]) -> None:
    """A benchmark's rows as JSON at `out`, with the CPU capability and the arguments it ran with."""
    import torch

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    header = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "args": vars(args)}
    Path(out).write_text(json.dumps({**header, "rows": rows}, indent=1))


def on_two_ranks(fn, *args) -> dict:
    """fn(rank, world, *args) on 2 gloo processes spawned here (a file rendezvous); what rank 0's returns."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_ranked, args=(2, os.path.join(d, "pg"), fn, args, out), nprocs=2)
        return dict(out)


def _ranked(rank: int, world: int, init: str, fn, args: tuple, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        found = fn(rank, world, *args)
        if rank == 0:
            out.update(found)
    finally:
        dist.destroy_process_group()
