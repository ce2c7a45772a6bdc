"""What a user sees when things go wrong: a dead or hung rank, a diverging run, a full disk or a bad out_dir.

Each failure must end the run with a message that names the rank, step or directory, and leave `latest` naming a
complete, good checkpoint."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from fsdp_trainer.config import ModelConfig, OptimConfig, ParallelConfig
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import materialize, parallelize
from fsdp_trainer.model import Transformer
from fsdp_trainer.optim import build_optimizer
from fsdp_trainer.train import train_step
from tests.helpers import (
    REPO,
    read_metrics,
    run_args,
    run_distributed,
    torchrun_command,
    train_cli,
    train_command,
    train_popen,
    wait_for_step,
    worker_pids,
)

DIVERGE = {"lr": 1e30, "min_lr": 0, "warmup_steps": 0}  # weights ~1e30 after step 1


def test_nonfinite_step_stops_the_run_naming_it(tiny_data, tmp_path):
    args = run_args(tiny_data, tmp_path, optim=DIVERGE, checkpoint={"every": 1}, train={"log_every": 5})
    proc = train_cli(args, check=False)
    assert proc.returncode == 1
    assert "error: rank 0: non-finite loss or gradient norm at step 2" in proc.stderr, proc.stderr
    # Step 1 was finite and saved; nothing from step 2 on was.
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000001"]


def test_nonfinite_steps_are_skipped_and_counted(tiny_data, tmp_path):
    train_cli(run_args(tiny_data, tmp_path, optim=DIVERGE, train={"on_nonfinite": "skip", "log_every": 5}))
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [(r["step"], r["skipped_steps"]) for r in records] == [(1, 0), (5, 4), (10, 9)]  # step 1 always logged
    assert records[-1]["grad_norm"] is None  # NaN is written as JSON null


CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)


def _batch(seed: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, CFG.vocab_size, (2, 16), generator=g)
    targets = torch.randint(0, CFG.vocab_size, (2, 16), generator=g)
    return [MicroBatch(inputs, targets)]


def _nan(module, args, output):
    return output * float("nan")


def _train(batches, world_size, optimizer_name, poisoned_step=None):
    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = Transformer(CFG)
    parallelize(model, ParallelConfig(mixed_precision="fp32"), mesh)
    materialize(model, torch.device("cpu"), seed=0)
    optimizer = build_optimizer(model, OptimConfig(name=optimizer_name))
    flags = []
    for step, batch in enumerate(batches):
        # The poisoned step's final hidden states are NaN on this rank: its loss and gradients are NaN here only.
        poison = model.model.norm.register_forward_hook(_nan) if step == poisoned_step else None
        flags.append(train_step(model, optimizer, batch, lr=1e-2, grad_clip=1.0)["nonfinite"].item())
        if poison is not None:
            poison.remove()
    state = [p.to_local() for p in model.parameters()]
    state += [v.to_local() for s in optimizer.state.values() for v in s.values() if v.ndim]
    return flags, state, [s["step"].item() for s in optimizer.state.values() if "step" in s]  # AdamW's


def _skip_is_exact(rank, world_size, optimizer_name):
    # Rank 1's loss is NaN in the middle step: both ranks must skip it, and end exactly where a run without it ends.
    batches = [_batch(0), _batch(1), _batch(2)]
    flags, state, steps = _train(batches, world_size, optimizer_name, poisoned_step=1 if rank == 1 else None)
    assert flags == [False, True, False]
    _, ref_state, ref_steps = _train([batches[0], batches[2]], world_size, optimizer_name)
    assert steps == ref_steps == [2.0] * len(steps)  # the skipped step did not count for AdamW's bias correction
    for a, b in zip(state, ref_state, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optimizer_name", ["adamw", "muon"])
def test_skipped_step_leaves_weights_and_optimizer_state_untouched(optimizer_name):
    """Muon's momentum buffers and its matrices too, though their update is orthogonalized across ranks."""
    run_distributed(_skip_is_exact, optimizer_name)


def test_unwritable_out_dir_fails_before_training(tiny_data, tmp_path):
    (tmp_path / "a_file").write_text("")
    proc = train_cli(run_args(tiny_data, tmp_path / "a_file" / "run"), check=False)
    assert proc.returncode == 1
    assert (
        proc.stderr.strip() == f"error: train.out_dir={tmp_path}/a_file/run is not writable (Not a directory); "
        "choose another directory"
    )


def test_out_dir_without_room_for_a_checkpoint_fails_before_training(tiny_data, tmp_path):
    huge = {"dim": 16384, "n_layers": 400, "ffn_dim": 65536, "n_heads": 128}
    proc = train_cli(run_args(tiny_data, tmp_path, checkpoint={"every": 5}, model=huge), check=False)
    assert proc.returncode == 1
    assert "GB free, and one checkpoint of this model takes" in proc.stderr and proc.stderr.count("\n") == 1
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("async_save", [False, True])
def test_full_disk_during_save_keeps_the_previous_checkpoint(tiny_data, tmp_path, async_save):
    args = run_args(tiny_data, tmp_path, checkpoint={"every": 4, "async_save": async_save})
    train_cli([*args, "--train.steps", "4"])
    # Resume with files capped at 256 KiB: run files fit, the step-8 shards do not (EFBIG, as ENOSPC would).
    cmd = train_command([*args, "--train.steps", "8"])
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY)),
    )
    assert proc.returncode == 1
    ckpts = tmp_path / "checkpoints"
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: rank 0: saving checkpoint {ckpts}/step_00000008 failed (rank 0: OSError: [Errno 27] File too large); "
        f"{ckpts}/latest still names step_00000004"
    )
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000004"]  # the partial step 8 is gone


def _error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("error: rank")]


@pytest.mark.slow
def test_rank_that_exits_early_is_named_by_its_peer(tiny_data, tmp_path):
    script = str(REPO / "tests" / "helpers" / "exit_early.py")
    cmd = torchrun_command([script, *run_args(tiny_data, tmp_path, parallel={"timeout_s": 60})], nproc=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EXIT_STEP": "3", "EXIT_RANK": "1"}
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60  # a closed connection fails at once, long before the timeout
    [line] = _error_lines(proc.stderr)
    assert line.startswith("error: rank 0: ") and line.endswith(
        "rank 1 reported no failure of its own: it exited or hangs, look there first"
    ), line


@pytest.mark.slow
def test_hung_rank_fails_its_peer_after_the_timeout(tiny_data, tmp_path):
    log = tmp_path / "log.txt"
    args = run_args(tiny_data, tmp_path, 100000, parallel={"timeout_s": 10})
    proc = train_popen(args, log)
    stopped = []
    try:
        wait_for_step(tmp_path, 2, proc, log)
        rank1 = sorted(worker_pids(proc.pid))[1]  # started second: local rank 1
        os.kill(rank1, signal.SIGSTOP)
        stopped.append(rank1)
        start = time.monotonic()
        # Rank 0's error line is the behaviour under test; once it is out, the stopped rank is killed rather than
        # left to torchrun, which would wait 30 s for it to answer SIGTERM.
        while not any(line.startswith("error: rank 0: ") for line in _error_lines(log.read_text())):
            assert proc.poll() is None and time.monotonic() - start < 120, log.read_text()[-3000:]
            time.sleep(0.2)
        waited = time.monotonic() - start
        os.kill(rank1, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert 10 <= waited < 90, waited
    lines = _error_lines(log.read_text())
    assert any(
        line.startswith("error: rank 0: ") and "rank 1 reported no failure of its own" in line for line in lines
    ), log.read_text()[-3000:]
