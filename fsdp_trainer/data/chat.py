"""Conversations -> fine-tuning examples, and examples -> packed windows (numpy only, like all of data preparation).

A record is `{"messages": [{"role": ..., "content": ...}, ...]}` (the HF / OpenAI chat format), ShareGPT's
`{"conversations": [{"from": "human" | "gpt" | ..., "value": ...}, ...]}` (axolotl's and LlamaFactory's), or
`{"prompt": ..., "response": ...}` (one user turn and the assistant's answer). It is rendered with the tokenizer's
own chat template (`chat_template` of tokenizer_config.json, or chat_template.jinja), through jinja2 the way
transformers renders it, or for a tokenizer without one with DEFAULT_TEMPLATE. The tokens trained on are the
assistant's turns: each from the end of the generation prompt the template puts before it through its end-of-turn
token (so the model learns to stop), not the whitespace the template writes after that; with train_on="all", every
token.

Examples are packed into windows of exactly seq_len tokens, whole (best fit among a few open windows), so none is
split across windows; one longer than seq_len is truncated to it, or dropped; one left with no token to train on is
dropped (and counted). format.py says how a packed file is laid
out; the model attends block-causally within each window, so an example never sees its neighbours.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import NamedTuple

import numpy as np

from fsdp_trainer.data.format import DESIRABLE, START, TARGET
from fsdp_trainer.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")

DEFAULT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""For a tokenizer without a chat template (a sentencepiece model): each turn as `<|role|>`, a newline, the content
and a newline. The tokenizer's EOS id follows each assistant turn, so the model learns where an answer ends."""

TRAIN_ON = ("assistant", "all")
LONG_EXAMPLES = ("truncate", "drop")


def check_options(train_on: str = "assistant", long_examples: str = "truncate") -> None:
    """The options of preparing conversations (prepare_data.py's --train_on and --long_examples), checked."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"--train_on={train_on!r} must be one of {', '.join(TRAIN_ON)}")
    if long_examples not in LONG_EXAMPLES:
        raise ValueError(f"--long_examples={long_examples!r} must be one of {', '.join(LONG_EXAMPLES)}")


class BadConversation(ValueError):
    """A record that cannot become an example; the message says why (the caller names the file and record)."""


def _template_environment():
    """jinja2 as transformers' apply_chat_template sets it up, so templates written for it render the same; a
    `{% generation %}` block (the markers of the assistant's tokens that TRL's assistant_only_loss reads) renders its
    content, as transformers renders it. Which tokens are trained is found from the rendered conversation, whatever
    the template marks."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise BadConversation(f"the chat template refused it: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env


SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "function_call": "assistant", "observation": "tool", "tool": "tool",
}  # fmt: skip
"""ShareGPT's speakers (`from`, as axolotl and LlamaFactory read them) as chat roles."""

FORMATS = {"chat": ("messages", "conversations", "response"), "preference": ("chosen", "rejected"),
           "unpaired": ("completion", "label"), "prompts": ()}  # fmt: skip
"""Keys that only records of one --format have, to tell a user which format a record is of."""


def other_format(record: dict, expected: str) -> str:
    """`: it is a preference record; prepare it with --format preference` where a record's keys are another format's."""
    for name, keys in FORMATS.items():
        if name != expected and any(key in record for key in keys):
            what = {"chat": "a conversation", "preference": "a preference pair", "unpaired": "an unpaired record",
                    "prompts": "a prompt"}  # fmt: skip
            return f" ({', '.join(sorted(record))}): it is {what[name]}; prepare it with --format {name}"
    return ""


def sharegpt_messages(record: dict) -> list:
    """A ShareGPT record's turns (`conversations` of {"from", "value"}, an optional `system` text) as messages."""
    turns = record["conversations"]
    if not isinstance(turns, list):
        raise BadConversation("'conversations' is not a list")
    messages = [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) else []
    for k, turn in enumerate(turns):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if speaker not in SHAREGPT_ROLES:
            raise BadConversation(
                f"conversations turn {k} is from {speaker!r}, not one of {', '.join(SHAREGPT_ROLES)} (ShareGPT)"
            )
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn.get("value")})
    return messages


def conversation_of(record: object) -> list[dict]:
    """The messages of a record (parsed JSON or a parquet row), checked: `messages` (HF / OpenAI), `conversations`
    (ShareGPT) or a `prompt` / `response` pair."""
    if not isinstance(record, dict):
        raise BadConversation("not a JSON object")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise BadConversation("'messages' is not a list")
    elif "conversations" in record:
        messages = sharegpt_messages(record)
    elif isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    else:
        raise BadConversation(
            "no 'messages' list, no ShareGPT 'conversations' and no 'prompt' / 'response' text pair"
            + other_format(record, "chat")
        )
    _check_messages(messages)
    if not any(message["role"] == "assistant" for message in messages):
        raise BadConversation("no assistant turn: nothing to train on")
    return messages


def _check_messages(messages: list, where: str = "") -> None:
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise BadConversation(f"{where}message {k} has no text 'content'")
        if message.get("role") not in ROLES:
            raise BadConversation(f"{where}message {k} has role {message.get('role')!r}, not one of {', '.join(ROLES)}")


PREFERENCE_KEYS = ("prompt", "chosen", "rejected")


def fields(record: object, keys: tuple[str, ...], what: str, fmt: str) -> list:
    """The values of `keys` in a record (parsed JSON or a parquet row) of --format `fmt`, or BadConversation naming
    those it lacks, and the format it is of where its keys say."""
    if not isinstance(record, dict):
        raise BadConversation("not a JSON object")
    missing = [key for key in keys if key not in record]
    if missing:
        raise BadConversation(f"no {' / '.join(map(repr, missing))}: {what} has {', '.join(keys)}" + other_format(
            record, fmt
        ))  # fmt: skip
    return [record[key] for key in keys]


def preference_of(record: object) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) messages of a preference record, checked: TRL's layouts, either three texts (a user
    turn and two assistant answers to it) or three message lists (the conversation so far, and the two answers as
    assistant turns)."""
    prompt, chosen, rejected = fields(record, PREFERENCE_KEYS, "a preference record", "preference")
    if all(isinstance(x, str) for x in (prompt, chosen, rejected)):
        answers = [[{"role": "assistant", "content": answer}] for answer in (chosen, rejected)]
        return [{"role": "user", "content": prompt}], *answers
    if not all(isinstance(x, list) for x in (prompt, chosen, rejected)):
        raise BadConversation("'prompt', 'chosen' and 'rejected' must be three texts or three message lists")
    for key, messages in zip(PREFERENCE_KEYS, (prompt, chosen, rejected), strict=True):
        _check_messages(messages, f"'{key}' ")
    for key, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer or any(message["role"] != "assistant" for message in answer):
            raise BadConversation(f"'{key}' must hold the assistant's answer: one or more assistant messages")
    return prompt, chosen, rejected


def answer_spans(
    render: Callable[..., str], text: str, messages: list[dict], trained_from: int = 0
) -> list[tuple[int, int]]:
    """Where in the conversation `text` (rendered by `render`, ChatEncoder.render) each assistant turn (from message
    `trained_from` on) lies, as character spans: from the end of the conversation before it with the generation
    prompt, to the end of the conversation through it, less the whitespace after its end-of-turn token."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < trained_from:
            continue
        before = render(messages[:i], add_generation_prompt=True)
        through = render(messages[: i + 1])
        if not text.startswith(before) or not through.startswith(before):
            raise BadConversation(
                f"the chat template does not render message {i} (assistant) after the conversation before it "
                "and its generation prompt, so its tokens cannot be told apart"
            )
        end = len(through)
        if not text.startswith(through):
            # Templates that render the last turn differently (Qwen3 gives it an empty <think> block): the turn
            # ends where its content, followed by the text the template closes the turn with, ends.
            content = message["content"].strip()
            closing = through[through.rfind(content) + len(content) :] if content else ""
            at = text.find(content, len(before)) if content else -1
            if at < 0 or not text.startswith(closing, at + len(content)):
                raise BadConversation(f"cannot find where the chat template puts message {i} (assistant)")
            end = at + len(content) + len(closing)
        # The answer ends with its end-of-turn token; the whitespace a template writes after it (ChatML's newline
        # after <|im_end|>) is the next turn's business, as in TRL and axolotl.
        spans.append((len(before), max(len(before), len(text[:end].rstrip()))))
    return spans


class ChatEncoder:
    """Renders conversations with a tokenizer's chat template and says which tokens are trained on."""

    def __init__(self, tokenizer: Tokenizer, train_on: str = "assistant"):
        check_options(train_on=train_on)
        self.tokenizer, self.train_on = tokenizer, train_on
        source = getattr(tokenizer, "chat_template", None)
        self.template = _template_environment().from_string(source or DEFAULT_TEMPLATE)
        # The template's own end-of-turn token ends each answer (Llama 3's <|eot_id|>, Qwen3's <|im_end|>); with the
        # default template, the tokenizer's EOS does.
        self.end_of_answer = [tokenizer.eos_id] if source is None and tokenizer.eos_id is not None else []
        # A template writes its own BOS (Llama 3's starts with {{ bos_token }}); the default one gets the tokenizer's.
        self.start = tokenizer.encode_prompt("") if source is None else []
        specials = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id}
        self.specials = {key: tokenizer.token(i) for key, i in specials.items() if i is not None}

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.specials)
        except BadConversation:
            raise
        except Exception as e:  # a template is code: any error it raises is this record's
            raise BadConversation(f"the chat template failed: {type(e).__name__}: {e}") from e

    def margin(self, record: object) -> float | None:
        """What a record says of its example beside its tokens: a preference pair's margin (PreferenceEncoder)."""
        return None

    def columns(self, record: object) -> str | None:
        """The record's columns as a JSON line, where its kind keeps them beside its tokens (PromptEncoder)."""
        return None

    def end_of_turn(self) -> int:
        """The token each answer ends with (the template's end-of-turn token, or the tokenizer's EOS), where a model
        trained on these answers stops."""
        ids, trained = self.encode_messages([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi"}])
        return int(ids[trained][-1])

    def prompt(self, messages: list[dict]) -> list[int]:
        """The ids a reply to `messages` is generated from: the conversation and the template's generation prompt."""
        return self.start + self.tokenizer.encode(self.render(messages, add_generation_prompt=True))

    def encode(self, record: object) -> tuple[np.ndarray, np.ndarray]:
        """(ids, trained) of one record: the rendered conversation's token ids and, for each, whether it is a target
        of the loss."""
        return self.encode_messages(conversation_of(record))

    def encode_messages(self, messages: list[dict], trained_from: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(ids, trained) of a conversation whose assistant turns from message `trained_from` on are trained. Each
        span is tokenized on its own (a template's turns meet at special tokens, so the ids are those of the whole
        text)."""
        text = self.render(messages)
        ids, trained = list(self.start), [False] * len(self.start)
        position = 0
        for start, end in answer_spans(self.render, text, messages, trained_from):
            prompt = self.tokenizer.encode(text[position:start])
            answer = self.tokenizer.encode(text[start:end]) + self.end_of_answer
            ids += prompt + answer
            trained += [self.train_on == "all"] * len(prompt) + [True] * len(answer)
            position = end
        rest = self.tokenizer.encode(text[position:])
        ids += rest
        trained += [self.train_on == "all"] * len(rest)
        return np.array(ids, dtype=np.int64), np.array(trained, dtype=bool)


UNPAIRED_KEYS = ("prompt", "completion", "label")


def unpaired_of(record: object) -> tuple[list[dict], list[dict], bool]:
    """(prompt, completion, desirable) of an unpaired preference record, checked: TRL's KTO layout, a prompt and a
    completion (two texts, or the conversation so far and the answer's assistant messages) and a boolean label."""
    prompt, completion, label = fields(record, UNPAIRED_KEYS, "an unpaired record", "unpaired")
    if not isinstance(label, bool):
        raise BadConversation(f"'label' is {label!r}: it must be true (a desirable completion) or false")
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{"role": "user", "content": prompt}], [{"role": "assistant", "content": completion}], label
    if not (isinstance(prompt, list) and isinstance(completion, list)):
        raise BadConversation("'prompt' and 'completion' must be two texts or two message lists")
    _check_messages(prompt, "'prompt' ")
    _check_messages(completion, "'completion' ")
    if not completion or any(message["role"] != "assistant" for message in completion):
        raise BadConversation("'completion' must hold the assistant's answer: one or more assistant messages")
    return prompt, completion, label


class PreferenceEncoder(ChatEncoder):
    """Preference records -> pairs: the chosen conversation then the rejected one, each rendered whole with the chat
    template and trained on its answer alone (its content and end-of-turn token, as in SFT), as one unit the packer
    keeps in one window. The second conversation's first token is marked SEQUENCE: it starts a sequence of its own."""

    def encode(self, record: object) -> tuple[np.ndarray, np.ndarray]:
        """(ids, marks) of one pair: the chosen and the rejected conversations' ids end to end, and each token's
        TRAINED and SEQUENCE bits."""
        prompt, chosen, rejected = preference_of(record)
        ids, marks = [], []
        for answer in (chosen, rejected):
            answer_ids, trained = self.encode_messages(prompt + answer, trained_from=len(prompt))
            mark = trained.astype(np.uint8) * TRAINED
            mark[0] |= SEQUENCE
            ids.append(answer_ids)
            marks.append(mark)
        return np.concatenate(ids), np.concatenate(marks)

    def margin(self, record: object) -> float | None:
        """The pair's optional `margin` (TRL's column: how far the chosen answer should be scored above the rejected
        one, for a reward model), a number; None without one."""
        margin = record.get("margin") if isinstance(record, dict) else None
        if margin is None:
            return None
        if isinstance(margin, bool) or not isinstance(margin, int | float) or not np.isfinite(margin):
            raise BadConversation(f"'margin' is {margin!r}: it must be a number")
        return float(margin)


class UnpairedEncoder(ChatEncoder):
    """Unpaired preference records (KTO's) -> examples: the prompt and the completion rendered as one conversation,
    trained on the completion alone (as SFT trains an answer), its first token marked DESIRABLE when its label is
    true."""

    def encode(self, record: object) -> tuple[np.ndarray, np.ndarray]:
        prompt, completion, desirable = unpaired_of(record)
        ids, trained = self.encode_messages(prompt + completion, trained_from=len(prompt))
        marks = trained.astype(np.uint8) * TRAINED
        marks[0] |= DESIRABLE if desirable else 0
        return ids, marks


def prompt_of(record: object) -> str | list[dict]:
    """The prompt of a prompt record (online RL's, TRL's layout): its `prompt`, a text or the conversation so far."""
    (prompt,) = fields(record, ("prompt",), "a prompt record", "prompts")
    if isinstance(prompt, list):
        _check_messages(prompt, "'prompt' ")
        if not prompt:
            raise BadConversation("'prompt' is an empty conversation")
    elif not isinstance(prompt, str) or not prompt:
        raise BadConversation("'prompt' must be a text or a message list")
    return prompt


class PromptEncoder(ChatEncoder):
    """Prompt records (online RL's) -> the ids a completion is sampled from: a conversation rendered with the chat
    template and its generation prompt, a text as it is (BOS first where the tokenizer adds one), as TRL's
    GRPOTrainer tokenizes them; nothing trained. The whole record (the prompt and every other column, e.g. the answer
    a reward function checks against) is kept beside the tokens as a JSON line."""

    def encode(self, record: object) -> tuple[np.ndarray, np.ndarray]:
        prompt = prompt_of(record)
        ids = self.prompt(prompt) if isinstance(prompt, list) else self.tokenizer.encode_prompt(prompt)
        return np.array(ids, dtype=np.int64), np.zeros(len(ids), dtype=bool)

    def columns(self, record: object) -> str:
        try:
            return json.dumps(record, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise BadConversation(f"its columns are not JSON ({e})") from e


TRAINED, SEQUENCE = 1, 2
"""The bits an encoder's marks may carry for each token (a bool `trained` array is TRAINED alone): the loss trains on
it, and it starts a sequence of its own (the rejected conversation of a preference pair), which the packer flags
START so that attention does not cross into it. An example's first token may also carry DESIRABLE (format.py), which
the packer keeps on its START."""

ENCODERS: dict[str, type[ChatEncoder]] = {
    "chat": ChatEncoder,
    "preference": PreferenceEncoder,
    "unpaired": UnpairedEncoder,
    "prompts": PromptEncoder,
}
"""The encoder of each --format of conversations."""
RECORDS = {"chat": "examples", "preference": "preference pairs", "unpaired": "unpaired answers", "prompts": "prompts"}
"""What each --format of conversations calls its records once encoded."""


class Window(NamedTuple):
    """A packed window: its tokens, their flags (format.py), and their margins (a pair's on its first token, 0
    elsewhere), seq_len each."""

    tokens: np.ndarray
    flags: np.ndarray
    margins: np.ndarray


class Packer:
    """Examples -> windows of exactly seq_len tokens, their flags and their margins (format.py), each example whole in
    one window.

    Best fit: an example goes to the open window it fills most; when none has room, a new window opens, and when
    `open_windows` are already open, the fullest is closed (written) first; at the end the open ones are written in
    the order they were opened. The rest of a window is padding (`pad_id`). Deterministic: the same examples in the
    same order give the same windows."""

    def __init__(self, seq_len: int, pad_id: int, long_examples: str = "truncate", open_windows: int = 64):
        check_options(long_examples=long_examples)
        self.seq_len, self.pad_id, self.long_examples, self.open_windows = seq_len, pad_id, long_examples, open_windows
        self.open: list[tuple[list, list, list, list[int]]] = []  # (ids, flags, margins, [free]) per window
        self.examples = self.truncated = self.dropped = self.untrained = self.targets = self.windows = self.placed = 0

    def add(self, ids: np.ndarray, marks: np.ndarray, margin: float = 0.0) -> list[Window]:
        """Place one example (or a preference pair: its sequences, marked SEQUENCE, stay together); returns the
        windows this closed. `marks`: a bool per token (trained), or TRAINED / SEQUENCE bits; `margin`: a pair's,
        kept on its first token."""
        marks = marks.astype(np.uint8)
        starts = np.flatnonzero(marks & SEQUENCE)
        starts = np.union1d([0], starts)
        # Each sequence gets an equal share of the window (a pair: TRL's max_length = seq_len / 2), its start kept
        # (TRL's keep_start: the prompt first, the answer's end cut).
        limit = self.seq_len // len(starts)
        sequences = np.split(np.arange(len(ids)), starts[1:])
        if any(len(sequence) > limit for sequence in sequences):
            if self.long_examples == "drop":
                self.dropped += 1
                return []
            kept = np.concatenate([sequence[:limit] for sequence in sequences])
            ids, marks = ids[kept], marks[kept]
            sequences = np.split(np.arange(len(ids)), np.cumsum([min(len(q), limit) for q in sequences])[:-1])
            self.truncated += 1
        trained = (marks & TRAINED) > 0
        # A sequence whose answer truncation cut away: nothing to learn (and a batch of such would be 0/0); a pair
        # without one of its answers cannot be compared.
        if not all(trained[sequence[1:]].any() for sequence in sequences):
            self.untrained += 1
            return []
        flags = np.zeros(len(ids), dtype=np.uint8)
        flags[[sequence[0] for sequence in sequences]] = START
        flags[0] |= marks[0] & DESIRABLE
        flags[:-1] |= np.where(trained[1:], TARGET, 0).astype(np.uint8)  # position j predicts token j + 1
        flags[[sequence[-1] for sequence in sequences]] &= ~np.uint8(TARGET)  # never the next sequence's first token
        self.examples += 1
        self.placed += len(ids)
        self.targets += int(((flags & TARGET) > 0).sum())
        fits = [(free[0], k) for k, (*_, free) in enumerate(self.open) if free[0] >= len(ids)]
        closed = []
        if fits:
            window = self.open[min(fits)[1]]
        else:
            if len(self.open) == self.open_windows:
                fullest = min(range(len(self.open)), key=lambda k: self.open[k][3][0])
                closed.append(self._close(self.open.pop(fullest)))
            window = ([], [], [], [self.seq_len])
            self.open.append(window)
        margins = np.zeros(len(ids), dtype=np.float32)
        margins[0] = margin
        window[0].append(ids)
        window[1].append(flags)
        window[2].append(margins)
        window[3][0] -= len(ids)
        return closed

    def _close(self, window) -> Window:
        ids, flags, margins, (free,) = window
        if free:  # the padding is an example of its own, trained on nothing
            ids = ids + [np.full(free, self.pad_id, dtype=np.int64)]
            flags = flags + [np.concatenate([[START], np.zeros(free - 1)]).astype(np.uint8)]
            margins = margins + [np.zeros(free, dtype=np.float32)]
        self.windows += 1
        return Window(np.concatenate(ids), np.concatenate(flags), np.concatenate(margins))

    def finish(self) -> list[Window]:
        """The windows still open, in the order they were opened."""
        closed, self.open = [self._close(window) for window in self.open], []
        return closed


class PromptPacker(Packer):
    """Prompts (online RL's) -> a window each, untrained, the rest of it padding: the room the completions sampled
    from it are packed into; a prompt that leaves no room is dropped (counted)."""

    def add(self, ids: np.ndarray, marks: np.ndarray, margin: float = 0.0) -> list[Window]:
        if len(ids) >= self.seq_len:
            self.dropped += 1
            return []
        self.examples += 1
        self.placed += len(ids)
        flags = np.zeros(len(ids), dtype=np.uint8)
        flags[0] = START
        return [self._close(([ids], [flags], [np.zeros(len(ids), np.float32)], [self.seq_len - len(ids)]))]
