"""Score answers with a reward model: a checkpoint (or run directory) of ours, or a consolidated HF directory.

python tools/score.py runs/reward --prompt "Who goes there?" --answer "Nay, answer me: stand, and unfold yourself."
python tools/score.py runs/reward --pairs held_out.jsonl     # TRL's preference records: accuracy and mean margin

Each prompt and answer is rendered as a conversation with the tokenizer's chat template, as prepare_data.py renders
it for training, and scored at its last token.
"""

from __future__ import annotations

import json

import torch
from jsonargparse import ArgumentParser

from fsdp_trainer.checkpoint.holds import reading
from fsdp_trainer.config import one_line_errors
from fsdp_trainer.convert import load_model
from fsdp_trainer.data.chat import BadConversation, ChatEncoder, preference_of
from fsdp_trainer.generation import score


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="tools/score.py", description=__doc__.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("path", help="run directory, checkpoint directory, or HF model directory of a reward model")
    parser.add_argument("--prompt", type=str | None, default=None, help="a user's turn")
    parser.add_argument("--answer", type=str | None, default=None, help="the assistant's answer to score")
    parser.add_argument("--pairs", type=str | None, default=None, help="a .jsonl of preference records to rank")
    with one_line_errors():
        args = parser.parse_args(argv)
        if (args.pairs is None) == (args.prompt is None or args.answer is None):
            raise ValueError("give --prompt and --answer, or --pairs FILE")
        with reading(args.path, "tools/score.py") as path:
            model, tokenizer = load_model(path)
        encoder = ChatEncoder(tokenizer)

        def reward(messages: list[dict]) -> float:
            ids = torch.from_numpy(encoder.encode_messages(messages)[0][-model.cfg.max_seq_len :])
            return score(model, [ids]).item()

        if args.pairs is None:
            messages = [{"role": "user", "content": args.prompt}, {"role": "assistant", "content": args.answer}]
            print(f"{reward(messages):.6g}")
            return
        margins = []
        with open(args.pairs) as f:
            for line_number, line in enumerate(f, 1):
                try:
                    prompt, chosen, rejected = preference_of(json.loads(line))
                except (json.JSONDecodeError, BadConversation) as e:
                    raise ValueError(f"{args.pairs}:{line_number}: {e}") from None
                margins.append(reward(prompt + chosen) - reward(prompt + rejected))
        if not margins:
            raise ValueError(f"{args.pairs} holds no preference records")
    accuracy = sum(margin > 0 for margin in margins) / len(margins)
    print(f"accuracy {accuracy:.3f} over {len(margins)} pairs (chosen scored above rejected), "
          f"mean margin {sum(margins) / len(margins):.4g}")  # fmt: skip


if __name__ == "__main__":
    main()
