"""Reward functions the GRPO tests name in their recipes (`module:function`), in a module of their own: a run imports
it to score, without what the test modules import (TRL, pytest)."""


def digit_reward(prompts, completions, completion_ids, **_):
    """A reward that differs within a group of random completions: the first token's id mod 3; None for the sixth
    completion, which sometimes_none skips too: no function scores it."""
    return [None if i == 5 else float(ids[0] % 3) for i, ids in enumerate(completion_ids)]


def sometimes_none(prompts, completions, completion_ids, answer, **_):
    """Skips every fifth completion (None), else the length of the completion's text in tens of characters and the
    record's `answer` column as a number: a column travels to the functions."""
    pairs = enumerate(zip(completions, answer, strict=True))
    return [None if i % 5 == 0 else len(text) / 10 + float(a) for i, (text, a) in pairs]


def one_reward(completions, **_):
    return [1.0]


def texts(completions, **_):
    return completions
