"""The recipe's `eval` tasks scored while the model trains: on the sharded model itself (no second copy, each forward
pass made by every rank together), every eval.every steps and after the last, as one metrics record of
eval/TASK/METRIC numbers. A resumed run keeps the records up to its checkpoint's step and scores only the steps after
it, so no step is scored twice."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn as nn

from fsdp_trainer.config import EvalConfig
from fsdp_trainer.distributed.parallelize import reshard
from fsdp_trainer.distributed.runtime import DistEnv
from fsdp_trainer.evaluation.lm import ModelLM
from fsdp_trainer.evaluation.tasks import evaluate, task_numbers
from fsdp_trainer.tokenizer import load_tokenizer


class TrainingScores:
    """The eval section's tasks, scored on the model as it trains; `tokenizer_path`: the run's."""

    def __init__(self, cfg: EvalConfig, tokenizer_path: str, env: DistEnv):
        self.cfg, self.tokenizer, self.env = cfg, load_tokenizer(tokenizer_path), env

    def due(self, step: int, last: bool) -> bool:
        return last or (self.cfg.every > 0 and step % self.cfg.every == 0)

    @torch.no_grad()
    def score(self, model: nn.Module) -> dict[str, float] | None:
        """{eval/TASK/METRIC: value} on rank 0 (None elsewhere). Collective. The random states training draws from
        are as they were before: lm-eval seeds Python's, numpy's and torch's generators (its own defaults, as
        tools/evaluate.py and `lm_eval` do, so the scores are the ones they give on the checkpoint). The numbers only:
        not lm-eval's description of the machine, which its results file keeps."""
        cfg = self.cfg
        lm = ModelLM(model, self.tokenizer, cfg.batch_size, cfg.max_gen_toks, lockstep=True, device=self.env.device)
        python_state, numpy_state = random.getstate(), np.random.get_state()
        devices = [self.env.device] if self.env.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            results = evaluate(lm, cfg.tasks, cfg.num_fewshot, cfg.limit, cfg.apply_chat_template, cfg.include_path,
                               describe_machine=False)  # fmt: skip
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        reshard(model)
        return None if results is None else task_numbers(results)
