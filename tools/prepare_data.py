"""Text -> train/val token files, at the paths a recipe's `data` section names, with its tokenizer.

    python tools/prepare_data.py --recipe recipes/debug.yaml                 # the bundled Shakespeare corpus
    python tools/prepare_data.py --recipe recipes/125m.yaml --input a.txt b.jsonl.gz [--data.train_path X ...]
    python tools/prepare_data.py --recipe R --data.tokenizer_path imported --input my/*.txt   # a model's own tokenizer

Any recipe key can be overridden as in training. The tokenizer at data.tokenizer_path is used as it is; a
sentencepiece one is trained there only when none exists. See fsdp_trainer.data.prepare.
"""

from __future__ import annotations

from fsdp_trainer.config import one_line_errors, parse_args, recipe_parser
from fsdp_trainer.data.prepare import BUNDLED_CHAT, BUNDLED_CORPUS, prepare


def main(argv: list[str] | None = None) -> None:
    parser = recipe_parser("tools/prepare_data.py", __doc__.split("\n\n")[0])
    parser.add_argument(
        "--input",
        nargs="+",
        help="files or globs: .txt (one document each), .jsonl (a document or conversation per record, gzipped or "
        "not), .parquet (one per row); default: the bundled Shakespeare corpus (--format chat: its conversations)",
    )
    parser.add_argument("--text_key", default="text", help="the field of a .jsonl record that holds its text")
    parser.add_argument("--val_fraction", type=float, default=0.05, help="tail of each document kept for validation")
    parser.add_argument(
        "--vocab_size", type=int | None, help="tokenizer vocabulary (default: model.vocab_size; or fewer)"
    )
    parser.add_argument(
        "--force", type=bool, nargs="?", const=True, default=False, help="rebuild even if the outputs are up to date"
    )
    parser.add_argument("--workers", type=int | None, help="tokenizing processes (default: all cores)")
    parser.add_argument(
        "--shard_tokens",
        type=int,
        default=50_000_000,
        help="tokens per training shard when a data path is a directory (uint16: 100 MB); validation shards hold "
        "shard_tokens x val_fraction, so both outputs complete shards at the same pace through the input and a restart "
        "redoes at most about one shard of it",
    )
    parser.add_argument(
        "--skip_bad_records",
        type=bool,
        nargs="?",
        const=True,  # a bare flag means true
        default=False,
        help="skip (and count) records without text instead of stopping at the first",
    )
    parser.add_argument(
        "--format",
        default="text",
        help="text: documents; chat: conversations ({messages: [{role, content}]} or {prompt, response} records), "
        "rendered with the tokenizer's chat template and packed into data.seq_len windows",
    )
    parser.add_argument(
        "--train_on", default="assistant", help="chat: the tokens trained on, assistant (its turns) or all"
    )
    parser.add_argument(
        "--long_examples",
        default="truncate",
        help="chat: a conversation longer than data.seq_len is truncated to it, or dropped (drop); both counted",
    )
    recipe, args = parse_args(parser, argv)
    inputs = args.input or [str(BUNDLED_CHAT if args.format == "chat" else BUNDLED_CORPUS)]
    with one_line_errors():
        prepare(
            recipe,
            inputs,
            args.val_fraction,
            args.vocab_size,
            args.force,
            args.text_key,
            args.workers,
            args.shard_tokens,
            args.skip_bad_records,
            args.format,
            args.train_on,
            args.long_examples,
        )


if __name__ == "__main__":
    main()
