"""How shakespeare_unpaired.jsonl.gz was made from shakespeare_preferences.jsonl.gz (run from the repository root;
deterministic):

    python fsdp_trainer/assets/make_shakespeare_unpaired.py

Unpaired preference records in TRL's conversational KTO layout ({"prompt": messages, "completion": [answer],
"label": bool}): each pair of the preference set split into its chosen answer (label true: the play's lines) and its
rejected one (label false: the same lines with the words of each line shuffled), the 4,000 records shuffled so that a
batch mixes prompts and labels (KTO estimates its KL term from a batch's prompts with other records' answers).
"""

import gzip
import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def main(seed: int = 0) -> None:
    with gzip.open(HERE / "shakespeare_preferences.jsonl.gz", "rt") as f:
        pairs = [json.loads(line) for line in f]
    records = []
    for pair in pairs:
        for key, label in (("chosen", True), ("rejected", False)):
            records.append({"prompt": pair["prompt"], "completion": pair[key], "label": label})
    random.Random(seed).shuffle(records)
    with gzip.GzipFile(HERE / "shakespeare_unpaired.jsonl.gz", "wb", mtime=0) as f:
        for record in records:
            f.write((json.dumps(record) + "\n").encode())


if __name__ == "__main__":
    main()
