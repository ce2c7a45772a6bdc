"""What a log record says about the steps of its window: the step times behind the spread bench.py reports."""

from __future__ import annotations

import json
import time

import pytest
import torch

from fsdp_trainer.config import ModelConfig
from fsdp_trainer.metrics import Metrics, StepTimer
from tests.conftest import TINY_MODEL

CPU = torch.device("cpu")


def test_step_timer_times_each_step_since_the_window_opened():
    timer = StepTimer(CPU)
    timer.restart()
    for pause in (0.05, 0.15):
        time.sleep(pause)
        timer.mark()
    first, second = timer.durations()
    assert first >= 0.05 and second >= 0.15
    timer.restart()  # the time between windows (a log step, an evaluation) belongs to no step
    assert timer.durations() == []
    timer.mark()
    assert len(timer.durations()) == 1


def test_a_log_record_carries_the_median_and_largest_step_time_of_its_window(tmp_path):
    metrics = Metrics(str(tmp_path), ModelConfig(**TINY_MODEL), 32, 64, 1, CPU, True, total_steps=6,
                      progress_bar=False)  # fmt: skip
    metrics.reset_clock(0)
    time.sleep(0.5)  # an evaluation, after which the trainer resets the clock: no step's time
    metrics.reset_clock(0)
    for step, pause in enumerate((0.01, 0.2, 0.01), start=1):
        time.sleep(pause)
        metrics.advance(step)
    record = metrics.log(3, loss=1.0, lr=1e-3, grad_norm=1.0, peak_mem_gb=0.1)
    assert 0.01 <= record["step_time_s"] < 0.2 <= record["step_time_max_s"] < 0.5
    metrics.close()
    written = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert written["step_time_s"] == pytest.approx(record["step_time_s"])
