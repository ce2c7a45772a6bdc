"""What a log record says about the steps of its window: the step times behind the spread bench.py reports, and the
throughput, on a clock the test moves (no sleeps)."""

from __future__ import annotations

import json

import pytest
import torch

from fsdp_trainer.config import DataConfig, ModelConfig, ParallelConfig, Recipe, TrainConfig
from fsdp_trainer.files import METRICS_FILE
from fsdp_trainer.metrics import Metrics, StepTimer
from fsdp_trainer.parallel import close_distributed, init_distributed
from tests.helpers import TINY_MODEL

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
        metrics.restart_clock(0)
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
