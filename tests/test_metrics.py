"""What a log record says about the steps of its window: the step times behind the spread bench.py reports, and the
throughput, on a clock the test moves (no sleeps)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fsdp_trainer.checkpoint.storage import CHECKSUMS_FILE
from fsdp_trainer.config import DataConfig, ModelConfig, ParallelConfig, Recipe, TrainConfig
from fsdp_trainer.distributed.runtime import close_distributed, init_distributed
from fsdp_trainer.files import METRICS_FILE
from fsdp_trainer.metrics import Metrics, StepTimer, peak_flops
from fsdp_trainer.sinks import WANDB_RUN_FILE
from tests.helpers import TINY_MODEL, read_metrics, run_args, train_cli

CPU = torch.device("cpu")


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_step_timer_times_each_step_since_the_window_opened():
    clock = FakeClock()
    timer = StepTimer(CPU, clock)
    timer.restart()
    for pause in (0.05, 0.15):
        clock.now += pause
        timer.mark()
    first, second = timer.durations()
    assert first == pytest.approx(0.05) and second == pytest.approx(0.15)
    timer.restart()  # the time between windows (a log step, an evaluation) belongs to no step
    assert timer.durations() == []
    timer.mark()
    assert len(timer.durations()) == 1


def test_a_log_record_carries_the_median_and_largest_step_time_of_its_window(tmp_path):
    recipe = Recipe(
        model=ModelConfig(**TINY_MODEL),
        parallel=ParallelConfig(mixed_precision="fp32"),
        data=DataConfig(seq_len=32, micro_batch_size=2),
        train=TrainConfig(out_dir=str(tmp_path), steps=6, progress_bar=False),
    )
    env = init_distributed(recipe.parallel)  # one process: a 1-rank group, as `python -m fsdp_trainer.train` makes
    try:
        clock = FakeClock()
        model = torch.nn.Linear(4, 4)
        metrics = Metrics(recipe, env, model, torch.optim.SGD(model.parameters()), clock=clock)
        clock.now += 0.5  # an evaluation, after which the trainer restarts the clock: no step's time
        metrics.window.restart(0)
        for step, pause in enumerate((1 / 64, 1 / 4, 1 / 64), start=1):  # exact in binary: no rounding below
            clock.now += pause
            metrics.step_done(step)
        stats = {"loss": torch.tensor(1.0), "grad_norm": torch.tensor(2.0)}
        record = metrics.log(3, stats, lr=1e-3)
        metrics.close()
    finally:
        close_distributed()
    assert 0.01 <= record["step_time_s"] < 0.2 <= record["step_time_max_s"] < 0.5
    assert (record["step_time_s"], record["step_time_max_s"]) == (1 / 64, 1 / 4)
    assert record["tokens_per_s"] == pytest.approx(3 * 2 * 32 / (1 / 64 + 1 / 4 + 1 / 64))  # 3 steps x 2 x 32 tokens
    assert (record["loss"], record["grad_norm"]) == (1.0, 2.0)
    lines = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert lines[0]["step"] == 1 and lines[0]["state_gb"] == pytest.approx(20 * 4 / 1e9)  # after the first step
    assert lines[-1]["step_time_s"] == pytest.approx(record["step_time_s"])


def test_off_a_terminal_a_slow_run_prints_progress_between_log_steps(tmp_path, capsys):
    recipe = Recipe(
        model=ModelConfig(**TINY_MODEL),
        parallel=ParallelConfig(mixed_precision="fp32"),
        data=DataConfig(seq_len=32, micro_batch_size=2),
        train=TrainConfig(out_dir=str(tmp_path), steps=100, progress_bar=False, progress_every_s=60),
    )
    env = init_distributed(recipe.parallel)
    try:
        clock = FakeClock()
        model = torch.nn.Linear(4, 4)
        for first in (25, 900):  # a first step that compiles for 15 minutes counts in no ETA
            clock.now = 0.0
            metrics = Metrics(recipe, env, model, torch.optim.SGD(model.parameters()), clock=clock)
            for step in range(1, 8):  # 25 s a step: a line once 60 s have passed since the last one
                clock.now += first if step == 1 else 25
                metrics.step_done(step)
            metrics.close()
    finally:
        close_distributed()
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines() if "s/step" in line]
    assert lines == [
        "step      3 of 100 | 25.00 s/step | eta 0h40m25s",
        "step      6 of 100 | 25.00 s/step | eta 0h39m10s",
        "step      2 of 100 | 25.00 s/step | eta 0h40m50s",
        "step      5 of 100 | 25.00 s/step | eta 0h39m35s",
    ]


# --- Weights & Biases, through a stand-in package that records each call (tests/helpers/fake_wandb) ------------------

HELPERS = Path(__file__).resolve().parent / "helpers"
WANDB = {"project": "tiny", "mode": "offline", "tags": "[a, b]"}


def _wandb_calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _with_package(directory: str, log: Path) -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(HELPERS / directory), os.environ.get("PYTHONPATH", "")]),
            "FAKE_WANDB_LOG": str(log)}  # fmt: skip


@pytest.mark.slow
def test_wandb_gets_the_scalars_from_rank_0_and_a_resumed_run_continues_its_run(tiny_data, tmp_path):
    log, out = tmp_path / "wandb.jsonl", tmp_path / "run"
    flags = {"train": {"log_every": 2, "eval_every": 2}, "checkpoint": {"every": 2}, "wandb": WANDB}
    train_cli(run_args(tiny_data, out, 4, **flags), nproc=2, env=_with_package("fake_wandb", log), torchrun=False)
    calls = _wandb_calls(log)
    (init,) = [c for c in calls if c["call"] == "init"]  # one run, from rank 0 only
    assert {c["pid"] for c in calls} == {init["pid"]} and calls[-1]["call"] == "finish"
    assert (init["project"], init["mode"], init["tags"], init["name"]) == ("tiny", "offline", ["a", "b"], "run")
    assert init["resume"] is None and all(init["config"]["model"][k] == v for k, v in TINY_MODEL.items())
    logged: dict[int, dict] = {}  # a step's records (training, evaluation) are logged at that step, in turn
    for c in calls:
        if c["call"] == "log":
            logged.setdefault(c["step"], {}).update(c["data"])
    # The numbers metrics.jsonl has, under TensorBoard's names.
    for record in read_metrics(out):
        if "loss" in record:
            assert logged[record["step"]]["loss/train"] == record["loss"]
            assert logged[record["step"]]["speed/tokens_per_s"] == record["tokens_per_s"]
    assert any("loss/val" in data for data in logged.values())
    step_dir = out / "checkpoints" / "step_00000004"
    assert json.loads((step_dir / WANDB_RUN_FILE).read_text())["id"] == init["id"]  # saved with the checkpoint
    assert WANDB_RUN_FILE in json.loads((step_dir / CHECKSUMS_FILE).read_text())["files"]

    # Resumed from step 4 (as after a preemption): the same W&B run, resumed, logging from step 5 on.
    log.unlink()
    train_cli(run_args(tiny_data, out, 6, **flags), nproc=2, env=_with_package("fake_wandb", log), torchrun=False)
    (again,) = [c for c in _wandb_calls(log) if c["call"] == "init"]
    assert again["id"] == init["id"] and again["resume"] == "allow"
    assert min(c["step"] for c in _wandb_calls(log) if c["call"] == "log") > 4

    # With rewind (W&B's preview feature), the run is resumed from the checkpoint's step instead.
    log.unlink()
    rewind = {**flags, "wandb": {**WANDB, "rewind": True}}
    train_cli(run_args(tiny_data, out, 8, **rewind), nproc=2, env=_with_package("fake_wandb", log), torchrun=False)
    (rewound,) = [c for c in _wandb_calls(log) if c["call"] == "init"]
    assert rewound["resume_from"] == f"{init['id']}?_step=6" and "id" not in rewound and "resume" not in rewound


def test_naming_wandb_without_the_package_is_one_error_line(tiny_data, tmp_path):
    log, tmp = tmp_path / "wandb.jsonl", tmp_path / "tmp"
    tmp.mkdir()
    proc = train_cli(
        run_args(tiny_data, tmp_path / "run", 2, wandb=WANDB),
        nproc=2,
        check=False,
        env={**_with_package("no_wandb", log), "TMPDIR": str(tmp)},
    )  # under torchrun, whose workers find this error each and claim their node's one line
    assert proc.returncode != 0 and proc.stderr.count("error:") == 1, proc.stderr
    assert not list(tmp.glob("fsdp_trainer_error*"))  # the claim is in torchrun's directory for the workers
    assert "error: wandb.project=tiny needs the wandb package" in proc.stderr and "pip install wandb" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
    # mode: disabled needs no package (a recipe keeps its project and turns W&B off).
    disabled = {**WANDB, "mode": "disabled"}
    train_cli(
        run_args(tiny_data, tmp_path / "off", 2, wandb=disabled), env=_with_package("no_wandb", log), torchrun=False
    )


@pytest.mark.parametrize(
    "name, precision, peak",
    [("NVIDIA H100 80GB HBM3", "bf16", 989e12), ("NVIDIA H100 PCIe", "fp32", 51e12), ("NVIDIA L40S", "bf16", 362e12),
     ("NVIDIA L4", "fp16", 121e12), ("Tesla V100-SXM2-32GB", "fp16", 125e12), ("Tesla V100-SXM2-32GB", "bf16", None),
     ("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12), ("Some Future GPU", "bf16", None)],
)  # fmt: skip
def test_mfu_is_against_the_peak_of_the_precision_the_run_computes_in(monkeypatch, name, precision, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda", 0), precision) == peak
    assert peak_flops(torch.device("cpu"), precision) is None


def test_only_rank_0_opens_the_run_files(tmp_path):
    """Every rank builds its Metrics alike; only rank 0 may open metrics.jsonl, whose "w" would empty the file rank 0
    writes (2 ranks lost a resumed run's records that way, now and then)."""
    from fsdp_trainer.sinks import Sinks

    train = TrainConfig(out_dir=str(tmp_path), progress_bar=False)
    recipe = Recipe(model=ModelConfig(**TINY_MODEL), data=DataConfig(seq_len=32), train=train)
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\n')
    other = Sinks(recipe, is_main=False, start_step=0, shown=None, resumed_from=None)
    other.write({"step": 2, "val_loss": 1.5})
    other.close()
    assert sorted(os.listdir(tmp_path)) == [METRICS_FILE] and read_metrics(tmp_path) == [{"step": 1}]
    main = Sinks(recipe, is_main=True, start_step=1, shown=None, resumed_from=None)
    main.write({"step": 2, "val_loss": 1.5})
    main.close()
    assert read_metrics(tmp_path) == [{"step": 1}, {"step": 2, "val_loss": 1.5}]


def test_metrics_jsonl_holds_what_a_full_disk_refuses_and_writes_it_in_order_once_there_is_room(
    tmp_path, monkeypatch, caplog
):
    """A disk that fills while an async checkpoint is written (or a log grows) must not stop training: the records it
    refuses, a line cut in half included, wait in memory behind one warning and land in order once space is back."""
    import errno

    from fsdp_trainer import sinks

    real_write, room = os.write, {"bytes": None}  # None: no limit

    def write(fd, data):
        if room["bytes"] is None:
            return real_write(fd, data)
        if room["bytes"] == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real_write(fd, data[: room["bytes"]])
        room["bytes"] -= n
        return n

    monkeypatch.setattr(sinks.os, "write", write)
    path = tmp_path / METRICS_FILE
    jsonl = sinks.JsonlFile(str(path), start_step=0)
    jsonl.write({"step": 1, "loss": 2.0})
    room["bytes"] = 5  # the next line is cut after 5 bytes
    with caplog.at_level("WARNING", logger="fsdp_trainer"):
        for step in (2, 3, 4):
            jsonl.write({"step": step, "loss": 2.0})
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: No space left on device; its records are held in memory until there is room"
    ]
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"ste'
    room["bytes"] = None
    jsonl.write({"step": 5, "val_loss": 1.0})
    jsonl.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]

    jsonl, room["bytes"] = sinks.JsonlFile(str(path), start_step=5), 0
    jsonl.write({"step": 6, "loss": 2.0})
    caplog.clear()
    with caplog.at_level("WARNING", logger="fsdp_trainer"):
        jsonl.close()
    assert caplog.records[-1].getMessage() == f"{path}: 25 bytes of records were lost: the disk stayed full"


def test_benchmark_scores_keep_their_names_in_tensorboard_and_wandb_and_one_log_line():
    from fsdp_trainer.sinks import scalars, score_lines

    record = {"step": 4, "eval/arc_easy/acc": 0.5, "eval/arc_easy/acc_stderr": 0.1, "val_loss": 2.0,
              "val_rewards/chosen": 0.25, "eval/gsm8k/exact_match,strict-match": 0.125,
              "eval/gsm8k/exact_match_stderr,strict-match": 0.05}  # fmt: skip
    assert scalars(record) == {
        "eval/arc_easy/acc": 0.5,
        "eval/arc_easy/acc_stderr": 0.1,
        "loss/val": 2.0,
        "eval/rewards/chosen": 0.25,
        "eval/gsm8k/exact_match,strict-match": 0.125,
        "eval/gsm8k/exact_match_stderr,strict-match": 0.05,
    }
    assert score_lines(record) == ["arc_easy acc 0.5000 (+-0.100)", "gsm8k exact_match,strict-match 0.1250 (+-0.050)"]


def test_tensorboards_writer_thread_failing_on_a_full_disk_prints_no_traceback(tmp_path, caplog, monkeypatch):
    """The real writer: its thread's failed write (ENOSPC) is kept for the next call, which warns once; the thread's
    own re-raise prints nothing (it printed a traceback into the run's log beside the warning)."""
    import errno
    import threading

    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer.record_writer import RecordWriter

    from fsdp_trainer.sinks import TensorBoard

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    printed = []  # what threading's hook would print, as pytest's own hook would catch it
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.exc_value))
    sink = TensorBoard.open(str(tmp_path / "tensorboard"), 0)
    monkeypatch.setattr(RecordWriter, "write", full)
    with caplog.at_level("WARNING", logger="fsdp_trainer"):
        sink.write({"step": 1, "loss": 1.0})
        sink.writer.file_writer.event_writer._async_writer._worker.join(timeout=60)  # the thread, ended by the error
        sink.write({"step": 2, "loss": 2.0})
    assert printed == []
    assert [r.message for r in caplog.records if "No space left" in r.message] == [
        f"{tmp_path / 'tensorboard'}: No space left on device; TensorBoard gets no records until there is room "
        "(metrics.jsonl keeps them all)"
    ]
    sink.close()


def test_a_full_disk_drops_tensorboards_writer_and_a_new_one_takes_the_records_once_there_is_room(caplog):
    """TensorBoard's writer fails for good once a write fails (from its own thread, on a later call): on a full disk
    the run goes on, warned once, and a new writer (a new events file) takes the records when one can be made; any
    other error is the run's."""
    import errno

    from fsdp_trainer.sinks import TensorBoard

    class Writer:
        def __init__(self, fails: int):
            self.scalars, self.fails, self.closed = [], fails, False

        def add_scalar(self, tag, value, step):
            if self.fails:
                self.fails -= 1
                raise OSError(errno.ENOSPC, "No space left on device")
            self.scalars.append((tag, value, step))

        def close(self):
            self.closed = True

    made = []

    def reopen():
        if len(made) < 1:  # the disk is still full: no new events file either
            made.append(None)
            raise OSError(errno.ENOSPC, "No space left on device")
        made.append(Writer(0))
        return made[-1]

    first = Writer(fails=1)
    sink = TensorBoard(first, reopen, "out/tensorboard")
    with caplog.at_level("WARNING", logger="fsdp_trainer"):
        for step in (1, 2, 3):
            sink.write({"step": step, "loss": float(step)})
    assert first.closed and first.scalars == [] and made[0] is None
    assert made[1].scalars == [("loss/train", 3.0, 3)]
    warnings = [r.message for r in caplog.records if "tensorboard" in r.message]
    assert warnings == [
        "out/tensorboard: No space left on device; TensorBoard gets no records until there is room "
        "(metrics.jsonl keeps them all)"
    ]
    broken = TensorBoard(Writer(0), reopen, "out/tensorboard")
    broken.writer.add_scalar = lambda *a: (_ for _ in ()).throw(OSError(errno.EACCES, "Permission denied"))
    with pytest.raises(OSError, match="Permission denied"):
        broken.write({"step": 1, "loss": 1.0})


def test_the_progress_bars_rate_counts_from_the_first_steady_step(capsys):
    from fsdp_trainer.sinks import ProgressBar

    bar = ProgressBar(total_steps=10, start_step=0)
    try:
        bar.update(1)
        bar.bar.start_t -= 900  # a first step that compiled for 15 minutes
        bar.steady(1)
        bar.update(3)
        assert bar.bar.n == 3 and bar.bar.initial == 1 and bar.bar.format_dict["elapsed"] < 60
    finally:
        bar.close()


def test_eval_on_start_logs_the_starting_models_evaluation_as_step_0_once(tiny_data, tmp_path):
    """At lr 1e-30 the weights after step 1 are those before it, so the evaluation before the first step (step 0) equals
    step 1's exactly; resumed, the run does not evaluate its start again."""
    zero_lr = {"lr": 1e-30, "min_lr": 1e-30, "warmup_steps": 0}  # in fp32, no change to any weight
    every = {"eval_every": 1, "eval_on_start": True}
    train_cli(run_args(tiny_data, tmp_path, 1, optim=zero_lr, train=every, checkpoint={"every": 1}))
    train_cli(run_args(tiny_data, tmp_path, 2, optim=zero_lr, train=every, checkpoint={"every": 1}))
    evals = [(r["step"], r["val_loss"]) for r in read_metrics(tmp_path) if "val_loss" in r]
    assert [step for step, _ in evals] == [0, 1, 2], evals
    assert evals[0][1] == evals[1][1] == evals[2][1]
