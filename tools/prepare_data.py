"""Text -> sentencepiece tokenizer -> train/val token files, at the paths a recipe's `data` section names.

    python tools/prepare_data.py --recipe recipes/debug.yaml                 # the bundled Shakespeare corpus
    python tools/prepare_data.py --recipe recipes/125m.yaml --input a.txt b.txt.gz [--data.train_path X ...]

Any recipe key can be overridden as in training. Each input file is one document; see fsdp_trainer.prepare.
"""

from __future__ import annotations

from fsdp_trainer.config import one_line_errors, parse_args, recipe_parser
from fsdp_trainer.data import BUNDLED_CORPUS
from fsdp_trainer.prepare import prepare


def main(argv: list[str] | None = None) -> None:
    parser = recipe_parser("tools/prepare_data.py", __doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", default=[str(BUNDLED_CORPUS)], help="text files (.txt or .txt.gz)")
    parser.add_argument("--val_fraction", type=float, default=0.05, help="tail of each document kept for validation")
    parser.add_argument(
        "--vocab_size", type=int | None, help="tokenizer vocabulary (default: model.vocab_size; or fewer)"
    )
    parser.add_argument("--force", type=bool, default=False, help="rebuild even if the outputs are up to date")
    recipe, args = parse_args(parser, argv)
    with one_line_errors():
        prepare(recipe, args.input, args.val_fraction, args.vocab_size, args.force)


if __name__ == "__main__":
    main()
