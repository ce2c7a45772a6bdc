"""A chain of runs keeps what its later runs stand on: a run that starts from, references or learns from another run's
checkpoint holds it, that run's keep_last never deletes it and says which run holds it, and a released hold lets
rotation delete it at the next save."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest

from fsdp_trainer.checkpoint.checkpointer import prune
from fsdp_trainer.checkpoint.holds import all_holds, hold, reading, release, step_holds
from fsdp_trainer.checkpoint.storage import CheckpointError, publish_latest
from tests.conftest import PAIRS_SEQ_LEN
from tests.helpers import run_args, tool, train_cli

LORA = {"rank": 4, "alpha": 8}


def _steps(run) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("step_*"))


def test_lora_sft_then_lora_dpo_then_sft_past_keep_last_keeps_the_dpo_base(tiny_data, pairs, tmp_path):
    sft, dpo = tmp_path / "sft", tmp_path / "dpo"
    every = {"every": 1, "keep_last": 2}
    sft_args = lambda steps: run_args(tiny_data, sft, steps, lora=LORA, checkpoint=every, optim={"lr": 3e-2})  # noqa: E731
    train_cli(sft_args(2))
    base = sft / "checkpoints" / "step_00000002"
    dpo_data = {"train_path": pairs / "train.bin", "val_path": pairs / "val.bin", "seq_len": PAIRS_SEQ_LEN}
    dpo_args = lambda steps, resume: run_args(  # noqa: E731
        tiny_data, dpo, steps, lora=LORA, preference={"loss": "sigmoid"}, model={"max_seq_len": PAIRS_SEQ_LEN},
        data=dpo_data, checkpoint={"every": 1, "resume": resume},
    )  # fmt: skip
    train_cli(dpo_args(1, base))
    [held] = step_holds(base)
    assert held.run == dpo.resolve() and held.uses == ["lora base"] and not held.stale

    # The SFT run continued past keep_last: step 1 goes, step 2 stays, and the line says who holds it, once.
    proc = train_cli(sft_args(4))
    log = proc.stdout + proc.stderr
    assert _steps(sft) == ["step_00000002", "step_00000003", "step_00000004"]
    line = f"checkpoint.keep_last=2 kept {base}: run {dpo.resolve()} (its lora base) depends on it"
    assert log.count(line) == 1, log[-3000:]
    assert f"tools/verify_checkpoint.py {sft} --release {dpo.resolve()}" in log
    listing = tool("verify_checkpoint.py", sft).stdout
    assert f"step_00000002  held by {dpo.resolve()} (its lora base)" in listing, listing

    # A run starting afresh in the SFT run's directory would save over the held step: refused before any worker.
    fresh = train_cli([*sft_args(2), "--checkpoint.resume", "none"], check=False)
    assert fresh.returncode == 1 and fresh.stderr.strip().splitlines() == [
        f"error: train.out_dir={sft} holds checkpoints other runs depend on (step_00000002: run {dpo.resolve()} (its "
        "lora base)), which a run starting afresh there would overwrite; choose another train.out_dir, or release them "
        f"(`python tools/verify_checkpoint.py {sft} --release RUN`)"
    ], fresh.stderr
    # The DPO run exports and resumes from the base it stands on.
    tool("consolidate.py", dpo, tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    assert not all_holds(dpo / "checkpoints")  # the tool held the step it read only while it read it
    assert "resumed from" in train_cli(dpo_args(2, "auto")).stdout
    assert [h.uses for h in step_holds(base)] == [["lora base"]]  # held again on resume, not twice

    # Released, the base goes at the SFT run's next save.
    out = tool("verify_checkpoint.py", sft, "--release", dpo).stdout
    assert f"step_00000002  released: {dpo.resolve()} (its lora base)" in out, out
    train_cli(sft_args(5))
    assert _steps(sft) == ["step_00000004", "step_00000005"]
    assert not (sft / "checkpoints" / "holds" / "step_00000002").exists()


def _step(run, n: int):
    step = run / "checkpoints" / f"step_{n:08d}"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    return step


def test_a_deleted_holder_keeps_its_hold_shown_stale_until_released_in_one_command(tmp_path):
    """Deleting a dependent run releases nothing by accident: its hold is shown stale, and `--release stale` drops
    every such hold while the live ones stay."""
    source = _step(tmp_path / "sft", 3)
    gone, live = tmp_path / "gone", tmp_path / "live"
    gone.mkdir()
    live.mkdir()
    hold(gone, source, ["reference"])
    hold(live, source, ["teacher"])
    hold(live, source, ["teacher", "start"])  # made again on a resume, with a use it lacked
    shutil.rmtree(gone)
    holds = {h.run.name: h for h in all_holds(tmp_path / "sft" / "checkpoints")}
    assert holds["gone"].stale and "stale: " in holds["gone"].describe()
    assert not holds["live"].stale and holds["live"].uses == ["teacher", "start"]
    listing = tool("verify_checkpoint.py", tmp_path / "sft", check=False).stdout  # an empty .metadata: refused
    assert f"held by {gone.resolve()} (its reference; stale: {gone.resolve()} is gone)" in listing, listing
    assert [h.run.name for h in release(tmp_path / "sft" / "checkpoints", "stale")] == ["gone"]
    assert [h.run.name for h in step_holds(source)] == ["live"]
    record = json.loads(step_holds(source)[0].file.read_text())
    assert record["run"] == str(live.resolve())


def test_a_run_does_not_hold_its_own_steps_and_a_step_gone_as_it_starts_is_said(tmp_path):
    own = _step(tmp_path / "run", 1)
    hold(tmp_path / "run", own, ["resume"])
    assert not (tmp_path / "run" / "checkpoints" / "holds").exists()
    missing = tmp_path / "other" / "checkpoints" / "step_00000001"
    with pytest.raises(CheckpointError, match="was deleted as this run started"):
        hold(tmp_path / "run", missing, ["start"])


def test_a_tool_holds_the_step_it_reads_while_it_reads_it_and_a_killed_tool_holds_nothing(tmp_path, caplog):
    """consolidate / evaluate / generate / score on a run that is still training: the step `latest` named when the tool
    started is not rotated away under it; once the tool ends (or is killed) the next save deletes it."""
    run, ckpts, said = tmp_path / "sft", tmp_path / "sft" / "checkpoints", set()
    _step(run, 1)
    publish_latest(ckpts, "step_00000001")
    with reading(run, "tools/consolidate.py") as step:
        assert step == (ckpts / "step_00000001").resolve()
        _step(run, 2)
        publish_latest(ckpts, "step_00000002")  # the run saved on; keep_last=1 would delete step 1
        prune(ckpts, 1, said)
        assert step.is_dir()
        [held] = step_holds(step)
        assert held.reader.startswith("tools/consolidate.py (pid ") and held.run is None and not held.stale
        assert f"kept {step}: tools/consolidate.py (pid " in caplog.text
        listing = tool("verify_checkpoint.py", run, check=False).stdout
        assert "step_00000001  held by tools/consolidate.py (pid " in listing, listing
    assert not step_holds(step)
    prune(ckpts, 1, said)
    assert not step.exists() and not (ckpts / "holds" / step.name).exists()
    with reading(tmp_path / "hf_model", "tools/generate.py") as path:  # not a checkpoint of ours: read as it is
        assert path == tmp_path / "hf_model"

    # A reader killed mid-read: its hold names a process that has ended, and the next save does not count it.
    _step(run, 3)
    publish_latest(ckpts, "step_00000003")
    holding = "import sys, time; from fsdp_trainer.checkpoint.holds import reading\n"
    holding += "with reading(sys.argv[1], 'tools/evaluate.py'):\n    print('held', flush=True); time.sleep(600)"
    reader = subprocess.Popen([sys.executable, "-c", holding, str(run)], stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline() == "held\n"
    _step(run, 4)
    publish_latest(ckpts, "step_00000004")
    prune(ckpts, 1, said)
    assert (ckpts / "step_00000003").is_dir()  # alive: kept
    reader.kill()
    reader.wait()
    [stale] = (ckpts / "holds" / "step_00000003").iterdir()
    assert stale.name == f"reader-{reader.pid}@{socket.gethostname()}.json"
    prune(ckpts, 1, said)
    assert not (ckpts / "step_00000003").exists() and not (ckpts / "holds" / "step_00000003").exists()
