"""Tokenizers behind one interface: a sentencepiece model (`tokenizer.model`, trained here by train_tokenizer or
shipped with a checkpoint) or a Hugging Face tokenizer (`tokenizer.json` through the `tokenizers` package, with
`tokenizer_config.json` beside it for BOS/EOS and whether BOS is added, and the chat template in it or in
`chat_template.jinja`).

`data.tokenizer_path` may name a `.model` file, a `tokenizer.json`, or a directory holding either (an HF checkpoint,
an imported model, a checkpoint step directory); load_tokenizer(path) reads any of them, tokenizer_files(path) lists
the files that travel with a checkpoint, and fingerprint(path) identifies the tokenizer a token file was made with.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path

from fsdp_trainer.files import CONFIG_FILE, file_sha256, published_step

FILE_NAME = "tokenizer.model"
"""What a sentencepiece model is called inside a checkpoint and an HF directory."""
HF_FILE = "tokenizer.json"
HF_CONFIG = "tokenizer_config.json"
HF_CHAT_TEMPLATE = "chat_template.jinja"  # where transformers >= 4.51 saves the chat template, beside the config
HF_FILES = (HF_FILE, HF_CONFIG, "special_tokens_map.json", HF_CHAT_TEMPLATE)
"""An HF tokenizer's files, as they travel with a checkpoint and into an HF directory."""
HF_GENERATION_CONFIG = "generation_config.json"
"""A published model's sampling defaults (eos ids, temperature, top_p): carried from import to export with the
tokenizer, through every checkpoint, but no part of the tokenizer's fingerprint."""

# A tiktoken BPE file (Llama 3's `original/tokenizer.model`) is text: one "base64-token rank" pair per line.
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/=]+ \d+$")


def tokenizer_files(path: str | os.PathLike) -> dict[str, Path]:
    """The files that make up the tokenizer at `path`, keyed by the name they have in a checkpoint or HF directory.

    A directory gives its tokenizer.json (preferred, as transformers prefers it) with the config files beside it,
    else its tokenizer.model; a `.json` file gives itself and a tokenizer_config.json beside it; any other file is a
    sentencepiece model. Raises FileNotFoundError naming the path.
    """
    path = Path(path)
    if path.is_dir():
        if (path / HF_FILE).is_file():
            return {name: path / name for name in HF_FILES if (path / name).is_file()}
        if (path / FILE_NAME).is_file():
            return {FILE_NAME: path / FILE_NAME}
        raise FileNotFoundError(f"tokenizer directory {path} holds neither {HF_FILE} nor {FILE_NAME}")
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer {path} does not exist")
    if path.suffix == ".json":
        beside = {name: path.with_name(name) for name in HF_FILES[1:] if path.with_name(name).is_file()}
        return {HF_FILE: path, **beside}
    return {FILE_NAME: path}


def first_tokenizer(candidates: Iterable[str | os.PathLike | None]) -> Path | None:
    """The first of `candidates` that holds (or is) a tokenizer, or None."""
    for candidate in candidates:
        if candidate is None:
            continue
        try:
            tokenizer_files(candidate)
            return Path(candidate)
        except FileNotFoundError:
            continue
    return None


def saved_tokenizer(checkpoint: str | os.PathLike) -> Path | None:
    """The tokenizer that travels with a checkpoint: in the directory itself (an imported model, a step directory) or
    in the step its `latest` names (a run directory, its checkpoints/); None if there is none."""
    path = Path(checkpoint)
    return first_tokenizer(d for d in (path, published_step(path)) if d is not None and d.is_dir())


def run_tokenizer_path(tokenizer_path: str | None, resume: str, out_dir: str) -> str:
    """data.tokenizer_path, or where it is null the tokenizer of the checkpoint the run starts from: the one
    checkpoint.resume names, else (a run resumed with auto) the one the run recorded in its config.yaml or saved with
    its latest checkpoint. Raises ValueError naming both keys when there is none."""
    if tokenizer_path is not None:
        return tokenizer_path
    if resume not in ("auto", "none") and (found := saved_tokenizer(resume)) is not None:
        return str(found)
    if resume != "none":
        import yaml

        config = Path(out_dir) / CONFIG_FILE
        recorded = yaml.safe_load(config.read_text())["data"]["tokenizer_path"] if config.is_file() else None
        if recorded is not None and os.path.exists(recorded):
            return recorded
        if (found := saved_tokenizer(out_dir)) is not None:
            return str(found)
    raise ValueError(
        f"data.tokenizer_path is null, which means the tokenizer of the checkpoint the run starts from, and "
        f"checkpoint.resume={resume} names no checkpoint that carries one: set data.tokenizer_path, or "
        "checkpoint.resume to the directory tools/import_hf.py wrote"
    )


def fingerprint(path: str | os.PathLike) -> str:
    """sha256 identifying a tokenizer: of its file when it is one file (a sentencepiece model, a lone tokenizer.json),
    else of its files' names and contents."""
    files = tokenizer_files(path)
    if len(files) == 1:
        return file_sha256(next(iter(files.values())))
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{file_sha256(files[name])}\0".encode())
    return h.hexdigest()


class Tokenizer:
    """What every kind of tokenizer offers. `vocab_size` counts every id it can produce, added tokens included: the
    model's vocabulary must cover it."""

    path: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    """What transformers pads a batch of sequences with, which a reward model finds each one's last token by: the
    tokenizer's pad token (sentencepiece's: its unk piece, which the exported tokenizer_config.json declares)."""
    add_bos: bool
    """Whether a document starts with BOS, as the model was pretrained (Llama 3: yes; Qwen3 and ours: no)."""
    threads: int = -1
    """Threads of a batch encode (sentencepiece's; HF's read RAYON_NUM_THREADS); -1: all cores."""

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, with no special token added."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def token(self, token_id: int) -> str:
        """The text of one id as the vocabulary spells it (`<|im_end|>`), for chat templates."""
        raise NotImplementedError

    def encode_prompt(self, text: str) -> list[int]:
        """What a generation starts from: BOS where documents start with one, then the text."""
        return ([self.bos_id] if self.add_bos and self.bos_id is not None else []) + self.encode(text)

    def encode_document(self, text: str) -> list[int]:
        """A training document: BOS first where the tokenizer adds one, then the text, then EOS."""
        return self.encode_prompt(text) + ([self.eos_id] if self.eos_id is not None else [])

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """encode_document of each text, in one call where the tokenizer has a batch encoder."""
        return [self.encode_document(text) for text in texts]

    def fingerprint(self) -> str:
        return fingerprint(self.path)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model. Documents get no BOS (ours were trained without), and end with EOS."""

    def __init__(self, model_path: str | os.PathLike):
        import sentencepiece as spm

        self.path = str(model_path)
        head = Path(model_path).read_bytes()[:4096].splitlines()[:3]
        if head and all(_TIKTOKEN_LINE.match(line) for line in head):
            raise ValueError(
                f"{model_path} is a tiktoken BPE file (Llama 3's original/tokenizer.model), which this trainer does "
                f"not read: point data.tokenizer_path at the checkpoint's {HF_FILE} (or its directory) instead"
            )
        self.sp = spm.SentencePieceProcessor(model_file=self.path)
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.sp.unk_id()
        self.add_bos = False

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode(list(ids))

    def token(self, token_id: int) -> str:
        return self.sp.id_to_piece(token_id)

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

    def encode_documents(self, texts: list[str], long_chars: int = 1 << 16) -> list[list[int]]:
        short = [i for i, text in enumerate(texts) if len(text) < long_chars]
        out: list[list[int]] = [[] for _ in texts]
        encoded = self.sp.encode([texts[i] for i in short], num_threads=self.threads)  # one C++ call
        for i, ids in zip(short, encoded, strict=True):
            out[i] = ids + [self.eos_id]
        for i, text in enumerate(texts):
            if len(text) >= long_chars:
                out[i] = self.encode_document(text)
        return out


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`, with its tokenizer_config.json when there is one beside it."""

    def __init__(self, files: dict[str, Path]):
        from tokenizers import Tokenizer as FastTokenizer

        self.path = str(files[HF_FILE])
        self.tk = FastTokenizer.from_file(self.path)
        self.config = json.loads(files[HF_CONFIG].read_text()) if HF_CONFIG in files else {}
        self.vocab_size = self.tk.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id = self._special_id("bos_token"), self._special_id("eos_token")
        self.pad_id = self._special_id("pad_token", missing_ok=True)  # an export's config.json pad_token_id
        self.chat_template = self.config.get("chat_template")
        if HF_CHAT_TEMPLATE in files:
            self.chat_template = files[HF_CHAT_TEMPLATE].read_text()
        # BOS comes with a document where the config says so, or where the tokenizer's own post-processor adds it to
        # a text (Llama 3's template does; Qwen3 has no BOS).
        with_specials = self.tk.encode("a", add_special_tokens=True).ids
        self.add_bos = self.bos_id is not None and (
            bool(self.config.get("add_bos_token")) or with_specials[:1] == [self.bos_id]
        )

    def _special_id(self, key: str, missing_ok: bool = False) -> int | None:
        token = self.config.get(key)
        if isinstance(token, dict):  # an AddedToken, serialized
            token = token.get("content")
        if token is None:
            return None
        token_id = self.tk.token_to_id(token)
        if token_id is None and not missing_ok:
            raise ValueError(f"{self.path}: {HF_CONFIG} names {key}={token!r}, which the tokenizer does not have")
        return token_id

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=True)

    def token(self, token_id: int) -> str:
        return self.tk.id_to_token(token_id)

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        bos = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        eos = [self.eos_id] if self.eos_id is not None else []
        return [bos + e.ids + eos for e in self.tk.encode_batch(texts, add_special_tokens=False)]


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer at `path`: a sentencepiece `.model`, a `tokenizer.json`, or a directory holding either."""
    files = tokenizer_files(path)
    return HFTokenizer(files) if HF_FILE in files else SentencePieceTokenizer(files[FILE_NAME])


def train_tokenizer(text_files: list[str], model_path: str, vocab_size: int, max_sentences: int = 400_000) -> None:
    """Train a byte-fallback BPE sentencepiece model on `text_files` and write it to `model_path` (a `.model` file).

    Newlines are a token of their own and the text is not normalised, so decode(encode(text)) == text: plays keep
    their line structure, and generated text has it too.
    """
    import sentencepiece as spm

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
