"""End-to-end training runs through the real CLI: 1 process and 2 gloo ranks under torchrun."""

from __future__ import annotations

import fcntl
import math
import os
import pty
import struct
import subprocess
import termios

import pytest
import torch
import yaml

from fsdp_trainer.config import ModelConfig
from fsdp_trainer.distributed.runtime import native_precision
from fsdp_trainer.model import count_params
from tests.helpers import REPO, TINY_MODEL, forked, injected, read_metrics, run_args, train_cli, train_losses
from tests.helpers import script as script_run


def _run(tiny_data, out_dir, steps=None, nproc=1, **overrides):
    train_cli(run_args(tiny_data, out_dir, steps, **overrides), nproc=nproc)
    return train_losses(out_dir)


@pytest.fixture(scope="module")
def reference_losses(tiny_data, tmp_path_factory):
    """1 process, micro-batch 2 x 2 accumulation steps: the global batch of 4 sequences that 2 ranks x 2 split."""
    return _run(tiny_data, tmp_path_factory.mktemp("ref"), data={"grad_accum_steps": 2})


@pytest.mark.slow
@pytest.mark.parametrize(
    "sharding, accumulate_unsharded",
    [("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("NO_SHARD", False)],
)
def test_two_ranks_match_one_process(tiny_data, tmp_path, reference_losses, sharding, accumulate_unsharded):
    """2 ranks x 2 micro-steps of 1 sequence under ZeRO-3 (each micro-step's gradients reduce-scattered into the
    shards) and ZeRO-2 with them accumulated unsharded (reduced once, at the last), and DDP at 2 sequences a rank: the
    losses of one process at 2 x 2 (fp32, reduction order only)."""
    parallel = {"sharding": sharding, "accumulate_unsharded": accumulate_unsharded}
    data = {} if sharding == "NO_SHARD" else {"micro_batch_size": 1, "grad_accum_steps": 2}
    losses = _run(tiny_data, tmp_path, nproc=2, parallel=parallel, data=data)
    assert sorted(losses) == list(range(1, 11))
    for step, ref in reference_losses.items():
        assert losses[step] == pytest.approx(ref, rel=1e-5), f"step {step}: {losses[step]} vs {ref}"
    # The reference must be learning, or the comparison proves little.
    assert reference_losses[10] < reference_losses[1] - 0.5


@pytest.mark.slow
def test_zero1_with_accumulation_matches_one_process_and_its_formula(tiny_data, tmp_path, reference_losses):
    """SHARD_OP (ZeRO-1) on 2 ranks x 2 micro-steps of 1 sequence, parameters gathered once per step: the losses of
    one process (fp32, reduction order only), and each rank holds 1/2 of weights, gradients and AdamW state."""
    losses = _run(
        tiny_data,
        tmp_path,
        nproc=2,
        parallel={"sharding": "SHARD_OP"},
        data={"micro_batch_size": 1, "grad_accum_steps": 2},
    )
    for step, ref in reference_losses.items():
        assert losses[step] == pytest.approx(ref, rel=1e-5), step
    state = next(r for r in read_metrics(tmp_path) if "state_gb" in r)
    n_params = count_params(ModelConfig(**TINY_MODEL))
    assert state["state_gb"] == pytest.approx(16 * n_params / 2 / 1e9, rel=0.01)  # fp32 w + g + 2 moments, / 2


@pytest.mark.slow
def test_fast_path_flags_run_on_cpu_and_change_no_number(tiny_data, tmp_path, reference_losses):
    """GPU fast-path flags must run on CPU too: explicit prefetching of 2 blocks ahead changes only when all-gathers
    start; expandable segments are CUDA's and are said to be skipped."""
    proc = train_cli(
        run_args(tiny_data, tmp_path, parallel={"prefetch_blocks": 2, "expandable_segments": True}), nproc=2
    )
    assert "parallel.expandable_segments: CUDA's allocator only, nothing to do on cpu" in proc.stdout + proc.stderr
    losses = train_losses(tmp_path)
    for step, ref in reference_losses.items():
        assert losses[step] == pytest.approx(ref, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True])
def test_chunked_loss_under_fsdp_matches_one_process(tiny_data, tmp_path, tie):
    """The output layer in 3 uneven slices, recomputed in backward under FULL_SHARD (the output weight is the root's,
    gathered around the recomputation) with selective AC on the blocks: the losses of one process in one piece, train
    and validation alike (evaluation takes the same path)."""
    model = {"tie_embeddings": tie}
    train = {"eval_every": 5}
    # Micro-batch 4 in one process: the global batch of 2 ranks x 2, and the same validation batches.
    reference = _run(tiny_data, tmp_path / "ref", data={"micro_batch_size": 4}, model=model, train=train)
    chunked = {"loss_chunks": 3, **train}
    losses = _run(
        tiny_data,
        tmp_path / "chunked",
        nproc=2,
        model=model,
        train=chunked,
        parallel={"activation_checkpointing": "selective"},
    )
    for step, ref in reference.items():
        assert losses[step] == pytest.approx(ref, rel=1e-5), step
    val = [[r["val_loss"] for r in read_metrics(tmp_path / run) if "val_loss" in r] for run in ("ref", "chunked")]
    assert len(val[0]) == 2 and val[1] == pytest.approx(val[0], rel=1e-5)


@pytest.mark.slow
def test_cpu_offload_runs_on_cpu_matches_one_process_and_resumes_exactly(tiny_data, tmp_path, reference_losses):
    """parallel.cpu_offload runs FSDP2's CPUOffloadPolicy on a CPU-only machine (unpinned, since pinning needs an
    accelerator): the losses of one process (fp32, reduction order only), the ZeRO-3 state per rank, and a run cut at
    step 5 and resumed, without offload (the checkpoint is the same either way), logs bitwise the losses of one that
    never stopped."""
    offload = {"sharding": "FULL_SHARD", "cpu_offload": True}
    whole = _run(tiny_data, tmp_path / "whole", nproc=2, parallel=offload)
    for step, ref in reference_losses.items():
        assert whole[step] == pytest.approx(ref, rel=1e-5), step
    state = next(r for r in read_metrics(tmp_path / "whole") if "state_gb" in r)
    assert state["state_gb"] == pytest.approx(16 * count_params(ModelConfig(**TINY_MODEL)) / 2 / 1e9, rel=0.01)
    constant_lr = {"warmup_steps": 0, "lr": 3e-3, "min_lr": 3e-3}  # a run cut at 5 follows the 10-step schedule
    flags = {"parallel": offload, "optim": constant_lr, "checkpoint": {"every": 5}}
    uncut = _run(tiny_data, tmp_path / "uncut", 10, nproc=2, **flags)
    _run(tiny_data, tmp_path / "cut", 5, nproc=2, **flags)
    flags["parallel"] = {"sharding": "FULL_SHARD", "cpu_offload": False}
    assert _run(tiny_data, tmp_path / "cut", 10, nproc=2, **flags) == uncut


FP16 = {"mixed_precision": "fp16"}


@pytest.mark.slow
def test_fp16_two_ranks_match_one_process_and_learn(tiny_data, tmp_path):
    """fp16 compute and all-gathers with fp32 master weights and reductions, the loss scaled dynamically: 2 ranks give
    1 process x accumulation 2 within fp16's precision, the loss falls, and metrics.jsonl carries the scale."""
    reference = _run(tiny_data, tmp_path / "ref", data={"grad_accum_steps": 2}, parallel=FP16)
    losses = _run(tiny_data, tmp_path / "two", nproc=2, parallel=FP16)
    for step, ref in reference.items():
        assert losses[step] == pytest.approx(ref, rel=2e-3), step
    assert reference[10] < reference[1] - 0.5
    last = [r for r in read_metrics(tmp_path / "two") if "loss" in r][-1]
    assert last["loss_scale"] > 0 and last["overflow_steps"] >= 0 and last["skipped_steps"] == 0


@pytest.mark.slow
def test_fp16_overflow_is_skipped_and_the_scale_backs_off(tiny_data, tmp_path):
    """A loss scale of 2^26 overflows this model's fp16 gradients (2^18 is the first that fits): those steps are
    skipped, the scale halves each time until it fits, and training goes on, train.on_nonfinite (stop) never tripped."""
    proc = train_cli(run_args(tiny_data, tmp_path, 20, parallel=FP16, optim={"loss_scale": 2.0**26}), nproc=2)
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    counts = [r["overflow_steps"] for r in records]
    assert counts[:6] == [1, 2, 3, 4, 5, 6] and counts[-1] < 12  # 2^26 .. 2^21 overflow; then mostly clean steps
    for record, before in zip(records, [0, *counts], strict=False):  # an overflow step's norm is non-finite (null)
        assert (record["grad_norm"] is None) == (record["overflow_steps"] > before), record
    assert records[-1]["loss_scale"] == 2.0 ** (26 - counts[-1])  # halved once per overflow, not yet grown back
    assert records[-1]["skipped_steps"] == 0 and records[-1]["loss"] < records[6]["loss"] - 0.2  # and it learns
    assert "non-finite" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_fp16_resume_is_exact_with_the_scaler_state(tiny_data, tmp_path):
    """The scale and its growth counter are checkpointed: stopped at step 6, after the scale backed off from 2^22, and
    resumed, a run logs bitwise the losses of one that never stopped (restarting at 2^22 would skip steps again)."""
    constant_lr = {"warmup_steps": 0, "lr": 3e-3, "min_lr": 3e-3}  # a run cut at 6 follows the 12-step schedule
    flags = {"parallel": FP16, "optim": {"loss_scale": 2.0**22, **constant_lr}, "checkpoint": {"every": 6}}
    whole = _run(tiny_data, tmp_path / "whole", 12, nproc=2, **flags)
    _run(tiny_data, tmp_path / "cut", 6, nproc=2, **flags)
    resumed = _run(tiny_data, tmp_path / "cut", 12, nproc=2, **flags)
    assert resumed == whole
    # The same overflows as the uninterrupted run: restarting at 2^22 would have overflowed (and skipped) 4 more.
    overflows = {
        run: [r["overflow_steps"] for r in read_metrics(tmp_path / run) if "loss" in r] for run in ("whole", "cut")
    }
    assert overflows["cut"][-6:] == overflows["whole"][-6:] and overflows["whole"][5] > 0


@pytest.mark.slow
def test_fp16_with_cpu_offload_scales_and_skips_like_without(tiny_data, tmp_path):
    """fp16 under parallel.cpu_offload: the scaler lives with the gradients on the host; the same overflows, the same
    backoff and the same losses as without offload."""
    runs = {}
    for offload in (False, True):
        flags = {"parallel": {**FP16, "cpu_offload": offload}, "optim": {"loss_scale": 2.0**22}}
        out = tmp_path / str(offload)
        losses = _run(tiny_data, out, 8, nproc=2, **flags)
        runs[offload] = losses, [(r["overflow_steps"], r["loss_scale"]) for r in read_metrics(out) if "loss" in r]
    assert runs[True] == runs[False] and runs[True][1][-1][0] > 0  # it did overflow


@pytest.mark.slow
def test_hybrid_shard_on_one_node_matches_one_process(tiny_data, tmp_path, reference_losses):
    losses = _run(tiny_data, tmp_path, nproc=2, parallel={"sharding": "HYBRID_SHARD"})
    for step, ref in reference_losses.items():
        assert losses[step] == pytest.approx(ref, rel=1e-5)


def test_activation_checkpointing_leaves_losses_unchanged(tiny_data, tmp_path):
    """Recomputation must reproduce the forward exactly: same fp32 losses for none, full, selective, every 2nd."""
    runs = {
        "none": {},
        "full": {"activation_checkpointing": "full"},
        "selective": {"activation_checkpointing": "selective"},
        "full_every_2": {"activation_checkpointing": "full", "ac_every": 2},
    }
    losses = {name: _run(tiny_data, tmp_path / name, 4, parallel=flags) for name, flags in runs.items()}
    for name in runs:
        assert losses[name] == losses["none"], name


@pytest.mark.slow
def test_bf16_on_two_ranks_learns_the_real_corpus(tiny_data, tmp_path):
    losses = _run(
        tiny_data,
        tmp_path,
        40,
        nproc=2,
        parallel={"mixed_precision": "bf16"},
        train={"log_every": 5},
        optim={"warmup_steps": 5},
        data={"micro_batch_size": 4},
    )
    assert losses[5] > losses[40] + 1.0, losses  # from ~uniform over 512 ids (6.2) well into the corpus' statistics
    assert losses[40] < 5.0


@pytest.mark.slow
def test_torchrun_writes_config_and_metrics(tiny_data, tmp_path):
    out = tmp_path / "run"
    overrides = {"train": {"log_every": 3, "eval_every": 3}, "parallel": {"mixed_precision": "auto"}}
    proc = train_cli(run_args(tiny_data, out, 6, **overrides), nproc=2)
    records = read_metrics(out)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    # The first step is logged whatever log_every says: the first sign of life comes at once.
    assert [r["step"] for r in steps] == [1, 3, 6] and [r["step"] for r in evals] == [3, 6]
    for r in steps:
        assert {
            "step",
            "loss",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "mfu",
            "peak_mem_gb",
            "elapsed_s",
            "cpu_s",
            "step_time_s",
            "step_time_max_s",
        } <= set(r)
        assert r["mfu"] is None  # CPU: no peak FLOP/s to compare against
        assert r["tokens_per_s"] > 0 and 0 < r["peak_mem_gb"] < 20 and math.isfinite(r["loss"])
        assert 0 < r["step_time_s"] <= r["step_time_max_s"]
    assert 0 < steps[0]["cpu_s"] < steps[1]["cpu_s"]
    assert all(math.isfinite(r["val_loss"]) for r in evals)
    # config.yaml is the resolved recipe, including the command-line overrides.
    config = yaml.safe_load((out / "config.yaml").read_text())
    # auto is recorded as what it resolved to on this CPU, in config.yaml and in metrics.jsonl.
    native = native_precision(torch.device("cpu"))[0]
    assert config["train"]["steps"] == 6 and config["parallel"]["mixed_precision"] == native
    assert next(r for r in records if "state_gb" in r)["mixed_precision"] == native
    assert f"parallel.mixed_precision: auto -> {native}" in proc.stdout
    # Rank 0 logs; rank 1 stays quiet.
    assert "[rank0] step      6" in proc.stdout and "[rank1]" not in proc.stdout


def test_a_resume_in_another_precision_says_what_changed(tiny_data, tmp_path):
    """What auto resolved to is in the checkpoint's recipe: a resume that computes otherwise (another machine, an
    override) goes on with one warning; into fp16, which needs a loss scale the checkpoint lacks, it stops with one
    line."""
    fp32 = {"parallel": {"mixed_precision": "fp32"}, "checkpoint": {"every": 2}}
    train_cli(run_args(tiny_data, tmp_path, 2, **fp32))
    to_bf16 = train_cli(run_args(tiny_data, tmp_path, 3, parallel={"mixed_precision": "bf16"}, checkpoint={"every": 3}))
    assert "was trained in fp32, and this run computes in bf16" in to_bf16.stdout
    to_fp16 = train_cli(run_args(tiny_data, tmp_path, 4, parallel={"mixed_precision": "fp16"}), check=False)
    assert to_fp16.returncode == 1
    (line,) = to_fp16.stderr.strip().splitlines()
    assert "was trained in bf16 and holds no fp16 loss scale" in line and "mixed_precision bf16" in line


def test_config_yaml_reproduces_the_run(tiny_data, tmp_path):
    first = _run(tiny_data, tmp_path / "a", 3, optim={"lr": 1e-3})
    again = _run(tmp_path / "a" / "config.yaml", tmp_path / "b")
    assert again == first


def test_a_finished_run_gives_back_sigterm_and_its_process_groups(tiny_data, tmp_path):
    """Called from a user's program, main() leaves the program's SIGTERM handler and no process group behind. A group
    the trainer's handler kept alive until interpreter exit made rank 1 abort there now and then ("terminate called
    without an active exception"); see PreemptionFlag.close."""
    script = f"""
import signal, torch.distributed as dist
from fsdp_trainer.train import main
def users_handler(signum, frame): pass
signal.signal(signal.SIGTERM, users_handler)
main(["--recipe", {str(tiny_data)!r}, "--train.out_dir", {str(tmp_path)!r}, "--train.steps", "2"])
assert signal.getsignal(signal.SIGTERM) is users_handler, signal.getsignal(signal.SIGTERM)
assert not dist.is_initialized()
print("clean")
"""
    (tmp_path / "users_program.py").write_text(script)
    proc = script_run(tmp_path / "users_program.py", check=False)  # forked, as `python users_program.py` runs
    assert proc.returncode == 0 and proc.stdout.strip().endswith("clean"), proc.stderr[-3000:]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.n_kv_heads", "3"], "error: model.n_kv_heads=3 must divide model.n_heads=4"),
        (["--data.seq_len", "128"], "error: data.seq_len=128 must be <= model.max_seq_len=64"),
        (["--parallel.sharding", "ZERO3"], 'error: Parser key "parallel.sharding"'),
        (["--model.bogus", "1"], "error: unrecognized arguments: --model.bogus 1"),
        (["--data.train_path", "/nonexistent/train.bin"], "error: token file /nonexistent/train.bin"),
        (["--model.vocab_size", "256"], "train.bin has 512 ids, more than model.vocab_size=256: the model could not"),
        (["--parallel.backend", "nccl"], "error: parallel.backend=nccl needs CUDA"),
    ],
)
def test_bad_input_gives_one_error_line(tiny_data, tmp_path, flags, message):
    proc = train_cli([*run_args(tiny_data, tmp_path), *flags], check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.n_kv_heads", "3"], "error: model.n_kv_heads=3 must divide model.n_heads=4"),
        (["--data.train_path", "/nonexistent/train.bin"], "error: token file /nonexistent/train.bin"),
    ],
)
def test_bad_input_under_torchrun_is_one_line_per_node(tiny_data, tmp_path, flags, message):
    """Every rank parses the recipe and opens the data, and every rank exits 1, but one line is printed per node:
    by the first rank to fail, even when rank 0 is slow and torchrun stops it before it gets there (forced here, as a
    busy 2-core machine once did by chance)."""
    proc = train_cli([*run_args(tiny_data, tmp_path), *flags], nproc=2, check=False, env=injected("slow", rank=0))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-3000:]


@pytest.mark.slow
def test_compile_with_selective_ac_matches_eager(tiny_data, tmp_path):
    """The per-block torch.compile path (after AC, before FSDP) trains to the same losses as eager, up to fusion."""
    eager = _run(tiny_data, tmp_path / "eager", 3, parallel={"activation_checkpointing": "selective"})
    compiled = _run(
        tiny_data, tmp_path / "compiled", 3, parallel={"activation_checkpointing": "selective", "compile": True}
    )
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-4)


def _run_on_terminal(args: list[str]) -> str:
    """Run one training process with its stdout on a pseudo-terminal of 120 columns; return what it printed. The
    process is forked from the tests' forkserver (forked.STAND_IN, the terminal its stdout and stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [forked.STAND_IN, "-m", "fsdp_trainer.train", *args],
        stdout=slave,
        stderr=slave,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **forked.stand_in_env()},
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=900) == 0
    return b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal_and_tensorboard_scalars(tiny_data, tmp_path):
    args = run_args(tiny_data, tmp_path, 20, train={"log_every": 10})
    shown = _run_on_terminal(args)
    assert "20/20 [" in shown and "step/s" in shown and "loss=" in shown  # tqdm: count, ETA/elapsed, rate
    assert shown.count("step     10 | loss") == 1  # each log line once, above the bar
    plain = train_cli([*args, "--train.out_dir", str(tmp_path / "piped")])
    assert "step/s" not in plain.stdout + plain.stderr  # not a terminal: log lines only

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("loss/train")}
    assert losses == pytest.approx(train_losses(tmp_path))
    assert {"train/lr", "train/grad_norm", "speed/tokens_per_s", "memory/peak_gb", "memory/state_gb"} <= set(
        events.Tags()["scalars"]
    )
