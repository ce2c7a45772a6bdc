"""Text -> train/val token files, at the paths a recipe's `data` section names, with its tokenizer.

    python tools/prepare_data.py --recipe recipes/debug.yaml                 # the bundled Shakespeare corpus
    python tools/prepare_data.py --recipe recipes/125m.yaml --input a.txt b.jsonl.gz [--data.train_path X ...]
    python tools/prepare_data.py --recipe R --data.tokenizer_path imported --input my/*.txt   # a model's own tokenizer

Any recipe key can be overridden as in training. The tokenizer at data.tokenizer_path is used as it is; a
sentencepiece one is trained there only when none exists. See fsdp_trainer.data.prepare.
"""

from __future__ import annotations

from dataclasses import fields

from fsdp_trainer.config import one_line_errors, parse_args, recipe_parser
from fsdp_trainer.data.options import PrepareOptions
from fsdp_trainer.data.prepare import (
    BUNDLED_CHAT,
    BUNDLED_CORPUS,
    BUNDLED_PREFERENCES,
    BUNDLED_PROMPTS,
    BUNDLED_UNPAIRED,
    prepare,
)

BUNDLED = {
    "text": BUNDLED_CORPUS,
    "chat": BUNDLED_CHAT,
    "preference": BUNDLED_PREFERENCES,
    "unpaired": BUNDLED_UNPAIRED,
    "prompts": BUNDLED_PROMPTS,
}


def main(argv: list[str] | None = None) -> None:
    parser = recipe_parser("tools/prepare_data.py", __doc__.split("\n\n")[0])
    parser.add_argument(
        "--input",
        nargs="+",
        help="files or globs: .txt, .jsonl, .json, .parquet, gzipped or not (a document per record; with --format chat "
        "a conversation, with --format preference a prompt / chosen / rejected pair, with --format unpaired a prompt / "
        "completion / label record, with --format prompts a prompt and its columns); default: the bundled Shakespeare "
        "corpus (--format chat: its conversations; --format preference: pairs made from them; --format unpaired: those "
        "pairs split into labelled answers; --format prompts: the digit-reversal prompts of docs/online_rl.md)",
    )
    parser.add_class_arguments(PrepareOptions, nested_key=None, skip={"inputs"})  # its docstrings are --help
    recipe, args = parse_args(parser, argv)
    with one_line_errors():
        options = PrepareOptions(
            inputs=args.input or [str(BUNDLED.get(args.format, BUNDLED_CORPUS))],
            **{field.name: args[field.name] for field in fields(PrepareOptions) if field.name != "inputs"},
        )
        prepare(recipe, options)


if __name__ == "__main__":
    main()
