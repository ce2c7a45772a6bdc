"""Instruction fine-tuning: conversations rendered with the tokenizer's own chat template, the loss on the assistant's
tokens only, examples packed into windows that attend block-causally, and the loss normalised over the whole global
batch. References: the template's text typed out by hand, transformers (its chat rendering and its model, one example
at a time), a single-process run."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fsdp_trainer import model as model_module
from fsdp_trainer.config import ModelConfig
from fsdp_trainer.data.chat import ChatEncoder, Packer
from fsdp_trainer.data.format import START, TARGET, TokenFile
from fsdp_trainer.data.loader import Mixture, TokenLoader
from fsdp_trainer.loss import IGNORE, NextTokenLoss
from fsdp_trainer.model import Transformer, block_causal
from fsdp_trainer.tokenizer import load_tokenizer
from tests.helpers import read_metrics, tool, train_cli, train_losses
from tests.test_real_models import save_hf_checkpoint, save_hf_tokenizer

transformers = pytest.importorskip("transformers")

# ChatML as Qwen3 writes it, down to its quirk: the last assistant turn gets an empty <think> block.
CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.last %}<|im_start|>assistant\n<think>\n\n</think>\n\n"
    "{{ m['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Answer in verse."},
    {"role": "user", "content": "Who goes there?"},
    {"role": "assistant", "content": "Nay, answer me: stand, and unfold yourself."},
    {"role": "user", "content": "Long live the king!"},
    {"role": "assistant", "content": "Bernardo?"},
]


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("chatml")
    hf = save_hf_tokenizer(out, "qwen3", CHATML)
    return out, hf


def test_assistant_tokens_and_nothing_else_are_trained(chatml_tokenizer):
    path, hf = chatml_tokenizer
    ids, trained = ChatEncoder(load_tokenizer(path)).encode({"messages": CONVERSATION})

    # The text is transformers' rendering of the template, and the ids those of the whole text.
    text = hf.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids.tolist() == hf(text, add_special_tokens=False).input_ids
    # The trained tokens, typed out from the template: each answer through its end of turn, not the newline the
    # template writes after it, nor the generation prompt.
    pieces = [
        ("<|im_start|>system\nAnswer in verse.<|im_end|>\n<|im_start|>user\nWho goes there?<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ("Nay, answer me: stand, and unfold yourself.<|im_end|>", True),
        ("\n<|im_start|>user\nLong live the king!<|im_end|>\n<|im_start|>assistant\n", False),
        ("<think>\n\n</think>\n\nBernardo?<|im_end|>", True),
        ("\n", False),
    ]
    expected = [flag for piece, flag in pieces for _ in hf(piece, add_special_tokens=False).input_ids]
    assert "".join(piece for piece, _ in pieces) == text
    assert trained.tolist() == expected
    # The same from transformers' offsets: the tokens from the end of each generation prompt to the end of each answer's
    # content and its <|im_end|>, the convention TRL and axolotl train on.
    offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
    spans, at = [], 0
    for k, message in enumerate(CONVERSATION):
        if message["role"] == "assistant":
            start = len(hf.apply_chat_template(CONVERSATION[:k], tokenize=False, add_generation_prompt=True))
            at = text.index(message["content"], start) + len(message["content"])
            spans.append((start, at + len("<|im_end|>")))
    assert trained.tolist() == [any(a <= s and e <= b for a, b in spans) for s, e in offsets]

    all_ids, all_trained = ChatEncoder(load_tokenizer(path), "all").encode({"messages": CONVERSATION})
    assert all_ids.tolist() == ids.tolist() and all_trained.all()


# ChatML with TRL's assistant-mask markers: {% generation %} around what an assistant's turn trains.
CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_template_with_generation_markers_trains_what_trls_assistant_mask_marks(tmp_path):
    """A template that marks the assistant's tokens with {% generation %} (what TRL's assistant_only_loss reads)
    renders as transformers renders it, and the tokens we train on are those transformers' assistant mask marks."""
    hf = save_hf_tokenizer(tmp_path, "qwen3", CHATML_GENERATION)
    ids, trained = ChatEncoder(load_tokenizer(tmp_path)).encode({"messages": CONVERSATION})
    theirs = hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids.tolist() == list(theirs["input_ids"])
    assert trained.tolist() == [bool(m) for m in theirs["assistant_masks"]]


# Gemma 3's published template (gemma-3-1b-it's tokenizer_config.json), its image branch aside: the system prompt goes
# into the first user turn, the assistant is "model", every turn ends with <end_of_turn> and a newline.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {{- message['content'] | trim -}}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)


def test_gemma3s_template_trains_each_answer_through_its_end_of_turn(tmp_path):
    """Gemma 3's template, for SFT and for preference pairs: the model's turns and their <end_of_turn> are trained,
    not the newline after it, the prompts, nor the BOS its template writes; and roles that do not alternate are
    refused in one line."""
    from fsdp_trainer.data.chat import TRAINED, BadConversation, PreferenceEncoder

    hf = save_hf_tokenizer(tmp_path, "gemma3", GEMMA3_TEMPLATE)
    tokenizer = load_tokenizer(tmp_path)
    ids, trained = ChatEncoder(tokenizer).encode({"messages": CONVERSATION})
    text = hf.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids.tolist() == hf(text, add_special_tokens=False).input_ids and ids[0] == hf.bos_token_id
    pieces = [
        ("<bos><start_of_turn>user\nAnswer in verse.\n\nWho goes there?<end_of_turn>\n<start_of_turn>model\n", False),
        ("Nay, answer me: stand, and unfold yourself.<end_of_turn>", True),
        ("\n<start_of_turn>user\nLong live the king!<end_of_turn>\n<start_of_turn>model\n", False),
        ("Bernardo?<end_of_turn>", True),
        ("\n", False),
    ]
    assert "".join(piece for piece, _ in pieces) == text
    assert trained.tolist() == [flag for piece, flag in pieces for _ in hf(piece, add_special_tokens=False).input_ids]

    pair = {
        "prompt": CONVERSATION[:4],
        "chosen": [CONVERSATION[4]],
        "rejected": [{"role": "assistant", "content": "Who?"}],
    }
    ids, marks = PreferenceEncoder(tokenizer).encode(pair)
    answers = hf.decode(ids[(marks & TRAINED) > 0].tolist())
    assert answers == "Bernardo?<end_of_turn>Who?<end_of_turn>"
    with pytest.raises(BadConversation, match="roles must alternate"):
        ChatEncoder(tokenizer).encode({"messages": CONVERSATION[2:]})


def test_prompt_response_pairs_and_the_default_template(chatml_tokenizer, tiny_data):
    path, hf = chatml_tokenizer
    pair = ChatEncoder(load_tokenizer(path)).encode({"prompt": "Who goes there?", "response": "Bernardo?"})
    messages = [{"role": "user", "content": "Who goes there?"}, {"role": "assistant", "content": "Bernardo?"}]
    assert pair[0].tolist() == hf(hf.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids

    # A sentencepiece model has no template: `<|role|>` lines, and EOS after each answer, trained on.
    sp = load_tokenizer(tiny_data.parent / "tokenizer.model")
    ids, trained = ChatEncoder(sp).encode({"prompt": "Who goes there?", "response": "Bernardo?"})
    prompt = sp.encode("<|user|>\nWho goes there?\n<|assistant|>\n")
    answer = sp.encode("Bernardo?") + [sp.eos_id]
    after = sp.encode("\n")  # the template's newline after the turn, untrained
    assert ids.tolist() == prompt + answer + after
    assert trained.tolist() == [False] * len(prompt) + [True] * len(answer) + [False] * len(after)


def test_packing_keeps_examples_whole_best_fit_and_counts_long_ones():
    packer = Packer(seq_len=10, pad_id=0, open_windows=2)
    examples = [np.arange(1, n + 1) + 100 * k for k, n in enumerate([6, 5, 3, 12, 4, 2])]
    closed = []
    for ids in examples:
        closed += packer.add(ids, np.ones(len(ids), bool))
    windows = closed + packer.finish()
    # 6 -> w1; 5 -> w2; 3 -> w1 (best fit: 4 free there, 5 in w2); 12 truncated to 10: w1 (full) closes, new w3;
    # 4 -> w2 (1 free left); 2: w2 too full, two windows open -> w2 (fullest, 1 free) closes, 2 -> new w4 ... wait:
    # w3 is full (0 free) so it is the fullest and closes first.
    # 6 -> a new window A; 5 does not fit A's 4 free -> B; 3 -> A (best fit: 4 free there, 5 in B); 12, truncated to
    # 10, fits nowhere and 2 windows are open -> A (the fullest) is written, 10 -> C; 4 -> B; 2 fits nowhere -> C
    # (full) is written, 2 -> D; the end writes B and D, in the order they were opened.
    assert [w[0].tolist() for w in windows] == [
        [1, 2, 3, 4, 5, 6, 201, 202, 203, 0],
        list(range(301, 311)),
        [101, 102, 103, 104, 105, 401, 402, 403, 404, 0],
        [501, 502] + [0] * 8,
    ]
    assert (packer.examples, packer.truncated, packer.windows, packer.placed) == (6, 1, 4, 6 + 5 + 3 + 10 + 4 + 2)
    # Each position is a target where its next token is in the same example; each example and the padding start.
    T, S = TARGET, START
    assert windows[0][1].tolist() == [S | T, T, T, T, T, 0, S | T, T, 0, S]
    drop = Packer(seq_len=10, pad_id=0, long_examples="drop")
    assert drop.add(np.arange(11), np.ones(11, bool)) == [] and drop.dropped == 1 and drop.finish() == []


def test_a_window_of_two_examples_gives_each_the_logits_it_would_get_alone():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    a, b = torch.randint(0, 64, (1, 7)), torch.randint(0, 64, (1, 9))
    packed = torch.cat([a, b], dim=1)
    documents = torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        logits = torch.cat([model(a), model(b)], dim=1)
        packed_logits = model(packed, documents=documents)
        plain = model(packed)
    assert (packed_logits - logits).abs().max() <= 1e-5
    assert (plain[:, 7:] - logits[:, 7:]).abs().max() > 1e-2  # without the mask, b would see a

    # The loss given documents is that of each example alone, over the targets that are not IGNORE.
    targets = torch.roll(packed, -1, 1)
    targets[0, [5, 6, 15]] = IGNORE  # a's last two (a prompt-like span, the end), b's end
    expected = F.cross_entropy(logits[0], targets[0], ignore_index=IGNORE)
    for chunks in (1, 3):  # chunked the same
        objective = NextTokenLoss(targets, chunks)
        assert torch.allclose(model(packed, documents, loss=objective) / objective.count(), expected, rtol=1e-5)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_a_sliding_window_holds_within_each_packed_example(family):
    """A window of 4 positions (the query included) in a window packed with two examples, on every layer (Mistral) or
    on Gemma 3's local layers between global ones: each example gets the logits it gets alone with the window, which
    differ from those without it."""
    pattern = {"sliding_window_pattern": 2} if family == "gemma3" else {}
    cfg = ModelConfig(family=family, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                      max_seq_len=16, sliding_window=4, **pattern)  # fmt: skip
    unwindowed = replace(cfg, sliding_window=None, sliding_window_pattern=None)
    model, unwindowed = Transformer(cfg), Transformer(unwindowed)
    model.init_weights(seed=0)
    unwindowed.load_state_dict(model.state_dict())
    a, b = torch.randint(0, 64, (1, 7)), torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        alone = torch.cat([model(a), model(b)], dim=1)
        packed = model(torch.cat([a, b], dim=1), documents=torch.tensor([[0] * 7 + [1] * 9]))
        full = unwindowed(b)
    assert (packed - alone).abs().max() <= 1e-5
    assert (alone[:, 7:] - full).abs().max() > 1e-2  # b is longer than the window: it matters


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_packed_attention_by_query_tiles_gives_the_whole_masks_loss_and_gradients(family, monkeypatch):
    """On a CPU, packed windows attend tile by tile (model.TiledMask: a tile of queries sees only the keys from its
    earliest example's start), which skips most of a long window's scores: the loss and every gradient are those of
    one attention over the whole boolean mask, with examples shorter and longer than a tile, two rows whose boundaries
    differ, and a sliding window (Mistral's on every layer, Gemma 3's local layers between global ones)."""
    window = {"mistral": {"sliding_window": 50}, "gemma3": {"sliding_window": 50, "sliding_window_pattern": 2}}
    cfg = ModelConfig(family=family, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                      max_seq_len=320, **window.get(family, {}))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, 64, (2, 300), generator=g), torch.randint(0, 64, (2, 300), generator=g)
    lengths = [[140, 30, 60, 70], [7, 200, 93]]
    documents = torch.tensor([[k for k, n in enumerate(row) for _ in range(n)] for row in lengths])
    _, tiled = block_causal(documents, window=cfg.sliding_window)
    # Row 0's examples start at 0, 140, 170, 230, row 1's at 0, 7, 207; a window of 50 sees back to query - 49.
    first = (lambda start, query: max(start, query - 49)) if cfg.sliding_window else (lambda start, query: start)
    assert tiled.tiles == (
        ((0, 128, 0), (128, 256, first(0, 128)), (256, 300, first(230, 256))),
        ((0, 128, 0), (128, 256, first(7, 128)), (256, 300, first(207, 256))),
    )
    results = []
    for tile in (model_module.ATTENTION_TILE, 10**6):  # the second: one attention over the whole mask
        monkeypatch.setattr(model_module, "ATTENTION_TILE", tile)
        model = Transformer(cfg)
        model.init_weights(seed=0)
        loss = model(tokens, documents, loss=NextTokenLoss(targets))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (tiled_loss, tiled_grads), (whole_loss, whole_grads) = results
    torch.testing.assert_close(tiled_loss, whole_loss, rtol=1e-6, atol=0)
    for name, grad in whole_grads.items():
        scale = grad.abs().max().item()  # to the order of the float sums, relative to the gradient's size
        torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-5, atol=1e-5 * scale)


def _chat_data(tmp_path, tokenizer_dir, conversations, seq_len, *flags, input_file=None):
    """A recipe on conversations (written to chat.jsonl, unless an input_file is given), prepared with --format chat."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    if input_file is None:
        input_file = tmp_path / "chat.jsonl"
        input_file.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    recipe = {
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96, "vocab_size": 640},
        "parallel": {"mixed_precision": "fp32"},
        "data": {
            "train_path": str(tmp_path / "data" / "train.bin"),
            "val_path": str(tmp_path / "data" / "val.bin"),
            "tokenizer_path": str(tokenizer_dir),
            "seq_len": seq_len,
            "micro_batch_size": 2,
        },
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        "train": {"steps": 6, "log_every": 1, "eval_every": 3, "eval_steps": 1},
        "checkpoint": {"every": 0},
    }
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    proc = tool(
        "prepare_data.py",
        "--recipe",
        tmp_path / "recipe.yaml",
        "--format",
        "chat",
        "--input",
        input_file,
        "--val_fraction",
        "0.2",
        *flags,
    )
    return tmp_path / "recipe.yaml", proc


def shakespeare_conversations(n: int) -> list[dict]:
    import gzip

    from fsdp_trainer.data.prepare import BUNDLED_CHAT

    with gzip.open(BUNDLED_CHAT, "rt") as f:
        return [json.loads(next(f)) for _ in range(n)]


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_accumulation_and_resume_is_exact(tmp_path, chatml_tokenizer):
    """The loss is over the global batch's supervised tokens, so 2 ranks x micro 2 equal 1 rank x micro 2 x
    accumulation 2, though the micro-batches hold different numbers of them; a run stopped at step 3 and resumed on
    one rank ends where the straight run ends."""
    recipe, proc = _chat_data(tmp_path, chatml_tokenizer[0], shakespeare_conversations(120), 96)
    assert "truncated" in proc.stdout and TokenFile(tmp_path / "data" / "train.bin").packed_seq_len == 96
    train_cli(["--recipe", str(recipe), "--train.out_dir", str(tmp_path / "two")], nproc=2)
    # One rank: 2 micro-batches of 2 per step, and 2 evaluation batches: the 4 windows 2 ranks x 1 batch see.
    one = ["--recipe", str(recipe), "--data.grad_accum_steps", "2", "--train.eval_steps", "2"]
    train_cli([*one, "--train.out_dir", str(tmp_path / "one")])
    losses, reference = train_losses(tmp_path / "two"), train_losses(tmp_path / "one")
    assert len(losses) == 6
    for step, ref in reference.items():
        assert losses[step] == pytest.approx(ref, rel=1e-5), step
    records = read_metrics(tmp_path / "two")
    counts = [r["supervised_tokens"] for r in records if "loss" in r]
    assert len(set(counts)) > 1 and all(0 < c < 4 * 96 for c in counts)
    vals = [[r["val_loss"] for r in read_metrics(tmp_path / run) if "val_loss" in r] for run in ("one", "two")]
    assert len(vals[0]) == 2 and vals[1] == pytest.approx(vals[0], rel=1e-5)

    # Stop at step 3 on 2 ranks, resume on 1 (accumulation 2: the same global batch).
    ckpt = ["--checkpoint.every", "3", "--train.out_dir", str(tmp_path / "resumed")]
    train_cli(["--recipe", str(recipe), *ckpt, "--train.steps", "3"], nproc=2)
    train_cli([*one, *ckpt])
    resumed = train_losses(tmp_path / "resumed")
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5), step


@pytest.mark.slow
def test_fine_tune_an_imported_checkpoint_on_conversations(tmp_path):
    """The README's walk-through on a Qwen3 checkpoint and ChatML tokenizer built here: import, prepare the
    conversations, train; the validation loss equals transformers' on the same packed windows, each example alone,
    over the assistant's tokens (fp32, relative gap <= 1e-5)."""
    hf_in, imported = tmp_path / "hf_in", tmp_path / "imported"
    hf_tokenizer = save_hf_tokenizer(hf_in, "qwen3", CHATML)
    original = save_hf_checkpoint(hf_in, "qwen3", vocab_size=len(hf_tokenizer) + 8)
    tool("import_hf.py", hf_in, imported)
    # Short turns (the test model has 64 positions): the first line of each.
    conversations = [
        {"messages": [{**m, "content": m["content"].splitlines()[-1][:40]} for m in c["messages"]]}
        for c in shakespeare_conversations(60)
    ] + [{"prompt": "Who goes there?", "response": "Bernardo?"}]
    recipe, _ = _chat_data(tmp_path, imported, conversations, 64)
    run = tmp_path / "run"
    launch = ["--recipe", str(recipe), "--recipe", str(imported / "model.yaml"), "--checkpoint.resume", str(imported)]
    # A learning rate of 1e-20 leaves the fp32 weights as imported: the evaluation is the imported model's.
    overrides = ["--optim.lr", "1e-20", "--optim.min_lr", "0", "--train.steps", "1", "--train.eval_every", "1"]
    overrides += ["--checkpoint.every", "1"]
    train_cli([*launch, *overrides, "--train.eval_steps", "1", "--train.out_dir", str(run)], nproc=2)
    [val_loss] = [r["val_loss"] for r in read_metrics(run) if "val_loss" in r]

    # The first 2 x 2 windows of the validation file (2 ranks x micro-batch 2), each example through transformers on
    # its own.
    val = TokenFile(tmp_path / "data" / "val.bin")
    assert len(val) >= 4 * 64
    tokens = torch.from_numpy(val.tokens[: 4 * 64].astype(np.int64)).view(4, 64)
    flags = torch.from_numpy(np.array(val.flags[: 4 * 64])).view(4, 64)
    total, count = 0.0, 0
    with torch.no_grad():
        for row, row_flags in zip(tokens, flags, strict=True):
            starts = [int(i) for i in torch.nonzero(row_flags & START).flatten()] + [64]
            for start, end in zip(starts[:-1], starts[1:], strict=True):
                logits = original(row[None, start:end]).logits[0]
                targets = torch.where((row_flags[start:end] & TARGET) > 0, torch.roll(row[start:end], -1), IGNORE)
                total += F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum").item()
                count += int((targets != IGNORE).sum())
    reference = total / count
    assert abs(val_loss - reference) / reference <= 1e-5, (val_loss, reference)

    # generate.py --chat: the prompt through the template's generation prompt, the reply alone printed (greedy, so
    # the same as transformers' greedy continuation of the same rendering).
    reply = tool(
        "generate.py",
        run,
        "--chat",  # a bare flag, as README writes it
        "--prompt",
        "Who goes there?",
        "--max_new_tokens",
        "6",
        "--temperature",
        "0",
    ).stdout
    rendered = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who goes there?"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([hf_tokenizer(rendered, add_special_tokens=False).input_ids])
    with torch.no_grad():
        greedy = original.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=hf_tokenizer.eos_token_id)
    assert reply == hf_tokenizer.decode(greedy[0, ids.shape[1] :], skip_special_tokens=True) + "\n"


def test_bad_conversations_are_named_by_file_and_line(tmp_path, chatml_tokenizer):
    good = {"prompt": "a", "response": "b"}
    cases = {
        "no assistant turn: nothing to train on": {"messages": [{"role": "user", "content": "hi"}]},
        "message 1 has role 'narrator', not one of system, user, assistant, tool": {
            "messages": [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"}]
        },
        "the chat template refused it: no system turns here": {
            "messages": [{"role": "system", "content": "s"}, *CONVERSATION[1:3]]
        },
    }
    refuse_system = "{% if m['role'] == 'system' %}{{ raise_exception('no system turns here') }}{% endif %}"
    strict = CHATML.replace("{% for m in messages %}", "{% for m in messages %}" + refuse_system)
    tokenizer_dir = tmp_path / "strict"
    save_hf_tokenizer(tokenizer_dir, "qwen3", strict)
    for message, record in cases.items():
        out = tmp_path / message[:10].replace(" ", "_")
        out.mkdir()
        with pytest.raises(AssertionError) as failure:  # tool(): the command failed, with this stderr
            _chat_data(out, tokenizer_dir, [good, good, record], 32)
        stderr = str(failure.value)
        assert stderr.strip() == (
            f"error: {out}/chat.jsonl:3: {message}; fix it or pass --skip_bad_records to skip and count such records"
        ), stderr
        assert not (out / "data" / "train.bin").exists()


def test_parquet_conversations_pack_as_jsonl_ones(tmp_path, chatml_tokenizer):
    """A parquet `messages` column (a list of structs) and `prompt` / `response` columns give the same bytes as the
    same records in jsonl."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    conversations = shakespeare_conversations(30)
    _chat_data(tmp_path / "jsonl", chatml_tokenizer[0], conversations, 128)
    parquet = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(conversations), parquet, row_group_size=7)
    _chat_data(tmp_path / "parquet", chatml_tokenizer[0], None, 128, input_file=parquet)
    for name in ("train.bin", "train.bin.flags", "val.bin", "val.bin.flags"):
        assert (tmp_path / "parquet" / "data" / name).read_bytes() == (tmp_path / "jsonl" / "data" / name).read_bytes()


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_flex_attention_block_mask_gives_the_boolean_masks_logits(family):
    """The BlockMask that compiled GPU runs attend through (parallelize() turns it on with compile on CUDA) marks the
    same keys as the boolean mask: checked on CPU in eager forward (torch 2.13 has no flex_attention backward on
    CPU), over 3 blocks of 128 positions, some of which the mask leaves empty; packed and unpacked, with a sliding
    window of 50 shorter than the examples on every layer (Mistral) or on Gemma 3's local layers between global ones."""
    window = {
        "mistral": {"sliding_window": 50},
        "gemma3": {"sliding_window": 50, "sliding_window_pattern": 2, "head_dim": 8},
    }.get(family, {})
    cfg = ModelConfig(family=family, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                      max_seq_len=320, **window)  # fmt: skip
    model = Transformer(cfg)
    model.init_weights(seed=0)
    tokens = torch.randint(0, 64, (2, 300), generator=torch.Generator().manual_seed(0))
    lengths = [[140, 100, 60], [7, 200, 93]]
    documents = torch.tensor([[k for k, n in enumerate(row) for _ in range(n)] for row in lengths])
    _, block_mask = block_causal(documents, flex=True, window=window.get("sliding_window"))
    assert block_mask.sparsity() > 0  # whole blocks skipped
    with torch.no_grad():
        boolean = model(tokens, documents=documents), model(tokens)
        model.flex_attention = True
        flex = model(tokens, documents=documents), model(tokens)
    for ours, expected in zip(flex, boolean, strict=True):
        assert (ours - expected).abs().max() <= 1e-5


def test_a_mixture_of_packed_files_reads_whole_windows_with_their_targets(tmp_path, chatml_tokenizer):
    """Packed sources mix like plain ones: each sample is one window of one source, with that window's targets
    (next tokens where flagged, IGNORE elsewhere) and example numbers."""
    pair = {"prompt": "Who goes there?", "response": "Bernardo?"}
    for name, conversations in (("a", shakespeare_conversations(20)), ("b", [pair] * 12)):
        _chat_data(tmp_path / name, chatml_tokenizer[0], conversations, 64, "--val_fraction", "0")
    files = [TokenFile(tmp_path / name / "data" / "train.bin") for name in "ab"]
    windows = {}  # each window of either file -> (which file, its flags)
    for source, f in enumerate(files):
        for k in range(len(f) // 64):
            windows[tuple(f.tokens[k * 64 : (k + 1) * 64])] = source, np.array(f.flags[k * 64 : (k + 1) * 64])
    loader = TokenLoader(Mixture(files, [0.5, 0.5], ["a", "b"], seed=0), seq_len=64, micro_batch_size=8)
    (batch,) = loader.next_batch()
    sources = set()
    for inputs, targets, documents in zip(batch.inputs, batch.targets, batch.documents, strict=True):
        source, flags = windows[tuple(inputs.tolist())]  # a whole window of one of the files
        sources.add(source)
        expected = np.where(flags & TARGET, np.roll(inputs.numpy(), -1), IGNORE)
        assert targets.tolist() == expected.tolist()
        assert documents.tolist() == np.cumsum((flags & START) > 0).tolist()
    assert len(sources) == 2  # both sources drawn


@pytest.mark.parametrize("chunks", [1, 3])
def test_the_output_layer_runs_on_the_trained_positions_alone(chunks):
    """Packed fine-tuning data carries the positions that have a target (MicroBatch.trained, found on the host from
    the flags): the output layer and the loss run on those alone, so a prompt's logits are never made. The summed
    loss, each answer's summed log-probability (preference pairs) and the distillation sums, and their gradients, are
    those over every position, where the untrained ones count zero."""
    from fsdp_trainer.data.loader import micro_batch
    from fsdp_trainer.loss import DistillationLoss, SequenceLogProbs

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (2, 24))
    flags = np.zeros((2, 24), dtype=np.uint8)
    flags[:, [0, 11]] = START  # two examples a row: a prompt, then an answer that is trained
    flags[:, 5:10] |= TARGET
    flags[:, 16:23] |= TARGET
    batch = micro_batch(np.stack([tokens, flags], 1), True, "preference", torch.device("cpu"))
    assert batch.trained.tolist() == np.flatnonzero((batch.targets != IGNORE).numpy()).tolist() and len(batch.trained)
    output = torch.nn.Linear(16, 64)
    teacher = torch.nn.Linear(16, 64)
    hidden, teacher_hidden = torch.randn(2, 24, 16), torch.randn(2, 24, 16)
    objectives = [
        lambda kept: NextTokenLoss(batch.targets, chunks, kept),
        lambda kept: SequenceLogProbs(batch.targets, batch.sequences, 2 * batch.pairs, chunks, kept),
        lambda kept: DistillationLoss(batch.targets, teacher_hidden, teacher, 1.0, 1.0, 0.5, chunks, kept),
    ]
    for objective in objectives:
        results = []
        for kept in (None, batch.trained):
            h = hidden.clone().requires_grad_(True)
            value = objective(kept)(h, output)
            value.sum().backward()
            results.append((value.detach(), h.grad))
        torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-6, atol=1e-7)


def test_a_failed_empty_or_too_small_preparation_leaves_the_previous_files_byte_identical(tmp_path, chatml_tokenizer):
    """New files are staged beside the previous set and moved in only when all are complete: a bad record, an input
    without records, or a split left without a window (refused with the counts and the ways out) changes nothing."""
    tokenizer_dir, _ = chatml_tokenizer
    recipe, _ = _chat_data(tmp_path, tokenizer_dir, shakespeare_conversations(40), 128)
    previous = {p.name: p.read_bytes() for p in (tmp_path / "data").iterdir()}
    assert {"train.bin", "train.bin.flags", "train.bin.meta.json", "val.bin.inputs.json"} <= previous.keys()
    good = json.dumps({"messages": CONVERSATION[1:3]})
    cases = {
        "bad.jsonl": (f"{good}\n{good}\n{{not json\n", "bad.jsonl:3: Expecting property name"),
        "empty.jsonl": ("", "empty.jsonl: no conversations in it; nothing was written"),
        "three.jsonl": (
            f"{good}\n" * 3,
            "val: 0 examples in 0 windows of 128 (0.0% filled, 0 supervised tokens; 0 truncated and 0 dropped as "
            "longer than data.seq_len, 0 dropped with no answer left within it) from 3 conversations make no window "
            "of data.seq_len=128; give more data, raise --val_fraction (now 0.2) or a shorter data.seq_len; nothing "
            "was written",
        ),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        proc = tool("prepare_data.py", "--recipe", recipe, "--format", "chat", "--input", tmp_path / name,
                    "--val_fraction", "0.2", check=False)  # fmt: skip
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
        assert {p.name: p.read_bytes() for p in (tmp_path / "data").iterdir()} == previous, name


def test_sharegpt_records_prepare_to_the_tokens_of_their_messages(tmp_path, chatml_tokenizer):
    """ShareGPT (`conversations` of `from` / `value`, a `system` text beside them), as axolotl and LlamaFactory users
    have it, gives the bytes of the same conversations as `messages`; a record of another --format says which."""
    tokenizer_dir, _ = chatml_tokenizer
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    conversations = [{"messages": [{"role": "system", "content": "Speak as in Elsinore."}, *CONVERSATION[1:]]}] * 6
    sharegpt = [
        {
            "system": "Speak as in Elsinore.",
            "conversations": [{"from": speakers[m["role"]], "value": m["content"]} for m in CONVERSATION[1:]],
        }
    ]
    outputs = {}
    for name, records in (("messages", conversations), ("sharegpt", sharegpt * 6)):
        _chat_data(tmp_path / name, tokenizer_dir, records, 64, "--val_fraction", "0")
        outputs[name] = {p.name: p.read_bytes() for p in (tmp_path / name / "data").iterdir()
                         if not p.name.endswith(".inputs.json")}  # fmt: skip
    assert outputs["sharegpt"] == outputs["messages"] and len(outputs["messages"]["train.bin"]) > 0

    recipe = tmp_path / "messages" / "recipe.yaml"
    cases = {
        "chat": ({"prompt": "Who?", "chosen": "I.", "rejected": "Thou."}, "it is a preference pair; prepare it with "
                 "--format preference"),
        "preference": ({"prompt": "Who?", "completion": "I.", "label": True}, "it is an unpaired record; prepare it "
                       "with --format unpaired"),
        "unpaired": (sharegpt[0], "it is a conversation; prepare it with --format chat"),
        "chat ": ({"conversations": [{"from": "narrator", "value": "x"}]}, "conversations turn 0 is from 'narrator', "
                  "not one of system, human"),
    }  # fmt: skip
    for fmt, (record, message) in cases.items():
        (tmp_path / "other.jsonl").write_text(json.dumps(record) + "\n")
        proc = tool("prepare_data.py", "--recipe", recipe, "--format", fmt.strip(), "--input", tmp_path / "other.jsonl",
                    check=False)  # fmt: skip
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
