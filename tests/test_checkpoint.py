"""Checkpoints through real 2-rank runs: exact resume, resume on another world size / sharding, `latest`, errors."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import train_cli, train_losses

# A constant learning rate, so a run cut at step 3 follows the same schedule as one planned for 6 steps.
CONSTANT_LR = ["--optim.warmup_steps", "0", "--optim.min_lr", "3e-3", "--optim.lr", "3e-3", "--train.steps"]


def _args(tiny_data, out, steps, *extra):
    return ["--recipe", str(tiny_data), "--train.out_dir", str(out), *CONSTANT_LR, str(steps), *extra]


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    """6 steps on 2 ranks, FULL_SHARD, fp32, checkpointing every 3 steps."""
    out = tmp_path_factory.mktemp("full")
    train_cli(_args(tiny_data, out, 6, "--checkpoint.every", "3"), nproc=2)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_resume_is_bitwise_exact(tiny_data, tmp_path, uninterrupted, async_save):
    flags = ("--checkpoint.every", "3", "--checkpoint.async_save", async_save)
    train_cli(_args(tiny_data, tmp_path, 3, *flags), nproc=2)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    proc = train_cli(_args(tiny_data, tmp_path, 6, *flags), nproc=2)
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    expected, resumed = train_losses(uninterrupted), train_losses(tmp_path)
    assert resumed == expected  # steps 1-3 from the first run, 4-6 after the resume: bitwise equal
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000006"


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, flags",
    [
        (1, ["--data.grad_accum_steps", "2"]),  # 2 ranks -> 1 rank, accumulation doubled: same global batch
        (2, ["--parallel.sharding", "NO_SHARD"]),  # FULL_SHARD -> NO_SHARD
    ],
)
def test_resume_on_another_world_size_or_sharding(tiny_data, tmp_path, uninterrupted, nproc, flags):
    shutil.copytree(uninterrupted / "checkpoints" / "step_00000003", tmp_path / "step3")
    out = tmp_path / "run"
    train_cli(_args(tiny_data, out, 6, "--checkpoint.resume", str(tmp_path / "step3"), *flags), nproc=nproc)
    expected, resumed = train_losses(uninterrupted), train_losses(out)
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-5)


def test_latest_and_keep_last(tiny_data, tmp_path):
    train_cli(_args(tiny_data, tmp_path, 4, "--checkpoint.every", "1", "--checkpoint.keep_last", "2"))
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000003", "step_00000004"]
    assert (ckpts / "latest").read_text().strip() == "step_00000004"
    assert (ckpts / "step_00000004" / ".metadata").is_file()
    # A run resumed at its last step has nothing left to do and changes nothing.
    train_cli(_args(tiny_data, tmp_path, 4, "--checkpoint.every", "1"))
    assert (ckpts / "latest").read_text().strip() == "step_00000004"


@pytest.fixture(scope="module")
def one_step_checkpoint(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    train_cli(_args(tiny_data, out, 1, "--checkpoint.every", "1"))
    return out / "checkpoints" / "step_00000001"


@pytest.mark.parametrize(
    "case, flags, message",
    [
        (
            "shape",
            ["--model.ffn_dim", "96"],
            "holds model.layers.0.mlp.gate_proj.weight of shape (128, 64) but the recipe's model has (96, 64)",
        ),
        ("missing", [], "does not exist"),
        ("truncated", [], "not a complete DCP checkpoint (no .metadata)"),
    ],
)
def test_bad_checkpoints_give_clear_errors(tiny_data, tmp_path, one_step_checkpoint, case, flags, message):
    target = tmp_path / "ckpt"
    if case != "missing":
        shutil.copytree(one_step_checkpoint, target)
    if case == "truncated":
        (target / ".metadata").unlink()
    proc = train_cli(_args(tiny_data, tmp_path / "run", 2, "--checkpoint.resume", str(target), *flags), check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: rank 0: ") and message in proc.stderr, proc.stderr
