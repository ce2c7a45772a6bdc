"""Published checkpoints with their own tokenizers, in their real layout, built here (no downloads): an HF Llama 3.1 /
3.2 (rope scaling, tied or not), Qwen3 (explicit head_dim, qk-norm), Mistral (a sliding window) or Gemma 3 (local and
global layers, linear rope scaling on the global ones, an attention scale of its own) saved sharded by
save_pretrained, and a byte-level BPE tokenizer trained with `tokenizers` on the bundled corpus and saved by
transformers. The README's walk-through: import -> prepare data with the model's tokenizer -> train -> consolidate
-> transformers."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
import torch.nn.functional as F
import yaml

from fsdp_trainer.data.format import TokenFile
from fsdp_trainer.data.prepare import BUNDLED_CORPUS
from tests.helpers import read_metrics, run_args, tool, train_cli
from tests.test_hf import LLAMA3_SCALING

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
SPECIALS = {  # (BOS or None, EOS, other added tokens), as the published tokenizers have them
    "llama": ("<|begin_of_text|>", "<|end_of_text|>", ["<|eot_id|>"]),
    "qwen3": (None, "<|endoftext|>", ["<|im_start|>", "<|im_end|>"]),
    "mistral": ("<s>", "</s>", ["[INST]", "[/INST]"]),
    "gemma3": ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
}
VARIANTS = {
    "llama3.1": dict(family="llama", rope_scaling=LLAMA3_SCALING["llama3.1"], tie_word_embeddings=False, bf16=True),
    "llama3.2": dict(family="llama", rope_scaling=LLAMA3_SCALING["llama3.2"], tie_word_embeddings=True),
    "qwen3": dict(family="qwen3", rope_scaling=None, tie_word_embeddings=True),
    # A sliding window shorter than the training windows (32) and the export check (64): it changes the logits.
    "mistral": dict(family="mistral", rope_scaling=None, tie_word_embeddings=False, sliding_window=8),
    # Both layer types, a window shorter than the sequences, the global layers' rope scaled as from Gemma 3 4B on.
    "gemma3": dict(family="gemma3", rope_scaling=None, tie_word_embeddings=True, sliding_window=8),
}


def corpus(chars: int) -> str:
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        return f.read(chars)


def save_hf_tokenizer(out_dir, family: str, chat_template: str = CHAT_TEMPLATE):
    """Train a byte-level BPE of 600 pieces and save it as transformers does (tokenizer.json, tokenizer_config.json,
    chat_template.jinja); Llama's template adds BOS to every text, Qwen3 has none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bos, eos, others = SPECIALS[family]
    specials = [t for t in (bos, eos, *others) if t]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator([corpus(200_000)], trainer)
    if bos:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tk.token_to_id(bos))]
        )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos)
    fast.chat_template = chat_template
    fast.save_pretrained(out_dir)
    return fast


def save_hf_checkpoint(out_dir, variant: str, vocab_size: int):
    v = VARIANTS[variant]
    config = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32
        if v["family"] in ("qwen3", "mistral", "gemma3")
        else 16,  # as Qwen3's and Nemo's: wider than dim / heads
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        tie_word_embeddings=v["tie_word_embeddings"],
    )
    if v["rope_scaling"]:
        config["rope_scaling"] = dict(v["rope_scaling"])
    if v["family"] == "mistral":
        config["sliding_window"] = v["sliding_window"]
    if v["family"] == "gemma3":
        del config["rope_theta"]
        config.update(
            sliding_window=v["sliding_window"],
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,  # not head_dim: the scores' scale is its own
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    config_cls = {
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "gemma3": transformers.Gemma3TextConfig,
    }.get(v["family"], transformers.LlamaConfig)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**config)).eval()
    if v["family"] == "gemma3":  # its norms start at 0 (a gain of 1 + weight): move them, as training does
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.2)
    if v.get("bf16"):  # published in bf16, as Llama 3 is
        model = model.to(torch.bfloat16)
    # Sampling defaults as published models ship them (Llama 3.2: temperature 0.6, top_p 0.9).
    model.generation_config = transformers.GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=1)
    model.save_pretrained(out_dir, max_shard_size="100KB")
    assert (out_dir / "model.safetensors.index.json").is_file()  # sharded, as published
    # The reference: the published checkpoint loaded in fp32 (model.float() would keep the rotary frequencies that
    # the cast to bf16 rounded).
    return transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()


def recipe_for(tmp_path) -> str:
    """The run's data, batch and schedule; the model section comes from the imported model.yaml."""
    recipe = {
        "parallel": {"mixed_precision": "fp32"},
        "data": {
            "train_path": str(tmp_path / "data" / "train.bin"),
            "val_path": str(tmp_path / "data" / "val.bin"),
            "tokenizer_path": str(tmp_path / "imported"),
            "seq_len": 32,
            "micro_batch_size": 2,
        },
        # A learning rate of 1e-20 leaves fp32 weights bitwise as imported: the evaluation is the imported model's.
        "optim": {"lr": 1e-20, "min_lr": 0.0, "warmup_steps": 0},
        "train": {"steps": 1, "log_every": 1, "eval_every": 1, "eval_steps": 2},
        "checkpoint": {"every": 1},
    }
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    return str(tmp_path / "recipe.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_published_checkpoint_imports_fine_tunes_and_exports(tmp_path, variant):
    family = VARIANTS[variant]["family"]
    hf_in, imported = tmp_path / "hf_in", tmp_path / "imported"
    original_tokenizer = save_hf_tokenizer(hf_in, family)
    original = save_hf_checkpoint(hf_in, variant, vocab_size=len(original_tokenizer) + 8)  # padded, as Qwen3 is

    tool("import_hf.py", hf_in, imported)
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "model.yaml"} <= {
        p.name for p in imported.iterdir()
    }
    text = corpus(120_000)
    (tmp_path / "plays.txt").write_text(text[:60_000])
    paragraphs = [p for p in text[60_000:].split("\n\n") if p.strip()]
    (tmp_path / "more.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    recipe = recipe_for(tmp_path)
    model_yaml = str(imported / "model.yaml")
    tool(
        "prepare_data.py",
        "--recipe",
        recipe,
        "--recipe",
        model_yaml,
        "--input",
        tmp_path / "plays.txt",
        tmp_path / "more.jsonl",
        "--val_fraction",
        "0.1",
    )

    # Documents are encoded as the model was pretrained: Llama's with BOS first, Qwen3's without; EOS last.
    train = TokenFile(tmp_path / "data" / "train.bin").tokens
    ids = list(train) + list(TokenFile(tmp_path / "data" / "val.bin").tokens)
    assert list(train[:1000]) == original_tokenizer(text[:60_000]).input_ids[:1000]
    documents = 1 + len(paragraphs)
    assert ids.count(original_tokenizer.eos_token_id) == documents
    assert ids.count(original_tokenizer.bos_token_id) == (documents if SPECIALS[family][0] else 0)

    run = tmp_path / "run"
    launch = [
        "--recipe",
        recipe,
        "--recipe",
        model_yaml,
        "--checkpoint.resume",
        str(imported),
        "--train.out_dir",
        str(run),
        "--data.tokenizer_path",  # as the fine-tuning recipes: the tokenizer that came with the imported checkpoint
        "null",
    ]
    train_cli(launch)
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["tokenizer_path"] == str(imported)
    [val_loss] = [r["val_loss"] for r in read_metrics(run) if "val_loss" in r]

    # transformers' loss on the same windows: the first 2 evaluation batches of 2 sequences of the validation file.
    val = torch.from_numpy(TokenFile(tmp_path / "data" / "val.bin").tokens[: 4 * 32 + 1].astype("int64"))
    windows = torch.stack([val[k * 32 : (k + 1) * 32 + 1] for k in range(4)])
    with torch.no_grad():
        logits = original(windows[:, :-1]).logits
    reference = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    assert abs(val_loss - reference) / reference <= 1e-5, (val_loss, reference)

    hf_out = tmp_path / "hf_out"
    tool("consolidate.py", run, hf_out)
    # generation_config.json went from the import through the run's checkpoints to the export unchanged.
    assert (hf_out / "generation_config.json").read_bytes() == (hf_in / "generation_config.json").read_bytes()
    again = transformers.AutoModelForCausalLM.from_pretrained(hf_out).eval()
    tokens = torch.randint(0, len(original_tokenizer), (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (again(tokens).logits - original(tokens).logits).abs().max().item()
    assert gap <= 1e-5, gap
    exported = transformers.AutoTokenizer.from_pretrained(hf_out)
    for sample in (text[:2000], "Café — naïve 12345 \U0001f600", "<|im_start|> as text"):
        assert exported(sample).input_ids == original_tokenizer(sample).input_ids
    assert exported.chat_template == CHAT_TEMPLATE

    # generate.py samples from the run and decodes with the run's own tokenizer (its BOS not shown).
    sample = tool("generate.py", run, "--prompt", "KING HENRY", "--max_new_tokens", "8", "--temperature", "0").stdout
    assert sample.startswith("KING HENRY") and "<|" not in sample[:10]

    # The same launch command again (after a preemption, say) continues the run instead of restarting it.
    proc = train_cli([*launch, "--train.steps", "2"])
    assert "continuing the run from its own checkpoints" in proc.stdout and "at step 1" in proc.stdout
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2]


@pytest.fixture(scope="module")
def llama_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_tokenizer")
    save_hf_tokenizer(out, "llama")
    return out


def _prepare(tiny_data, *flags):
    return tool(
        "prepare_data.py", "--recipe", tiny_data, "--input", tiny_data.parent / "corpus.txt", *flags, check=False
    )


def test_a_tiktoken_file_is_refused_naming_tokenizer_json(tiny_data, tmp_path):
    (tmp_path / "tokenizer.model").write_text("IQ== 0\nIg== 1\nIw== 2\nJA== 3\n")  # Llama 3's original/ layout
    proc = _prepare(
        tiny_data, "--data.tokenizer_path", tmp_path / "tokenizer.model", "--data.train_path", tmp_path / "t.bin"
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "is a tiktoken BPE file" in proc.stderr and "tokenizer.json" in proc.stderr, proc.stderr
    assert not (tmp_path / "t.bin").exists()


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tiny_data, tmp_path, llama_tokenizer_dir):
    proc = _prepare(tiny_data, "--data.tokenizer_path", llama_tokenizer_dir, "--data.train_path", tmp_path / "t.bin")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "(added tokens included) has 600 ids, more than model.vocab_size=512" in proc.stderr
    assert not (tmp_path / "t.bin").exists()


def test_token_files_of_another_tokenizer_are_refused(tiny_data, tmp_path, llama_tokenizer_dir):
    proc = train_cli(
        [
            "--recipe",
            str(tiny_data),
            "--train.out_dir",
            str(tmp_path),
            "--data.tokenizer_path",
            str(llama_tokenizer_dir),
            "--model.vocab_size",
            "600",
        ],
        check=False,
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "train.bin was not made with data.tokenizer_path=" in proc.stderr, proc.stderr


def test_an_existing_tokenizer_is_used_as_it_is_never_retrained(tiny_data, tmp_path, llama_tokenizer_dir):
    before = {p.name: p.read_bytes() for p in llama_tokenizer_dir.iterdir()}
    proc = _prepare(
        tiny_data,
        "--data.tokenizer_path",
        llama_tokenizer_dir,
        "--model.vocab_size",
        "600",
        "--data.train_path",
        tmp_path / "t.bin",
        "--data.val_path",
        "null",
    )
    assert proc.returncode == 0, proc.stderr
    assert {p.name: p.read_bytes() for p in llama_tokenizer_dir.iterdir()} == before
    ids = TokenFile(tmp_path / "t.bin").tokens
    fast = transformers.AutoTokenizer.from_pretrained(llama_tokenizer_dir)
    assert ids[0] == fast.bos_token_id and ids[-1] == fast.eos_token_id


def test_a_multimodal_gemma3_checkpoint_imports_its_language_model(tmp_path):
    """Gemma 3 from 4B on is published as an image-text model (Gemma3ForConditionalGeneration): its text_config, which
    spells only what differs from transformers' defaults, and its language model's weights, under the Hub's prefix, are
    imported as a Gemma3ForCausalLM (the vision tower left behind): the same logits on text, and the export is the
    text model transformers loads with them."""
    from fsdp_trainer.convert import load_model

    text = dict(vocab_size=640, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=64, query_pre_attn_scalar=24,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=639, boi_token_index=637, eoi_token_index=638)  # fmt: skip
    torch.manual_seed(0)
    original = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in original.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.2)
    original.save_pretrained(tmp_path / "hf_in", max_shard_size="100KB")
    save_hf_tokenizer(tmp_path / "hf_in", "gemma3")  # published with its tokenizer, which the import carries
    tool("import_hf.py", tmp_path / "hf_in", tmp_path / "imported")
    model_yaml = yaml.safe_load((tmp_path / "imported" / "model.yaml").read_text())["model"]
    assert model_yaml["family"] == "gemma3" and model_yaml["sliding_window_pattern"] == 2
    ours, _ = load_model(tmp_path / "imported")
    tokens = torch.randint(0, 296, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = original(input_ids=tokens).logits
        assert (ours(tokens) - expected).abs().max() <= 1e-5

    tool("consolidate.py", tmp_path / "imported", tmp_path / "hf_out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").eval()
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        assert (exported(tokens).logits - expected).abs().max() <= 1e-5


@pytest.mark.slow
def test_gemma3_trains_on_two_ranks_as_one_process(tiny_data, tmp_path):
    """Gemma 3 (local layers with a window shorter than the sequence between global ones) on 2 ranks FULL_SHARD: the
    same losses as 1 process with accumulation 2, validation included."""
    model = {"family": "gemma3", "head_dim": 32, "tie_embeddings": True, "sliding_window": 8,
             "sliding_window_pattern": 2, "rope_local_theta": 10000.0, "query_pre_attn_scalar": 24}  # fmt: skip
    two, one = tmp_path / "two", tmp_path / "one"
    train_cli(run_args(tiny_data, two, 6, model=model, train={"eval_every": 6}), nproc=2)
    train_cli(run_args(tiny_data, one, 6, model=model, data={"grad_accum_steps": 2},
                       train={"eval_every": 6, "eval_steps": 4}))  # fmt: skip
    for a, b in zip(read_metrics(two), read_metrics(one), strict=True):
        for key in {"loss", "val_loss"} & set(a):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a["step"])
