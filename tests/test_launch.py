"""fsdp-train, the launcher: bad input stops before any worker exists, a worker's failure is one line and its exit
code, and SIGTERM is a clean stop (a checkpoint, exit 0), where plain torchrun prints pages and exits 1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_trainer.checkpoint.verify import verify_checkpoint
from fsdp_trainer.launch import child_pids, split_argv
from tests.helpers import REPO, forked, injected, run_args, train_cli, train_popen, wait_for_step, worker_pids


def _launch(args: list[str], log: Path, nproc: int = 2, env: dict | None = None) -> forked.Started:
    """fsdp-train in the background (forked; torchrun's workers new interpreters, as it starts them); stdout to `log`,
    stderr to log.with_suffix('.err'), `env` added to this process's."""
    files = [(str(log), str(log.with_suffix(".err")))]
    return forked.start("fsdp_trainer.launch", ["--nproc_per_node", str(nproc), *map(str, args)], files, env)


def test_torchrun_options_and_the_trainers_flags_are_told_apart():
    launcher, trainer = split_argv(
        ["--nproc_per_node", "2", "--recipe", "r.yaml", "--nnodes=1", "--train.steps", "6", "--max-restarts", "1",
         "--standalone", "--optim.betas", "[0.9,0.95]"]
    )  # fmt: skip
    assert launcher == ["--nproc_per_node", "2", "--nnodes=1", "--max-restarts", "1", "--standalone"]
    assert trainer == ["--recipe", "r.yaml", "--train.steps", "6", "--optim.betas", "[0.9,0.95]"]
    # torchrun's parser would take --start as a prefix of --start-method and die; here it is the trainer's.
    assert split_argv(["--start", "6"]) == ([], ["--start", "6"])


def test_rendezvous_events_are_named_as_torchrun_names_them(monkeypatch):
    """fsdp-train names torchrun's rendezvous events from the frame (launch.name_rendezvous_events_cheaply): the
    method that recorded one, as torch's own function finds with inspect.stack(); past the stack, no name."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from fsdp_trainer.launch import name_rendezvous_events_cheaply

    def next_rendezvous():  # a method that records an event: _record asks for the name of its caller
        def _record():
            return dynamic_rendezvous.get_method_name(), dynamic_rendezvous.get_method_name(10_000)

        return _record()

    torchs = dynamic_rendezvous.get_method_name
    assert torchs.__module__ == dynamic_rendezvous.__name__  # what a torch upgrade renames leaves nothing patched
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", torchs)  # torch's again after the test
    expected = next_rendezvous()
    name_rendezvous_events_cheaply()
    assert dynamic_rendezvous.get_method_name is not torchs
    assert next_rendezvous() == expected == ("next_rendezvous", "no_method_name")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.n_kv_heads", "3"], "error: model.n_kv_heads=3 must divide model.n_heads=4"),
        (["--data.train_path", "/nonexistent/train.bin"], "error: token file /nonexistent/train.bin"),
        (
            ["--checkpoint.resume", "/nonexistent/run"],
            "error: checkpoint.resume: checkpoint /nonexistent/run does not exist",
        ),
        (["-m", "other.module"], "error: fsdp-train runs fsdp_trainer.train itself; drop -m"),
        (
            ["--parallel.context_parallel", "4"],
            "error: parallel.context_parallel=4 needs the world size (2) to be a multiple of it",
        ),
    ],
)
def test_bad_input_is_one_line_before_any_worker_starts(tiny_data, tmp_path, flags, message):
    """The console script `pip install -e .` made, for the first case; the launcher's module forked (the same
    code, without an interpreter's start) for the others."""
    args = ["--nproc_per_node", "2", *run_args(tiny_data, tmp_path / "run"), *flags]
    script = Path(sys.executable).with_name("fsdp-train")
    if flags[0] == "--model.n_kv_heads" and script.exists():
        proc = subprocess.run([str(script), *args], capture_output=True, text=True, cwd=REPO, timeout=900)
    else:
        proc = forked.run("fsdp_trainer.launch", args)
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert message in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no worker ran


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_a_checkpoint_and_exits_0(tiny_data, tmp_path):
    """The workers forked (forked.forked_workers: what they get is the signal, not who they are)."""
    out, log = tmp_path / "run", tmp_path / "log.txt"
    proc = _launch(run_args(tiny_data, out, 100_000), log, env=forked.forked_workers())
    wait_for_step(out, 3, proc, log)
    proc.send_signal(signal.SIGTERM)  # to the launcher alone, as Kubernetes sends it
    assert proc.wait(timeout=900) == 0
    assert log.with_suffix(".err").read_text() == ""  # no traceback, no summary
    assert "SIGTERM: saving step" in log.read_text()
    step = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert verify_checkpoint(step) == []


@pytest.mark.slow
def test_a_worker_killed_by_a_signal_is_one_line_and_the_shells_exit_code(tiny_data, tmp_path):
    out, log = tmp_path / "run", tmp_path / "log.txt"
    proc = _launch(run_args(tiny_data, out, 100_000), log)
    wait_for_step(out, 2, proc, log)
    workers = child_pids(proc.pids[0])
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGKILL)  # as the OOM killer would
    assert proc.wait(timeout=900) == 128 + signal.SIGKILL
    line, *after = log.with_suffix(".err").read_text().strip().splitlines()
    assert line.startswith("error: rank 1 ") and f"(pid {max(workers)}) was killed by SIGKILL" in line
    assert after in ([], ["rank 0 stopped because rank 1 failed"]), after  # not the survivor's gloo error


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "code", "first"),
    [
        ("raise", 1, "error: rank 1: RuntimeError: injected failure"),
        ("exit", 3, "error: rank 1 (pid "),
    ],
)
def test_the_first_line_names_the_rank_that_failed_and_why(tiny_data, tmp_path, how, code, first):
    """Rank 1 raises (its own line first, its traceback after, rank 0's broken collective folded into one line) or
    exits with 3 saying nothing (named, with its code, and the launcher exits with it)."""
    log = tmp_path / "log.txt"
    proc = _launch(run_args(tiny_data, tmp_path / "run", 20), log, env=injected(how, rank=1, step=3))
    assert proc.wait(timeout=900) == code
    lines = log.with_suffix(".err").read_text().strip().splitlines()
    assert lines[0].startswith(first), lines
    if how == "exit":
        assert "exited with code 3 without an error line" in lines[0]
    assert [line for line in lines if line.startswith("error:")] == lines[:1], lines
    assert lines[-1] == "rank 0 stopped because rank 1 failed" or how == "exit" or lines[-1].startswith("RuntimeError")


@pytest.mark.slow
def test_a_failure_every_worker_finds_is_one_line_per_node_and_exit_1(tiny_data, tmp_path):
    """A checkpoint of another model shape is refused before any worker starts, with the keys that fix the recipe; a
    corrupted one is found by every rank after the process group exists, and said once."""
    train_cli(run_args(tiny_data, tmp_path / "small", 1, checkpoint={"every": 1}))
    log = tmp_path / "log.txt"
    resume = {"resume": tmp_path / "small"}
    other_shape = run_args(tiny_data, tmp_path / "run", 2, model={"ffn_dim": 96, "rope_theta": 5e5}, checkpoint=resume)
    proc = forked.run("fsdp_trainer.launch", ["--nproc_per_node", "2", *other_shape])
    assert proc.returncode == 1 and proc.stdout == ""  # no worker started: it would say so
    (line,) = proc.stderr.strip().splitlines()
    assert line == (
        f"error: checkpoint.resume: checkpoint {tmp_path / 'small' / 'checkpoints' / 'step_00000001'} holds "
        "model.layers.0.mlp.gate_proj.weight of shape (128, 64) but the recipe's model has (96, 64): the recipe's "
        "model section differs from the run that saved it; give the recipe the model it was saved with: "
        "--model.ffn_dim 128 --model.rope_theta 10000.0"
    )
    shard = next((tmp_path / "small" / "checkpoints" / "step_00000001").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped bit: the same size, another checksum
    shard.write_bytes(bytes(data))
    proc = _launch(run_args(tiny_data, tmp_path / "run", 2, checkpoint=resume), log)
    assert proc.wait(timeout=900) == 1
    (line,) = log.with_suffix(".err").read_text().strip().splitlines()
    assert line.startswith("error: rank 0: checkpoint ") and "is corrupted" in line and shard.name in line, line
    assert not (tmp_path / "run").exists()  # a run refused as it started leaves no empty run.lock behind


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 30  # the kernel's signal is immediate; this only bounds a broken test
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids), "workers outlived torchrun"


@pytest.mark.slow
def test_a_second_run_on_a_live_runs_directory_is_refused_and_a_killed_launchers_run_needs_no_clean_up(
    tiny_data, tmp_path
):
    """While a run trains, another on its out_dir (one process, torchrun, or fsdp-train before it spawns anything)
    exits 1 with one line naming the holder and writes nothing. SIGKILL of torchrun alone (not its group: each worker
    has a session of its own): the workers are gone within seconds instead of training on beside the next attempt,
    `latest` names a complete checkpoint, and the next run takes the lock over and resumes from it."""
    out, log = tmp_path / "run", tmp_path / "log.txt"
    args = run_args(tiny_data, out, 100_000, checkpoint={"every": 1})
    proc = train_popen(args, log)
    try:
        wait_for_step(out, 2, proc, log)
        workers = sorted(worker_pids(proc.pids[0]))
        assert len(workers) == 2
        config = (out / "config.yaml").read_bytes()
        holder = f"train.out_dir={out} is in use by a live run (pid {workers[0]} on host {socket.gethostname()}"
        # one process (forked, as `python -m` runs it) and torchrun's two workers, whose own report follows our line
        for nproc, torchrun in ((1, False), (2, True)):
            second = train_cli(args, nproc=nproc, check=False, torchrun=torchrun)
            assert second.returncode == 1, second.stderr
            (line, *torchruns) = second.stderr.strip().splitlines()
            assert line.startswith("error: ") and holder in line and second.stderr.count(holder) == 1, line
            assert torchrun or not torchruns
        launcher = forked.run("fsdp_trainer.launch", ["--nproc_per_node", "2", *args])  # refuses before a worker
        assert launcher.returncode == 1 and launcher.stderr.startswith(f"error: {holder}"), launcher.stderr
        assert launcher.stderr.count("\n") == 1
        assert (out / "config.yaml").read_bytes() == config  # the refused runs wrote nothing
    finally:
        proc.kill()
        proc.wait()
    _wait_gone(workers)
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert verify_checkpoint(latest) == []
    stopped_at = int(latest.name.removeprefix("step_"))
    again = train_cli(run_args(tiny_data, out, stopped_at + 1, checkpoint={"every": 1}), nproc=2)
    assert f"from a run that ended without releasing it (pid {workers[0]} on host" in again.stdout, again.stdout
    assert f"resumed from {latest}" in again.stdout
    assert (out / "run.lock").read_text() == ""  # released at the end of a clean run


def _alive(pid: int) -> bool:
    """Not a zombie (a dead child its reaper has not collected yet counts as gone)."""
    try:  # a pid that is gone raises here
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_where_the_kernel_sends_no_parent_death_signal_a_watchdog_ends_the_worker(tmp_path):
    """The fallback off Linux, run here: a parent starts a child that watches it; SIGKILL the parent, the child is
    gone within a few polls."""
    child = (
        "import time; from fsdp_trainer.distributed.runtime import watch_launcher; import os; "
        "watch_launcher(os.getppid(), every_s=0.05); print('watching', flush=True); time.sleep(120)"
    )
    parent = (
        f"import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', {child!r}]); "
        "print(child.pid, flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, cwd=REPO)
    child_pid = int(proc.stdout.readline())
    assert proc.stdout.readline() == "watching\n" and _alive(child_pid)
    proc.kill()
    proc.wait()
    _wait_gone([child_pid])


def test_the_cause_comes_first_whatever_order_the_reports_came_in():
    """failure_lines on torchrun's failures and the workers' reports, without processes: a death by a signal before
    any report; an error every rank found once, from the lowest rank; a hang (only consequential reports) as said."""
    from types import SimpleNamespace

    from fsdp_trainer.launch import failure_lines

    def failure(pid, code):
        return SimpleNamespace(pid=pid, exitcode=code)

    def report(rank, time, line, consequential=False, everyone=False):
        return {"rank": rank, "time": time, "line": line, "consequential": consequential, "everyone": everyone,
                "details": ""}  # fmt: skip

    gloo = "error: rank 0: DistBackendError: Connection closed by peer"
    lines, code = failure_lines(
        {0: failure(10, 1), 1: failure(11, -signal.SIGKILL), 2: failure(12, -signal.SIGTERM)},
        {0: report(0, 1.0, gloo, consequential=True)},
    )
    assert lines[0].startswith("error: rank 1 (pid 11) was killed by SIGKILL") and code == 128 + signal.SIGKILL
    assert lines[1:] == ["rank 0 stopped because rank 1 failed"]  # rank 2, stopped by torchrun, says nothing

    shape = "error: rank {}: checkpoint of another shape"
    lines, code = failure_lines(
        {0: failure(10, 1), 1: failure(11, 1)},
        {1: report(1, 1.0, shape.format(1), everyone=True), 0: report(0, 2.0, shape.format(0), everyone=True)},
    )
    assert (lines, code) == ([shape.format(0)], 1)

    hung = [report(1, 2.0, "error: rank 1: timed out", True), report(0, 1.0, "error: rank 0: timed out", True)]
    lines, code = failure_lines({0: failure(10, 1), 1: failure(11, 1)}, {r["rank"]: r for r in hung})
    assert (lines, code) == (["error: rank 0: timed out", "error: rank 1: timed out"], 1)
