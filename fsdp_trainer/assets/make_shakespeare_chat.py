"""How shakespeare_chat.jsonl.gz was made from shakespeare.txt.gz (run from the repository root; deterministic):

    python fsdp_trainer/assets/make_shakespeare_chat.py

"Continue this passage" conversations: a user gives a few lines of a play, the assistant answers with the lines that
follow; a third have a system message, a quarter a second round. It is the chat set of the fine-tuning demo and tests.
"""

import gzip
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
SYSTEM = "You continue passages of Shakespeare's plays in his words."


def main(n: int = 2000, seed: int = 0) -> None:
    lines = [line for line in gzip.open(HERE / "shakespeare.txt.gz", "rt").read().splitlines() if line.strip()]
    rng = random.Random(seed)
    with gzip.GzipFile(HERE / "shakespeare_chat.jsonl.gz", "wb", mtime=0) as f:
        for _ in range(n):
            at, k = rng.randrange(len(lines) - 40), rng.randint(2, 5)
            messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 1 / 3 else []
            for _ in range(2 if rng.random() < 1 / 4 else 1):
                given, following = lines[at : at + k], lines[at + k : at + 2 * k]
                messages.append({"role": "user", "content": "Continue this passage:\n" + "\n".join(given)})
                messages.append({"role": "assistant", "content": "\n".join(following)})
                at += 2 * k
            f.write((json.dumps({"messages": messages}) + "\n").encode())


if __name__ == "__main__":
    main()
