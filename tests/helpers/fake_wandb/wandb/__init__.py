"""A stand-in for the wandb package in tests, which have no network and no account: it records each call the trainer
makes, one JSON line per call, to the file $FAKE_WANDB_LOG. Put its parent directory first on PYTHONPATH."""

import json
import os


def _record(**entry) -> None:
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps(entry, default=str) + "\n")


class Run:
    def __init__(self, run_id: str):
        self.id = run_id

    def log(self, data: dict, step: int | None = None) -> None:
        _record(call="log", step=step, data=data, pid=os.getpid())

    def finish(self) -> None:
        _record(call="finish", pid=os.getpid())


def init(**kwargs) -> Run:
    _record(call="init", pid=os.getpid(), **kwargs)
    return Run(kwargs.get("id") or kwargs["resume_from"].split("?")[0])
