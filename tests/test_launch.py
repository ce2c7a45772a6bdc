"""fsdp-train, the launcher: bad input stops before any worker exists, a worker's failure is one line and its exit
code, and SIGTERM is a clean stop (a checkpoint, exit 0), where plain torchrun prints pages and exits 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_trainer.checkpoint import verify_checkpoint
from fsdp_trainer.launch import child_pids, split_argv
from tests.helpers import REPO, run_args, train_cli, train_popen, wait_for_step, worker_pids

LAUNCHER = [sys.executable, "-m", "fsdp_trainer.launch"]


def _launch(args: list[str], log: Path, nproc: int = 2) -> subprocess.Popen:
    """fsdp-train in the background; stdout to `log`, stderr to log.with_suffix('.err')."""
    return subprocess.Popen(
        [*LAUNCHER, "--nproc_per_node", str(nproc), *args],
        stdout=open(log, "w"),
        stderr=open(log.with_suffix(".err"), "w"),
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_torchrun_options_and_the_trainers_flags_are_told_apart():
    launcher, trainer = split_argv(
        ["--nproc_per_node", "2", "--recipe", "r.yaml", "--nnodes=1", "--train.steps", "6", "--max-restarts", "1",
         "--standalone", "--optim.betas", "[0.9,0.95]"]
    )  # fmt: skip
    assert launcher == ["--nproc_per_node", "2", "--nnodes=1", "--max-restarts", "1", "--standalone"]
    assert trainer == ["--recipe", "r.yaml", "--train.steps", "6", "--optim.betas", "[0.9,0.95]"]
    # torchrun's parser would take --start as a prefix of --start-method and die; here it is the trainer's.
    assert split_argv(["--start", "6"]) == ([], ["--start", "6"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.n_kv_heads", "3"], "error: model.n_kv_heads=3 must divide model.n_heads=4"),
        (["--data.train_path", "/nonexistent/train.bin"], "error: token file /nonexistent/train.bin"),
        (["--checkpoint.resume", "/nonexistent/run"], "error: checkpoint /nonexistent/run does not exist"),
        (["-m", "other.module"], "error: fsdp-train runs fsdp_trainer.train itself; drop -m"),
    ],
)
def test_bad_input_is_one_line_before_any_worker_starts(tiny_data, tmp_path, flags, message):
    script = Path(sys.executable).with_name("fsdp-train")  # the console script `pip install -e .` made
    command = [str(script)] if script.exists() else LAUNCHER
    proc = subprocess.run(
        [*command, "--nproc_per_node", "2", *run_args(tiny_data, tmp_path / "run"), *flags],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert message in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no worker ran


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_a_checkpoint_and_exits_0(tiny_data, tmp_path):
    out, log = tmp_path / "run", tmp_path / "log.txt"
    proc = _launch(run_args(tiny_data, out, 100_000), log)
    wait_for_step(out, 3, proc, log)
    proc.send_signal(signal.SIGTERM)  # to the launcher alone, as Kubernetes sends it
    assert proc.wait(timeout=120) == 0
    assert log.with_suffix(".err").read_text() == ""  # no traceback, no summary
    assert "SIGTERM: saving step" in log.read_text()
    step = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert verify_checkpoint(step) == []


@pytest.mark.slow
def test_a_worker_killed_by_a_signal_is_one_line_and_the_shells_exit_code(tiny_data, tmp_path):
    out, log = tmp_path / "run", tmp_path / "log.txt"
    proc = _launch(run_args(tiny_data, out, 100_000), log)
    wait_for_step(out, 2, proc, log)
    workers = child_pids(proc.pid)
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGKILL)  # as the OOM killer would
    assert proc.wait(timeout=120) == 128 + signal.SIGKILL
    (line,) = log.with_suffix(".err").read_text().strip().splitlines()
    assert line.startswith("error: rank ") and f"(pid {max(workers)}) was killed by SIGKILL" in line


@pytest.mark.slow
def test_a_failure_every_worker_finds_is_one_line_per_node_and_exit_1(tiny_data, tmp_path):
    """A checkpoint of another model shape: found by every rank after the process group exists, said once."""
    train_cli(run_args(tiny_data, tmp_path / "small", 1, checkpoint={"every": 1}))
    log = tmp_path / "log.txt"
    other_shape = run_args(
        tiny_data, tmp_path / "run", 2, model={"ffn_dim": 96}, checkpoint={"resume": tmp_path / "small"}
    )
    proc = _launch(other_shape, log)
    assert proc.wait(timeout=120) == 1
    (line,) = log.with_suffix(".err").read_text().strip().splitlines()
    assert (
        line.startswith("error: rank 0: checkpoint ")
        and "of shape (128, 64) but the recipe's model has (96, 64)" in line
    )


@pytest.mark.slow
def test_workers_die_with_a_killed_launcher_and_the_next_run_resumes(tiny_data, tmp_path):
    """SIGKILL of torchrun alone (not its group: each worker has a session of its own): the workers are gone within
    seconds instead of training on beside the next attempt; `latest` names a complete checkpoint, which resumes."""
    out, log = tmp_path / "run", tmp_path / "log.txt"
    proc = train_popen(run_args(tiny_data, out, 100_000, checkpoint={"every": 1}), log)
    wait_for_step(out, 3, proc, log)
    workers = worker_pids(proc.pid)
    assert len(workers) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30  # the kernel's signal is immediate; this only bounds a broken test
    while any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in workers), "workers outlived torchrun"
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert verify_checkpoint(latest) == []
    stopped_at = int(latest.name.removeprefix("step_"))
    again = train_cli(run_args(tiny_data, out, stopped_at + 2, checkpoint={"every": 1}), nproc=2)
    assert f"resumed from {latest}" in again.stdout


def _alive(pid: int) -> bool:
    """Not a zombie (a dead child its reaper has not collected yet counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
