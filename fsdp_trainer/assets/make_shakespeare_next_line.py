"""How shakespeare_next_line.jsonl.gz was made from shakespeare.txt.gz (run from the repository root; deterministic):

    python fsdp_trainer/assets/make_shakespeare_next_line.py

A multiple-choice task for the CPU walk-through's evaluation (fsdp_trainer/evaluation/tasks.py): the four lines
before a line of verse as the context, and that line among four choices, the other three the same words in another
order. Drawn from the corpus' last 5% of lines, which `make demo`'s validation split holds (so the demo model never
trains on them). The score rises as a model learns how English verse runs: the debug recipe's untrained model scores
0.44 (above the 0.25 of a blind guess, since a shuffled line tends to take more tokens), `make demo`'s 0.95.
"""

import gzip
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
CONTEXT_LINES, CHOICES, ITEMS = 4, 4, 500


def is_verse(line: str) -> bool:
    """A line of a speech, long enough to be told apart: not a speaker's name, a stage direction or a scene's title."""
    words = line.split()
    return (
        len(line) >= 24
        and len(set(line.split())) >= 5  # enough words for three other orders
        and "[" not in line
        and "]" not in line
        and not words[0].isupper()  # DUKE., SCENE 3., ACT I.
        and any(c.islower() for c in line)
    )


def shufflings(line: str, n: int, rng: random.Random) -> list[str]:
    """`n` different orders of the line's words, none the line's own."""
    words, found = line.split(), set()
    while len(found) < n:
        rng.shuffle(words)
        if " ".join(words) != line:
            found.add(" ".join(words))
    return sorted(found)


def main(seed: int = 0) -> None:
    rng = random.Random(seed)
    with gzip.open(HERE / "shakespeare.txt.gz", "rt") as f:
        lines = [line.strip() for line in f]
    held_out = [line for line in lines[int(0.95 * len(lines)) :] if line]
    verse = [i for i in range(CONTEXT_LINES, len(held_out)) if is_verse(held_out[i])]
    with gzip.GzipFile(HERE / "shakespeare_next_line.jsonl.gz", "wb", mtime=0) as f:
        for i in sorted(rng.sample(verse, ITEMS)):
            target = held_out[i]
            choices = [target, *shufflings(target, CHOICES - 1, rng)]
            rng.shuffle(choices)
            item = {
                "context": "\n".join(held_out[i - CONTEXT_LINES : i]),
                "choices": choices,
                "label": choices.index(target),
            }
            f.write((json.dumps(item) + "\n").encode())


if __name__ == "__main__":
    main()
