"""The benchmark tasks a run is scored on, through lm-evaluation-harness: any task of lm-eval's registry (its
datasets come from the Hugging Face Hub, or from a local copy, docs/evaluation.md says how), a task of the user's
own (a YAML file in a directory given as `include_path`), or one this package ships, which needs no download.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

from fsdp_trainer.sinks import scores_by_task

if TYPE_CHECKING:  # lm-eval is an optional extra: imported where a task is scored
    from lm_eval.api.model import LM

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def next_line_task() -> dict:
    """shakespeare_next_line: four lines of a held-out play as the context, and the line that follows them among
    four, the other three its words in another order (assets/make_shakespeare_next_line.py): 500 items;
    `acc` by summed log-probability, `acc_norm` by log-probability per byte of the choice."""
    return {
        "task": "shakespeare_next_line",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(ASSETS / "shakespeare_next_line.jsonl.gz")}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{context}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "target_delimiter": "\n",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }


SHIPPED = {"shakespeare_next_line": next_line_task}
"""The tasks this package ships, by name."""


@functools.cache
def registry(include_path: str | None = None, defaults: bool = True):
    """lm-eval's TaskManager over `include_path` and, with `defaults`, its own registry: indexing its thousands of task
    files takes seconds, so a process does it once, and not at all for our tasks alone."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def require_lm_eval() -> None:
    """ModuleNotFoundError saying how to install lm-eval, where it is not."""
    try:
        import lm_eval  # noqa: F401
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"scoring tasks needs lm-eval ({e}): pip install -e '.[eval]'") from None


def task_manager(tasks: list[str], include_path: str | None = None):
    """lm-eval's TaskManager for `tasks`: over `include_path` alone where it (with ours) has them all, as lm-eval's own
    `--include_path` can be told (indexing its registry of thousands of tasks takes a minute on a loaded machine),
    else with lm-eval's registry too."""
    local = registry(include_path, defaults=False)
    if all(name in SHIPPED or (include_path is not None and local.match_tasks([name])) for name in tasks):
        return local
    return registry(include_path)


def check_tasks(tasks: list[str], include_path: str | None = None) -> None:
    """Every name in `tasks` is shipped here or known to lm-eval (its registry, `include_path`): else ValueError
    naming the unknown ones (ModuleNotFoundError without lm-eval). A name that none of lm-eval's task files
    mentions is unknown without indexing its registry, so a misspelt name is one line in a second."""
    require_lm_eval()
    local = registry(include_path, defaults=False)
    unknown = [name for name in tasks if name not in SHIPPED and not local.match_tasks([name])]
    if any(is_pattern(name) or mentioned(name, lm_eval_tasks_dir()) for name in unknown):
        manager = registry(include_path)
        unknown = [name for name in unknown if not manager.match_tasks([name])]
    if unknown:
        raise ValueError(
            f"no task named {', '.join(unknown)} in lm-eval's registry, in the include path or among ours "
            f"({', '.join(SHIPPED)}); `lm-eval ls tasks` lists lm-eval's"
        )


def is_pattern(name: str) -> bool:
    """Whether lm-eval reads `name` as a glob over its task names."""
    return any(c in name for c in "*?[")


def lm_eval_tasks_dir() -> Path:
    """The directory of lm-eval's registry: its task files."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def mentioned(name: str, root: Path) -> bool:
    """Whether a file under `root` has `name` in its text. lm-eval indexes every task, group and tag by a name
    written in its YAML files or in a file one includes (okapi's `_arc_yaml`), so a name that none has is not in its
    index: reading the bytes takes a twentieth of the time that parsing them (as indexing does) takes."""
    needle = name.encode()
    for directory, subdirectories, files in os.walk(root, followlinks=True):
        subdirectories[:] = [d for d in subdirectories if d != "__pycache__"]
        if any(needle in (Path(directory) / file).read_bytes() for file in files):
            return True
    return False


def evaluate(
    lm: LM,
    tasks: list[str],
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    apply_chat_template: bool = False,
    include_path: str | None = None,
    seeds: list[int | None] | None = None,
    log_samples: bool = False,
    describe_machine: bool = True,
) -> dict | None:
    """lm-eval's results (its JSON) for `tasks` scored by `lm`, on rank 0 (None on the others): `limit` items of
    each task (a fraction when below 1), `num_fewshot` examples before each (the task's own number when None); `seeds`
    for Python, numpy, torch and the few-shot draw (None: lm-eval's own defaults, 0, 1234, 1234, 1234, so that a task
    picks the examples `lm_eval` picks); with `log_samples`, each document's result under "samples". Without
    `describe_machine`, the results lack lm-eval's description of the machine (torch's collect_env: `pip list`, nvcc,
    lscpu, about a second of rank 0's time while the other ranks wait, more on a cluster's shared filesystem), which
    scores taken while training do not keep."""
    from lm_eval import simple_evaluate
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

    if limit is not None and limit >= 1:
        limit = int(limit)  # lm-eval reads a float as a fraction

    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its INFO lines: a few per request type and task
    skipped = contextlib.nullcontext() if describe_machine else mock.patch("lm_eval.evaluator.add_env_info")
    with skipped:
        return simple_evaluate(
            model=lm,
            tasks=[SHIPPED[name]() if name in SHIPPED else name for name in tasks],
            num_fewshot=num_fewshot,
            limit=limit,
            apply_chat_template=apply_chat_template,
            task_manager=task_manager(tasks, include_path),
            random_seed=seeds[0] if seeds else DEFAULT_RANDOM_SEED,
            numpy_random_seed=seeds[1] if seeds else DEFAULT_OTHER_SEED,
            torch_random_seed=seeds[2] if seeds else DEFAULT_OTHER_SEED,
            fewshot_random_seed=seeds[3] if seeds else DEFAULT_OTHER_SEED,
            log_samples=log_samples,
        )


def task_numbers(results: dict) -> dict[str, float]:
    """lm-eval's results as {eval/TASK/METRIC: value}: `acc,none` as eval/TASK/acc, a filter other than `none`
    appended (eval/gsm8k/exact_match,strict-match), standard errors as METRIC_stderr."""
    numbers = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, comma, kept = key.partition(",")
            if comma and isinstance(value, (int, float)):
                numbers[f"eval/{task}/{metric}" + ("" if kept == "none" else f",{kept}")] = float(value)
    return numbers


def result_lines(results: dict) -> list[str]:
    """A line per task: each metric with its standard error, as `task: acc 0.412 (+-0.022), acc_norm ...`."""
    return [f"{task}: {shown}" for task, shown in scores_by_task(task_numbers(results)).items()]
