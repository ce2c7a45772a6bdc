"""sentencepiece BPE: train a tokenizer on text, encode text to ids and back."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from fsdp_trainer.files import file_sha256

FILE_NAME = "tokenizer.model"
"""What a sentencepiece model is called inside a checkpoint and an HF directory."""


def train_tokenizer(text_files: list[str], model_path: str, vocab_size: int, max_sentences: int = 400_000) -> None:
    """Train a byte-fallback BPE model on `text_files` and write it to `model_path` (a `.model` file).

    Newlines are a token of their own and the text is not normalised, so decode(encode(text)) == text: plays keep
    their line structure, and generated text has it too.
    """
    model_path = Path(model_path)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=model_path.parent) as tmp:
        prefix = os.path.join(tmp, "sp")
        spm.SentencePieceTrainer.train(
            input=",".join(text_files),
            model_prefix=prefix,
            vocab_size=vocab_size,
            model_type="bpe",
            character_coverage=1.0,
            byte_fallback=True,  # any byte is encodable, so unseen characters never become <unk>
            split_digits=True,
            user_defined_symbols=["\n"],
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,  # so encoding paragraph by paragraph gives the ids of the whole text
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
        os.replace(prefix + ".model", model_path)  # atomic: a reader never sees half a tokenizer


class Tokenizer:
    """A trained sentencepiece model."""

    def __init__(self, model_path: str | os.PathLike):
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"tokenizer {model_path} does not exist; run tools/prepare_data.py first")
        self.path = str(model_path)
        self.sp = spm.SentencePieceProcessor(model_file=self.path)
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()

    def sha256(self) -> str:
        return file_sha256(self.path)

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode(list(ids))

    def encode_document(self, text: str, batch_chars: int = 1 << 20) -> list[int]:
        """Encode a long text and append end-of-sequence. Splits at blank lines (never inside a word) to keep
        sentencepiece's inputs short; the pieces concatenate to exactly the ids of the text."""
        paragraphs = [p + "\n\n" for p in text.split("\n\n")]
        paragraphs[-1] = paragraphs[-1][:-2]
        ids: list[int] = []
        batch, size = [], 0
        for p in paragraphs:
            batch.append(p)
            size += len(p)
            if size >= batch_chars:
                ids.extend(i for piece in self.sp.encode(batch) for i in piece)
                batch, size = [], 0
        ids.extend(i for piece in self.sp.encode(batch) for i in piece)
        ids.append(self.eos_id)
        return ids
