"""What a user sees when things go wrong: a dead or hung rank, a diverging run, a full disk or a bad out_dir.

Each failure must end the run with a message that names the rank, step or directory, and leave `latest` naming a
complete, good checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from fsdp_trainer.checkpoint.verify import checkpoint_status
from fsdp_trainer.config import ModelConfig, OptimConfig, ParallelConfig
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import materialize, parallelize
from fsdp_trainer.model import Transformer
from fsdp_trainer.optim import build_optimizer
from fsdp_trainer.train import train_step
from tests.helpers import (
    REPO,
    forked,
    read_metrics,
    run_args,
    run_distributed,
    train_background,
    train_cli,
    wait_for_step,
)
from tests.helpers import tool as run_tool

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
    proc = forked.run("fsdp_trainer.train", [*args, "--train.steps", "8"], file_size_limit=256 << 10)
    assert proc.returncode == 1
    ckpts = tmp_path / "checkpoints"
    assert re.fullmatch(
        f"error: rank 0: checkpoint step_00000008 was not saved: rank 0: writing {ckpts}/step_00000008/"
        r"__0_0.distcp failed \(File too large\), [\d.,]+ [GM]B free there now; "
        f"{ckpts}/latest still names step_00000004; stopping \\(checkpoint.on_save_error=stop\\): make room, then "
        "run the same command to resume",
        proc.stderr.strip(),
    ), proc.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000004"]  # the partial step 8 is gone


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MB file system of the test's own (tmpfs) where the machine lets it mount one, else None."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mount = ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", disk]
        mounted = subprocess.run(mount, capture_output=True).returncode
    except FileNotFoundError:  # no mount command
        mounted = 1
    yield disk if mounted == 0 else None
    if mounted == 0:
        subprocess.run(["umount", "-l", disk], check=True)


def fill(path, leave: int) -> None:
    """Fill the disk `path` is on with `path` until `leave` bytes are free (whatever a run writes meanwhile)."""
    with open(path, "wb", buffering=0) as f:
        try:
            while f.write(bytes(1 << 16)):
                pass
        except OSError:
            pass
        f.truncate(max(0, f.tell() - leave))


@pytest.mark.parametrize("async_save", [False, True])
def test_save_on_a_full_disk_goes_on_under_continue_and_saves_once_there_is_room(
    tiny_data, tmp_path, small_disk, async_save
):
    """The disk fills while a 2-rank run trains (a filler file on a small tmpfs; where mounting is not allowed, ENOSPC
    on rank 1 while a flag file exists): each failed save is one warning line naming the step, the file and the free
    space; `latest` stays on the last complete step and no step past it is complete; once the space is back, the next
    due save succeeds, and every checkpoint left verifies."""
    out, log = (small_disk or tmp_path) / "run", tmp_path / "log.txt"
    flag = (small_disk or tmp_path) / "filler"
    args = run_args(
        tiny_data,
        out,
        2_000,  # stopped long before; bounds what a broken test writes
        # keep_last 0 on the small disk: pruning an old step would free room for the next save to fit, by chance
        checkpoint={
            "every": 2,
            "keep_last": 0 if small_disk else 3,
            "async_save": async_save,
            "on_save_error": "continue",
        },
    )
    if small_disk is None:
        script = str(REPO / "tests" / "helpers" / "full_disk.py")
        proc = train_background(args, log, env={"FULL_DISK_RANK": "1", "FULL_DISK_FLAG": str(flag)}, target=script)
    else:
        proc = train_background(args, log)
    ckpts = out / "checkpoints"
    try:
        wait_for_step(out, 3, proc, log)
        while not (ckpts / "latest").exists():  # an async save may still be writing: fill the disk after one is done
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        if small_disk is None:
            flag.write_bytes(b"")
        else:
            fill(flag, leave=300_000)  # a shard (~1 MB) does not fit, a metrics line does
        warning = re.compile(
            r"checkpoint (step_\d{8}) was not saved: rank (\d): writing (\S+) failed \(No space left on device\), "
            r"[\d.,]+ [GM]B free there now; "
            + re.escape(str(ckpts / "latest"))
            + r" still names (step_\d{8}); training on"
        )
        deadline = time.monotonic() + 900  # bounds a broken test only: a loaded machine takes what it takes
        while not (found := warning.search(log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        failed, rank, file, kept = found.groups()
        assert file.startswith(str(ckpts / failed) + "/") and (small_disk is not None or rank == "1"), found.group(0)
        published = (ckpts / "latest").read_text().strip()
        assert published >= kept and published < failed  # `latest` never moved to the failed step
        assert not any((p / "checksums.json").exists() for p in ckpts.glob("step_*") if p.name > published)
        flag.unlink()  # the space is back
        while (ckpts / "latest").read_text().strip() <= failed:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # to every rank, as a scheduler's preemption does: the step saved, exit 0
        assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    lines = warning.findall(text)
    assert len(lines) == len({line[0] for line in lines}) >= 1  # one line per failed save (one node)
    assert "Traceback" not in text and "error:" not in text, text[-3000:]
    steps = sorted(ckpts.glob("step_*"))
    assert steps and all(checkpoint_status(step)[0] == "ok" for step in steps)  # nothing partial left
    assert (ckpts / "latest").read_text().strip() == steps[-1].name


def _error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("error: rank")]


@pytest.mark.slow
def test_rank_that_exits_early_is_named_by_its_peer(tiny_data, tmp_path):
    script = str(REPO / "tests" / "helpers" / "exit_early.py")
    # A closed connection fails at once, not after the collectives' timeout: an hour here, so a run that waited for
    # it would overrun the 15 minutes given below however slow or loaded the machine is.
    args = run_args(tiny_data, tmp_path, parallel={"timeout_s": 3600})
    proc = forked.run(script, args, nproc=2, env={"EXIT_STEP": "3", "EXIT_RANK": "1"})
    assert proc.returncode != 0
    [line] = _error_lines(proc.stderr)
    assert line.startswith("error: rank 0: ") and line.endswith(
        "rank 1 reported no failure of its own: it exited or hangs, look there first"
    ), line


@pytest.mark.slow
def test_hung_rank_fails_its_peer_after_the_timeout(tiny_data, tmp_path):
    log = tmp_path / "log.txt"
    args = run_args(tiny_data, tmp_path, 100000, parallel={"timeout_s": 10})
    proc = train_background(args, log)
    stopped = []
    try:
        wait_for_step(tmp_path, 2, proc, log)
        rank1 = proc.pids[1]
        os.kill(rank1, signal.SIGSTOP)
        stopped.append(rank1)
        start = time.monotonic()
        # Rank 0's error line is the behaviour under test; once it is out, the stopped rank is killed rather than
        # sent SIGTERM and waited for 30 s, as torchrun would.
        while not any(line.startswith("error: rank 0: ") for line in _error_lines(log.read_text())):
            assert proc.poll() is None and time.monotonic() - start < 900, log.read_text()[-3000:]
            time.sleep(0.2)
        waited = time.monotonic() - start
        os.kill(rank1, signal.SIGKILL)
        proc.wait(timeout=900)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert waited >= 10, waited  # not before the timeout; after it, however long a loaded machine takes to say so
    lines = _error_lines(log.read_text())
    assert any(
        line.startswith("error: rank 0: ") and "rank 1 reported no failure of its own" in line for line in lines
    ), log.read_text()[-3000:]


def _files_bytes(folder, prefix: str, but: str | None = None) -> dict:
    """The bytes of every file under `folder` whose path there starts with `prefix`, but for those under `but`."""
    files = [p for p in folder.rglob(f"{prefix}*") if p.is_file() or p.is_dir()]
    files = {f for p in files for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()}
    return {f: f.read_bytes() for f in files if but is None or but not in f.relative_to(folder).parts}


def _tool_with_files_capped(tool: str, *args) -> subprocess.CompletedProcess:
    """tools/`tool` with every file it writes capped at 100 kB (EFBIG past that, as ENOSPC on a full disk)."""
    return forked.run(str(REPO / "tools" / tool), list(map(str, args)), file_size_limit=100_000)


def test_tools_that_run_out_of_room_leave_nothing_that_looks_complete(tiny_data, tmp_path):
    """prepare_data (a token file, a directory of shards), consolidate and import_hf: one line naming the file and the
    room left; no output a user or a later run could take for complete; the same commands with room succeed."""
    corpus, run = tiny_data.parent / "corpus.txt", tmp_path / "run"
    expected = r"error: writing (\S+) failed \(File too large\), [\d.,]+ [GM]B free there now; "
    (tmp_path / "act_one.txt").write_text(corpus.read_text()[:20_000])  # a previous preparation, within the cap
    for out in (tmp_path / "tokens.bin", tmp_path / "shards"):
        args = ["--data.train_path", out, "--data.val_path", "null", "--shard_tokens", "60000",
                "--data.tokenizer_path", tiny_data.parent / "tokenizer.model"]  # fmt: skip
        run_tool("prepare_data.py", "--recipe", tiny_data, "--input", tmp_path / "act_one.txt", *args)
        previous = _files_bytes(tmp_path, out.name)
        proc = _tool_with_files_capped("prepare_data.py", "--recipe", tiny_data, "--input", corpus, *args)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert re.match(expected + "nothing half-written is left and the previous files are as they were",
                        proc.stderr), proc.stderr  # fmt: skip
        staged = tmp_path / f"{out.name}.tmp"  # a directory of shards keeps its complete shards for a rerun to go on
        assert _files_bytes(tmp_path, out.name, but=staged.name) == previous
        if out.suffix:  # nothing of the token file's family staged
            assert not list(tmp_path.glob("tokens.bin*.tmp"))
        else:  # no manifest (the loader refuses the directory; a rerun goes on) and no shard without its meta
            assert not (staged / "manifest.json").exists() and not list(staged.glob("*.tmp"))
            assert all((staged / f"{shard.name}.meta.json").is_file() for shard in staged.glob("shard_*.bin"))

    train_cli(run_args(tiny_data, run, 1, checkpoint={"every": 1}))
    proc = _tool_with_files_capped("consolidate.py", run, tmp_path / "hf", "--verify", "files")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert re.match(expected + f"nothing was written to {tmp_path / 'hf'}$", proc.stderr.strip()), proc.stderr
    # no hf/, no temporary directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["act_one.txt", "run", "shards", "shards.tmp", "tokens.bin",
                                                          "tokens.bin.inputs.json", "tokens.bin.meta.json"]  # fmt: skip

    run_tool("consolidate.py", run, tmp_path / "hf")
    proc = _tool_with_files_capped("import_hf.py", tmp_path / "hf", tmp_path / "imported")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert re.match(expected + "no partial checkpoint was left", proc.stderr), proc.stderr
    assert not (tmp_path / "imported" / "checkpoints" / "step_00000000").exists()
