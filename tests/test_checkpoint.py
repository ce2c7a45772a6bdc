"""Checkpoints through real 2-rank runs: exact resume, resume on another world size / sharding, `latest`, errors."""

from __future__ import annotations

import json
import pickle
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_trainer.checkpoint.storage import CHECKSUMS_FILE, RECIPE_FILE, CheckpointError, file_checksum, load_state
from fsdp_trainer.checkpoint.verify import checkpoint_status, verified_checkpoint, verify_checkpoint
from fsdp_trainer.checkpoint.weights import save_model_weights
from fsdp_trainer.config import OptimConfig
from tests.helpers import (
    injected,
    read_metrics,
    run_args,
    train_background,
    train_cli,
    train_losses,
    train_popen,
    wait_for_step,
)
from tests.helpers import tool as run_tool

# A constant learning rate, so a run cut at step 3 follows the same schedule as one planned for 6 steps.
CONSTANT_LR = {"warmup_steps": 0, "min_lr": 3e-3, "lr": 3e-3}


def _args(tiny_data, out, steps, **overrides):
    return run_args(tiny_data, out, steps, optim=CONSTANT_LR, **overrides)


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    """6 steps on 2 ranks, FULL_SHARD, fp32, checkpointing every 3 steps."""
    out = tmp_path_factory.mktemp("full")
    train_cli(_args(tiny_data, out, 6, checkpoint={"every": 3}), nproc=2)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_resume_is_bitwise_exact(tiny_data, tmp_path, uninterrupted, async_save):
    flags = {"every": 3, "async_save": async_save}
    train_cli(_args(tiny_data, tmp_path, 3, checkpoint=flags), nproc=2)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    proc = train_cli(_args(tiny_data, tmp_path, 6, checkpoint=flags), nproc=2)
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    expected, resumed = train_losses(uninterrupted), train_losses(tmp_path)
    assert resumed == expected  # steps 1-3 from the first run, 4-6 after the resume: bitwise equal
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000006"


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, overrides",
    [
        (1, {"data": {"grad_accum_steps": 2}}),  # 2 ranks -> 1 rank, accumulation doubled: same global batch
        (2, {"parallel": {"sharding": "NO_SHARD"}}),  # FULL_SHARD -> NO_SHARD
    ],
)
def test_resume_on_another_world_size_or_sharding(tiny_data, tmp_path, uninterrupted, nproc, overrides):
    shutil.copytree(uninterrupted / "checkpoints" / "step_00000003", tmp_path / "step3")
    out = tmp_path / "run"
    train_cli(_args(tiny_data, out, 6, checkpoint={"resume": tmp_path / "step3"}, **overrides), nproc=nproc)
    expected, resumed = train_losses(uninterrupted), train_losses(out)
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5)


def test_latest_and_keep_last(tiny_data, tmp_path):
    train_cli(_args(tiny_data, tmp_path, 4, checkpoint={"every": 1, "keep_last": 2}))
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000003", "step_00000004"]
    assert (ckpts / "latest").read_text().strip() == "step_00000004"
    assert (ckpts / "step_00000004" / ".metadata").is_file()
    # A run resumed at its last step has nothing left to do and changes nothing.
    train_cli(_args(tiny_data, tmp_path, 4, checkpoint={"every": 1}))
    assert (ckpts / "latest").read_text().strip() == "step_00000004"


@pytest.fixture(scope="module")
def one_step_checkpoint(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    train_cli(_args(tiny_data, out, 1, checkpoint={"every": 1}))
    return out / "checkpoints" / "step_00000001"


@pytest.mark.parametrize(
    "case, flags, message",
    [
        (
            "shape",
            {"ffn_dim": 96},
            "holds model.layers.0.mlp.gate_proj.weight of shape (128, 64) but the recipe's model has (96, 64): the "
            "recipe's model section differs from the run that saved it; give the recipe the model it was saved with: "
            "--model.ffn_dim 128",
        ),
        (
            "missing",
            {},
            "error: checkpoint.resume: checkpoint {target} does not exist (a run directory or step of ours",
        ),
        ("truncated", {}, "checkpoint.resume: {target} is not a complete DCP checkpoint (no .metadata)"),
        ("latest_dangling", {}, "step_00000009, which is missing or incomplete (no .metadata)"),
    ],
)
def test_bad_checkpoints_give_clear_errors(tiny_data, tmp_path, one_step_checkpoint, case, flags, message):
    target = tmp_path / "ckpt"
    if case != "missing":
        shutil.copytree(one_step_checkpoint, target)
    if case == "truncated":
        (target / ".metadata").unlink()
    if case == "latest_dangling":  # a run directory whose `latest` names a step that is gone
        (target / "checkpoints").mkdir()
        (target / "checkpoints" / "latest").write_text("step_00000009\n")
    args = _args(tiny_data, tmp_path / "run", 2, checkpoint={"resume": target}, model=flags)
    proc = train_cli(args, check=False)
    assert proc.returncode == 1
    # A path that holds no checkpoint is found before any process group (no rank named), the rest by every rank.
    message = message.format(target=target)
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and message in proc.stderr, proc.stderr


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_resume_continues_exactly(tiny_data, tmp_path):
    out, log = tmp_path / "run", tmp_path / "log.txt"
    proc = train_background(_args(tiny_data, out, 100_000, checkpoint={"every": 0}), log)
    wait_for_step(out, 5, proc, log)
    proc.send_signal(signal.SIGTERM)  # to every rank, as torchrun forwards it (tests/test_launch.py: fsdp-train's)
    proc.wait(timeout=900)
    assert "SIGTERM: saving step" in log.read_text()
    stopped_at = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    logged = train_losses(out)
    assert stopped_at >= 5 and max(logged) == stopped_at  # it finished the step it was in, saved it, and stopped

    train_cli(_args(tiny_data, out, stopped_at + 3), nproc=2)  # checkpoint.resume: auto
    reference = tmp_path / "reference"
    train_cli(_args(tiny_data, reference, stopped_at + 3), nproc=2)
    assert train_losses(out) == train_losses(reference)


@pytest.mark.slow
def test_killed_rank_is_restarted_by_torchrun_and_resumes(tiny_data, tmp_path, uninterrupted):
    """Rank 1 SIGKILLed in step 5 (as the OOM killer would): torchrun restarts both workers, which resume from step 3's
    checkpoint and finish as the uninterrupted run did."""
    out, log = tmp_path / "run", tmp_path / "log.txt"
    kill = injected("kill", rank=1, step=5, once=tmp_path / "killed")
    args = _args(tiny_data, out, 6, checkpoint={"every": 3})
    proc = train_popen(args, log, torchrun_flags=("--max-restarts=1",), env=kill)
    assert proc.wait(timeout=900) == 0, log.read_text()[-4000:]
    assert (tmp_path / "killed").exists() and "resumed from" in log.read_text()
    # metrics.jsonl holds step 4 twice (after the checkpoint, before the kill); the later line is the resumed run's.
    assert train_losses(out) == train_losses(uninterrupted)


@pytest.mark.slow
def test_resume_over_shards_and_a_mixture_is_exact_and_reshards(tiny_data, tmp_path):
    """The same guarantees over a mixture of the tiny corpus as one file (weight 2) and as a directory of small
    shards (weight 1, so windows cross shards), and metrics.jsonl says what each source gave."""
    data = json.loads(tiny_data.read_text())["data"]
    run_tool("prepare_data.py", "--recipe", tiny_data, "--input", tiny_data.parent / "corpus.txt", "--shard_tokens",
             5000, "--data.train_path", tmp_path / "shards", "--data.val_path", "null")  # fmt: skip
    assert len(list((tmp_path / "shards").glob("shard_*.bin"))) > 10
    mixture = json.dumps([{"path": data["train_path"], "weight": 2.0}, {"path": str(tmp_path / "shards")}])
    flags = {"data": {"mixture": mixture}, "checkpoint": {"every": 3}}
    train_cli(_args(tiny_data, tmp_path / "whole", 6, **flags), nproc=2)
    train_cli(_args(tiny_data, tmp_path / "cut", 3, **flags), nproc=2)
    train_cli(_args(tiny_data, tmp_path / "cut", 6, **flags), nproc=2)
    assert train_losses(tmp_path / "cut") == train_losses(tmp_path / "whole")  # bitwise
    one_rank = {
        "data": {"mixture": mixture, "grad_accum_steps": 2},
        "checkpoint": {"resume": tmp_path / "cut" / "checkpoints" / "step_00000003"},
    }
    train_cli(_args(tiny_data, tmp_path / "one", 6, **one_rank))
    for step, loss in train_losses(tmp_path / "one").items():
        assert loss == pytest.approx(train_losses(tmp_path / "whole")[step], rel=1e-5)
    last = [r for r in read_metrics(tmp_path / "whole") if "loss" in r][-1]
    drawn = {name: source["tokens"] for name, source in last["mixture"].items()}
    assert set(drawn) == {"train", "shards"} and all(drawn.values())
    assert sum(drawn.values()) == 6 * 4 * 32  # 6 steps of 4 sequences of 32 tokens, from one source or the other


# --- checksums: corruption is found before it is trusted --------------------------------------------------------------


def corrupt(step: Path, kind: str) -> str:
    """Damage a step directory as a bad disk or an interrupted copy would; returns the name of the damaged file."""
    name = {"metadata": ".metadata", "attachment": RECIPE_FILE}.get(kind, "__0_0.distcp")
    path = step / name
    data = bytearray(path.read_bytes())
    if kind == "deleted":
        path.unlink()
    elif kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # flipped, metadata, attachment: 4 KB (or half of a smaller file) flipped in place
        start, end = len(data) // 4, len(data) // 4 + min(4096, len(data) // 2)
        data[start:end] = bytes(b ^ 0xFF for b in data[start:end])
        path.write_bytes(data)
    return name


KINDS = {
    "flipped": "does not match its checksum",
    "truncated": "(truncated or overwritten)",
    "deleted": "is missing",
    "metadata": "does not match its checksum",
    "attachment": "does not match its checksum",
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_file_is_checked_against_its_checksum(tmp_path, kind):
    """A weights-only checkpoint (what import_hf writes) with an attachment: whatever is damaged is named."""
    state = {"w": torch.arange(50_000, dtype=torch.float32), "b": torch.ones(3)}
    step = save_model_weights(state, tmp_path / "run", {RECIPE_FILE: b"model: {dim: 8}\n" * 100})
    assert verify_checkpoint(step) == [] and checkpoint_status(step)[0] == "ok"
    files = json.loads((step / CHECKSUMS_FILE).read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", RECIPE_FILE]
    name = corrupt(step, kind)
    problems = verify_checkpoint(step)
    assert len(problems) == 1 and str(step / name) in problems[0] and KINDS[kind] in problems[0], problems
    with pytest.raises(CheckpointError, match="is corrupted: .*" + re.escape(KINDS[kind])):
        verified_checkpoint(tmp_path / "run")
    tool = run_tool("verify_checkpoint.py", tmp_path / "run", check=False)
    assert tool.returncode == 1 and f"step_00000000  corrupted   {step / name}" in tool.stdout, tool.stdout


def test_a_checkpoint_without_checksums_is_loaded_with_a_notice(tmp_path, caplog):
    step = save_model_weights({"w": torch.ones(4)}, tmp_path)
    (step / CHECKSUMS_FILE).unlink()  # as saved before checksums existed
    assert verify_checkpoint(step) is None
    assert verified_checkpoint(step) == step and "loading it unverified" in caplog.text
    tool = run_tool("verify_checkpoint.py", step, check=False)
    assert tool.returncode == 0 and "step_00000000  unverified" in tool.stdout, tool.stdout


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_resume_auto_falls_back_to_the_newest_checkpoint_that_verifies(tiny_data, tmp_path, uninterrupted, kind):
    """The newest of two checkpoints (steps 3 and 6 of a 2-rank run) is damaged: `resume: auto` says so in one line
    and resumes from step 3; with the bytes flipped (the case that trained on silently before), the whole run then
    equals the uninterrupted one. The other kinds only check the choice (a run of 3 steps has nothing left to do)."""
    shutil.copytree(uninterrupted, tmp_path / "run")
    name = corrupt(tmp_path / "run" / "checkpoints" / "step_00000006", kind)
    steps = 6 if kind == "flipped" else 3
    proc = train_cli(_args(tiny_data, tmp_path / "run", steps, checkpoint={"every": 3}), nproc=2)
    warning = f"checkpoint step_00000006 is corrupted: {tmp_path / 'run' / 'checkpoints' / 'step_00000006' / name}"
    assert proc.stdout.count(warning) == 1 and KINDS[kind] in proc.stdout, proc.stdout
    assert "resuming from step_00000003, the newest checkpoint that verifies" in proc.stdout
    assert "at step 3" in proc.stdout
    if kind == "flipped":
        assert train_losses(tmp_path / "run") == train_losses(uninterrupted)  # steps 4-6 trained again, bitwise
        verify = run_tool("verify_checkpoint.py", tmp_path / "run")
        assert "step_00000006  ok" in verify.stdout


def test_resume_auto_with_no_checkpoint_that_verifies_is_one_error_line(tiny_data, tmp_path, uninterrupted):
    shutil.copytree(uninterrupted, tmp_path / "run")
    for step in ("step_00000003", "step_00000006"):
        corrupt(tmp_path / "run" / "checkpoints" / step, "truncated")
    proc = train_cli(_args(tiny_data, tmp_path / "run", 6, checkpoint={"every": 3}), check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: rank 0: no checkpoint under {tmp_path / 'run' / 'checkpoints'} verifies")
    assert all(f"checkpoint step_0000000{step} is corrupted" in proc.stderr for step in (6, 3))
    assert "--checkpoint.resume none" in proc.stderr


def test_an_explicit_corrupted_checkpoint_is_refused_by_training_and_consolidation(
    tiny_data, tmp_path, one_step_checkpoint
):
    shutil.copytree(one_step_checkpoint, tmp_path / "ckpt")
    name = corrupt(tmp_path / "ckpt", "flipped")
    message = f"checkpoint {tmp_path / 'ckpt'} is corrupted: {tmp_path / 'ckpt' / name} does not match its checksum"
    proc = train_cli(_args(tiny_data, tmp_path / "run", 2, checkpoint={"resume": tmp_path / "ckpt"}), check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: rank 0: {message}: its bytes changed after it was saved"), proc.stderr
    proc = run_tool("consolidate.py", tmp_path / "ckpt", tmp_path / "hf", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"error: {message}: ")
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_saved_before_checksums_resumes_with_a_notice(tiny_data, tmp_path, one_step_checkpoint):
    shutil.copytree(one_step_checkpoint, tmp_path / "ckpt")
    (tmp_path / "ckpt" / CHECKSUMS_FILE).unlink()
    proc = train_cli(_args(tiny_data, tmp_path / "run", 2, checkpoint={"resume": tmp_path / "ckpt"}))
    assert proc.stdout.count("loading it unverified") == 1 and "at step 1" in proc.stdout, proc.stdout


def test_training_state_keys_stay_loadable_from_older_checkpoints():
    """DCP refuses to load a key a checkpoint lacks, so the training state of a bf16 / fp32 run has exactly the keys
    it had before fp16 existed; only fp16 adds the loss scaler's state (and its overflow count)."""
    from fsdp_trainer.optim import build_loss_scaler
    from fsdp_trainer.train import TrainState

    scalers = {p: build_loss_scaler(OptimConfig(), p, torch.device("cpu")) for p in ("bf16", "fp32", "fp16")}
    assert set(TrainState(scaler=scalers["bf16"]).state_dict()) == {"step", "skipped_steps"}
    assert set(TrainState(scaler=scalers["fp32"]).state_dict()) == {"step", "skipped_steps"}
    assert set(TrainState(scaler=scalers["fp16"]).state_dict()) == {
        "step",
        "skipped_steps",
        "overflow_steps",
        "loss_scaler",
    }


# --- a checkpoint from elsewhere runs no code -------------------------------------------------------------------------


class _CreatesAFile:
    """What a hostile pickle holds: unpickling it calls open(path, "w"), creating the file."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def _plant(step: Path, marker: Path) -> None:
    """Rewrite a step's .metadata as someone else's would be: its real content plus an object that creates `marker`
    when unpickled, with checksums.json rewritten to match (whoever wrote the file wrote those too)."""
    metadata = pickle.loads((step / ".metadata").read_bytes())
    metadata.planner_data = _CreatesAFile(marker)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = json.loads((step / CHECKSUMS_FILE).read_text())
    manifest["files"][".metadata"] = file_checksum(step / ".metadata")
    (step / CHECKSUMS_FILE).write_text(json.dumps(manifest))


def test_a_planted_metadata_is_refused_by_every_reader_and_runs_nothing(tiny_data, tmp_path, one_step_checkpoint):
    step, marker = tmp_path / "ckpt", tmp_path / "created_by_the_pickle"
    shutil.copytree(one_step_checkpoint, step)
    _plant(step, marker)
    pickle.loads((step / ".metadata").read_bytes())  # the test's own check that the planted file does run code
    assert marker.exists()
    marker.unlink()
    refusal = f"{step / '.metadata'} names io.open, which a checkpoint's metadata never holds: refused unread"
    train = train_cli(_args(tiny_data, tmp_path / "run", 2, checkpoint={"resume": step}), check=False)
    tools = {
        name: run_tool(name, step, *extra, check=False)
        for name, extra in [
            ("consolidate.py", [str(tmp_path / "hf")]),
            ("generate.py", ["--max_new_tokens", "2"]),
            ("verify_checkpoint.py", []),
        ]
    }
    for name, proc in [("train", train), *tools.items()]:
        assert proc.returncode == 1, (name, proc.stdout, proc.stderr)
        out = proc.stdout if name == "verify_checkpoint.py" else proc.stderr
        assert out.count(refusal) == 1 and proc.stderr.count("\n") <= 1, (name, proc.stdout, proc.stderr)
    assert tools["verify_checkpoint.py"].stdout.startswith("ckpt  refused  ")
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_a_planted_training_state_entry_is_refused_and_runs_nothing(tmp_path):
    """The non-tensor entries (step, data position, loss scale) are pickles inside the shard files; DCP's own planner
    reads them with weights_only=False."""
    marker = tmp_path / "created_by_the_pickle"
    dcp.save({"w": torch.ones(2), "train": {"step": _CreatesAFile(marker)}}, checkpoint_id=tmp_path, no_dist=True)
    dcp.load({"w": torch.zeros(2), "train": {"step": 0}}, checkpoint_id=tmp_path, no_dist=True)  # DCP alone: it runs
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointError, match=f"loading {tmp_path} failed on rank 0: UnpicklingError: Weights only"):
        load_state({"w": torch.zeros(2), "train": {"step": 0}}, tmp_path, no_dist=True)
    assert not marker.exists()
