"""How shakespeare_preferences.jsonl.gz was made from shakespeare_chat.jsonl.gz (run from the repository root;
deterministic):

    python fsdp_trainer/assets/make_shakespeare_preferences.py

Preference pairs in TRL's conversational layout ({"prompt": messages, "chosen": [answer], "rejected": [answer]}): each
conversation of the chat set up to its last answer is the prompt; the chosen answer is the lines that follow in the
play, the rejected one the same lines with the words of each line shuffled. A model tells them apart by word order
alone, so the demo's preference run shows its reward accuracy rise above 0.5 within minutes on a CPU.
"""

import gzip
import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def shuffled(answer: str, rng: random.Random) -> str:
    lines = []
    for line in answer.split("\n"):
        words = line.split()
        for _ in range(10):  # a line of repeated words may shuffle into itself: try again, then keep it
            rng.shuffle(words)
            if " ".join(words) != " ".join(line.split()):
                break
        lines.append(" ".join(words))
    return "\n".join(lines)


def main(seed: int = 0) -> None:
    rng = random.Random(seed)
    with gzip.open(HERE / "shakespeare_chat.jsonl.gz", "rt") as f:
        conversations = [json.loads(line)["messages"] for line in f]
    with gzip.GzipFile(HERE / "shakespeare_preferences.jsonl.gz", "wb", mtime=0) as f:
        for messages in conversations:
            prompt, answer = messages[:-1], messages[-1]["content"]
            pair = {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": shuffled(answer, rng)}],
            }
            f.write((json.dumps(pair) + "\n").encode())


if __name__ == "__main__":
    main()
