"""What online RL rewards: functions that score sampled completions, named by import path, and the built-in ones.

A reward function has TRL's GRPOTrainer signature, so one written for TRL runs here unchanged:

    def reward(prompts, completions, completion_ids, **columns) -> list[float | None]

`prompts` and `completions` are texts, or message lists where the prompt records were conversations (a completion
then is `[{"role": "assistant", "content": text}]`), one per completion (a prompt repeated for each of its samples);
`completion_ids` the sampled token ids; `columns` each other column of the prompt records, as a list aligned with
them (e.g. `answer`). It returns a reward per completion, None where it does not apply (a completion every function
skips has no advantage). A recipe names one as `module:function`, with keyword arguments bound to it (a factory's
settings, as TRL's get_soft_overlong_punishment takes them) and a weight; the rewards are summed with the weights.

Nothing here imports the trainer: a reward module is the user's own code, imported in every process that samples.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class RewardError(ValueError):
    """A reward function that cannot be imported, raised, or returned what is not a reward per completion."""


@dataclass(frozen=True)
class Reward:
    """A reward function as a recipe names it: its import path, the keyword arguments bound to it, its weight."""

    path: str
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def function(self) -> Callable[..., Sequence[float | None]]:
        """The function, imported (RewardError naming the path when it is not there)."""
        module_name, sep, name = self.path.partition(":")
        if not sep or not module_name or not name:
            raise RewardError(f"reward {self.path} is not an import path: write it as module:function")
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # noqa: BLE001 -- whatever the user's module raises on import, named in one line
            raise RewardError(
                f"reward {self.path}: importing {module_name} failed ({type(error).__name__}: {error}); its module "
                "must be importable where training runs (installed, or on PYTHONPATH)"
            ) from error
        function = getattr(module, name, None)
        if not callable(function):
            raise RewardError(f"reward {self.path}: {module_name} has no function {name}")
        return functools.partial(function, **self.args) if self.args else function

    @property
    def name(self) -> str:
        """How its metrics are named (TRL names them by the function's __name__)."""
        return self.path.partition(":")[2]


def score(
    rewards: Sequence[Reward],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
) -> np.ndarray:
    """Each function's reward of each completion, (completions, functions) float64 with NaN where one returned None:
    RewardError naming the function when it raises or does not return a number (or None) per completion."""
    out = np.full((len(completions), len(rewards)), np.nan)
    for k, reward in enumerate(rewards):
        try:
            values = reward.function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except RewardError:
            raise
        except Exception as error:  # noqa: BLE001 -- the user's function: its error, named, in one line
            raise RewardError(f"reward {reward.path} raised {type(error).__name__}: {error}") from error
        values = list(values) if values is not None else None
        if values is None or len(values) != len(completions):
            got = "None" if values is None else f"{len(values)} rewards"
            raise RewardError(
                f"reward {reward.path} returned {got} for {len(completions)} completions: it must return one reward "
                "(a number, or None to skip that completion) per completion"
            )
        for i, value in enumerate(values):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float | np.number) or math.isnan(float(value)):
                raise RewardError(
                    f"reward {reward.path} returned {value!r} for completion {i}: a reward is a number, or None"
                )
            out[i, k] = float(value)
    return out


# --- built-in rewards ---------------------------------------------------------------------------------------------

_NUMBER = r"-?[\d,]*\.?\d+"
_FINAL = re.compile(r"####[ \t]*([^\n]*\S)")


def text_of(completion: str | list[dict]) -> str:
    """A completion's text: itself, or its message's content when the prompts were conversations."""
    return completion if isinstance(completion, str) else "".join(m.get("content", "") for m in completion)


def final_answer(text: str) -> str | None:
    """A text's final answer: the rest of the line after GSM8K's last `####`, else in the last `\\boxed{...}`; None when
    it states none. Numbers lose their thousands separators and a trailing `.0`, so `1,000` and `1000.0` state the same
    answer."""
    found = _FINAL.findall(text)
    if found:
        answer = found[-1]
    else:
        boxed = _last_boxed(text)
        if boxed is None:
            return None
        answer = boxed
    answer = answer.strip().strip("$").strip()
    if re.fullmatch(_NUMBER, answer):
        answer = answer.replace(",", "")
        answer = answer[:-2] if answer.endswith(".0") else answer
    return answer


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # never closed


def expected_answer(gold: object) -> str | None:
    """A record's answer column as a final answer: a GSM8K solution's `#### n`, or the bare answer itself; None when
    it is empty."""
    return final_answer(str(gold)) or final_answer(f"#### {gold}")


def exact_answer(completions: list, answer: list[str], **_) -> list[float | None]:
    """1 where a completion's final answer (`#### ...` or `\\boxed{...}`) is the record's `answer` column's (itself a
    bare answer, or a GSM8K solution ending in `#### n`), else 0; None for a record whose answer is empty."""
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        expected = expected_answer(gold)
        out.append(None if expected is None else float(final_answer(text_of(completion)) == expected))
    return out


def matching_characters(completions: list, answer: list[str], **_) -> list[float | None]:
    """Partial credit: the share of the expected final answer's characters that a completion's final answer has at
    the same places (over the longer of the two), 0 where it states none; None for a record whose answer is empty. A
    dense reward beside exact_answer for answers a short model gets partly right (a string reversed)."""
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        expected, given = expected_answer(gold), final_answer(text_of(completion))
        if expected is None:
            out.append(None)
            continue
        given = given or ""
        out.append(sum(a == b for a, b in zip(expected, given, strict=False)) / max(len(expected), len(given)))
    return out


def math_equal(completions: list, answer: list[str], **_) -> list[float | None]:
    """1 where a completion's final answer (its last `\\boxed{...}` or `#### ...`) equals the record's `answer` as
    mathematics (1/2, 0.5 and \\frac{1}{2} alike), else 0; None for a record whose answer does not parse (an answer
    of bare LaTeX, \\sqrt{2}, is read as math). math-verify parses and compares them, as TRL's accuracy_reward does
    (the optional extra `pip install -e ".[math]"`)."""
    try:
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise ImportError("fsdp_trainer.rewards:math_equal needs math-verify: pip install -e '.[math]'") from None
    boxed = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        expected = expected_answer(gold)
        gold_parsed = (parse(expected) or parse(f"${expected}$")) if expected is not None else []  # bare LaTeX too
        if not gold_parsed:
            out.append(None)
            continue
        given = final_answer(text_of(completion))
        given_parsed = parse(f"\\boxed{{{given}}}", extraction_config=boxed) if given is not None else []
        out.append(float(bool(given_parsed) and verify(gold_parsed, given_parsed)))
    return out


def answer_format(completions: list, **_) -> list[float]:
    """1 where a completion states a final answer as `exact_answer` reads one (`#### n` or `\\boxed{...}`), else 0: the
    format reward that teaches the form before the answers are right."""
    return [float(final_answer(text_of(completion)) is not None) for completion in completions]


def overlong_penalty(completion_ids: list[list[int]], max_length: int, buffer: int, **_) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; TRL's get_soft_overlong_punishment): 0 up to
    max_length - buffer tokens, then falling linearly to -1 at max_length, -1 beyond. Bind max_length (the longest
    completion sampled) and buffer in the recipe's reward args."""
    if not 0 <= buffer <= max_length:
        raise RewardError(f"overlong_penalty: buffer={buffer} must be in [0, max_length={max_length}]")
    out = []
    for ids in completion_ids:
        n = len(ids)
        if n <= max_length - buffer:
            out.append(0.0)
        elif n <= max_length:
            out.append((max_length - buffer - n) / buffer)
        else:
            out.append(-1.0)
    return out
