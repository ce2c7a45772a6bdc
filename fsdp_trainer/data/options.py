"""The options of a data preparation beside the recipe (tools/prepare_data.py), typed and checked as a recipe section
is; prepare.py and the worker pool (encode.py) read them whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fsdp_trainer.data.chat import check_options


@dataclass
class PrepareOptions:
    """How tools/prepare_data.py prepares a corpus: its options beside the recipe, checked as a recipe section is."""

    inputs: list[str]
    """Files or globs: .txt(.gz), .jsonl(.gz), .json(.gz), .parquet (sources.py)."""
    val_fraction: float = 0.05
    """Share of the documents (or of a single document's tail) that goes to data.val_path."""
    vocab_size: int | None = None
    """A new sentencepiece tokenizer's vocabulary (default: model.vocab_size; or fewer)."""
    force: bool = False
    """Rebuild even if the outputs are up to date."""
    text_key: str = "text"
    """The field of a JSON record, or the parquet column, that holds a document's text."""
    workers: int | None = None
    """Tokenizing processes (default: all cores)."""
    shard_tokens: int = 50_000_000
    """Tokens per training shard when a data path is a directory; validation shards hold shard_tokens x val_fraction,
    so both outputs complete shards at the same pace through the input and a restart redoes at most about one."""
    skip_bad_records: bool = False
    """Skip (and count) bad records instead of stopping at the first."""
    format: Literal["text", "chat", "preference", "unpaired", "prompts"] = "text"
    """text: documents; chat: conversations, rendered with the tokenizer's chat template and packed into
    data.seq_len windows; preference: pairs of answers (prompt / chosen / rejected), each pair's two conversations
    packed together, each up to data.seq_len / 2 tokens; unpaired: single answers labelled good or bad (prompt /
    completion / label, KTO's data), packed as chat examples; prompts: prompts for online RL (TRL's layout: a
    `prompt`, text or messages, and any other columns, which reach the reward functions), a prompt a window of
    data.seq_len, the rest of it the room its completions are sampled into."""
    train_on: str = "assistant"
    """chat: the tokens trained on, assistant (its turns) or all; preference and unpaired: assistant (the answers)
    only."""
    long_examples: str = "truncate"
    """chat: a conversation longer than data.seq_len is truncated to it, or dropped (drop); both counted.
    preference: the same for a pair with a conversation longer than data.seq_len / 2 (truncation keeps its start, as
    TRL's keep_start does)."""

    def __post_init__(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val_fraction={self.val_fraction} must lie in [0, 1)")
        if self.shard_tokens < 1:
            raise ValueError(f"--shard_tokens={self.shard_tokens} must be positive")
        if self.format not in ("text", "chat", "preference", "unpaired", "prompts"):
            raise ValueError(f"--format={self.format!r} must be text, chat, preference, unpaired or prompts")
        if self.format != "text":
            check_options(self.train_on, self.long_examples)
        if self.format == "prompts" and self.train_on != "assistant":
            raise ValueError("--train_on applies to --format chat: prompts are not trained on, only sampled from")
        if self.format in ("preference", "unpaired") and self.train_on != "assistant":
            what = "a preference pair is" if self.format == "preference" else "an unpaired answer is"
            raise ValueError(
                f"--train_on={self.train_on} applies to --format chat: {what} measured on its answers alone (their "
                "log-probabilities given the prompt)"
            )
