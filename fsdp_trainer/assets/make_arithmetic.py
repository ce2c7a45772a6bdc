"""How arithmetic_sft.jsonl.gz and arithmetic_prompts.jsonl.gz were made (run from the repository root; deterministic):

    python fsdp_trainer/assets/make_arithmetic.py

A verifiable task for the online-RL walk-through (docs/online_rl.md): the sum of two numbers below 100, asked as
"What is 47 + 38?", answered "#### 85" (GSM8K's final-answer form, which fsdp_trainer.rewards:exact_answer reads).
Of the 10,000 problems, SFT_PROBLEMS are conversations for a short SFT that teaches the form (and some sums), and
PROMPT_PROBLEMS others are prompt records (TRL's layout: the question as messages, and the `answer` column the reward
checks); preparing those with a validation fraction holds some prompts out of training as the held-out set.
"""

import gzip
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
SFT_PROBLEMS, PROMPT_PROBLEMS = 4000, 3000


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def main(seed: int = 0) -> None:
    problems = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(problems)
    sft, prompts = problems[:SFT_PROBLEMS], problems[SFT_PROBLEMS : SFT_PROBLEMS + PROMPT_PROBLEMS]
    with gzip.GzipFile(HERE / "arithmetic_sft.jsonl.gz", "wb", mtime=0) as f:
        for a, b in sft:
            messages = [{"role": "user", "content": question(a, b)}, {"role": "assistant", "content": f"#### {a + b}"}]
            f.write((json.dumps({"messages": messages}) + "\n").encode())
    with gzip.GzipFile(HERE / "arithmetic_prompts.jsonl.gz", "wb", mtime=0) as f:
        for a, b in prompts:
            record = {"prompt": [{"role": "user", "content": question(a, b)}], "answer": str(a + b)}
            f.write((json.dumps(record) + "\n").encode())


if __name__ == "__main__":
    main()
