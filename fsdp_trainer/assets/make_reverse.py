"""How reverse_sft.jsonl.gz and reverse_prompts.jsonl.gz were made (run from the repository root; deterministic):

    python fsdp_trainer/assets/make_reverse.py

A verifiable task for the online-RL walk-through (docs/online_rl.md): a string of four digits written backwards,
asked as "Reverse 4821", answered "#### 1284" (GSM8K's final-answer form, which fsdp_trainer.rewards:exact_answer
reads). Of the 10,000 strings, SFT_PROBLEMS are conversations for a short SFT that teaches the form and part of the
skill (make demo's model, 200 steps: 15% of held-out strings right, greedy), and PROMPT_PROBLEMS others are prompt
records (TRL's layout: the question as messages, and the `answer` column the reward checks); preparing those with a
validation fraction holds some out of training as the held-out set. (The sum of two numbers below 100, tried first,
stays at 1% after the same SFT: too little for rewards to find.)
"""

import gzip
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
SFT_PROBLEMS, PROMPT_PROBLEMS = 4000, 3000


def main(seed: int = 0) -> None:
    strings = [f"{n:04d}" for n in range(10_000)]
    random.Random(seed).shuffle(strings)
    sft, prompts = strings[:SFT_PROBLEMS], strings[SFT_PROBLEMS : SFT_PROBLEMS + PROMPT_PROBLEMS]
    with gzip.GzipFile(HERE / "reverse_sft.jsonl.gz", "wb", mtime=0) as f:
        for s in sft:
            answer = {"role": "assistant", "content": f"#### {s[::-1]}"}
            messages = [{"role": "user", "content": f"Reverse {s}"}, answer]
            f.write((json.dumps({"messages": messages}) + "\n").encode())
    with gzip.GzipFile(HERE / "reverse_prompts.jsonl.gz", "wb", mtime=0) as f:
        for s in prompts:
            record = {"prompt": [{"role": "user", "content": f"Reverse {s}"}], "answer": s[::-1]}
            f.write((json.dumps(record) + "\n").encode())


if __name__ == "__main__":
    main()
