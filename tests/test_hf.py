"""Weights and tokenizer through Hugging Face: consolidate -> transformers, HF -> import -> train -> consolidate."""

from __future__ import annotations

import dataclasses
import gzip
import json
from dataclasses import asdict

import pytest
import safetensors.torch
import torch
import yaml

from fsdp_trainer.checkpoint.weights import load_model_weights, save_model_weights
from fsdp_trainer.config import ModelConfig
from fsdp_trainer.data.prepare import BUNDLED_CORPUS
from fsdp_trainer.model import Transformer
from fsdp_trainer.tokenizer import load_tokenizer
from tests.helpers import run_args, tool, train_cli

transformers = pytest.importorskip("transformers")

VARIANTS = {
    "llama": ["--model.family", "llama"],
    "llama_tied": ["--model.family", "llama", "--model.tie_embeddings", "true"],
    "qwen3": ["--model.family", "qwen3", "--model.head_dim", "32"],
    "qwen3_tied": ["--model.family", "qwen3", "--model.head_dim", "32", "--model.tie_embeddings", "true"],
}


def our_model(ckpt, cfg: ModelConfig) -> Transformer:
    model = Transformer(cfg)
    model.load_state_dict(load_model_weights(ckpt, {k: v.shape for k, v in model.state_dict().items()}))
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_consolidated_checkpoint_matches_in_transformers(tiny_data, tmp_path, variant):
    nproc = 2 if variant == "llama_tied" else 1  # a checkpoint of any world size consolidates the same way
    run = tmp_path / "run"
    flags = ["--train.steps", "2", "--checkpoint.every", "2", *VARIANTS[variant]]
    train_cli(["--recipe", str(tiny_data), "--train.out_dir", str(run), *flags], nproc=nproc)
    out = tmp_path / "hf"
    tool("consolidate.py", run, out, "--verify", "hf")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"
    ]  # fmt: skip

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    cfg = ModelConfig(**{**json.loads((tiny_data).read_text())["model"], **_flags_to_model(VARIANTS[variant])})
    ours = our_model(run / "checkpoints" / "step_00000002", cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)

    # The HF tokenizer gives our ids: same pieces, newlines, spaces and byte fallback.
    sp = load_tokenizer(out / "tokenizer.model")
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        samples = f.read(60_000).split("\n\n")[:200] + ["Café — naïve 12345 \U0001f600  x  ", "<s> and </s> as text"]
    for text in samples:
        assert hf_tok.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert hf_tok.decode(sp.encode(text)) == text


def _flags_to_model(flags: list[str]) -> dict:
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    out = {k.removeprefix("--model."): v for k, v in pairs.items()}
    if "head_dim" in out:
        out["head_dim"] = int(out["head_dim"])
    if "tie_embeddings" in out:
        out["tie_embeddings"] = out["tie_embeddings"] == "true"
    return out


# Llama 3.1's and 3.2's rope scaling over a pretraining context short enough to reach this tiny model's wavelengths.
LLAMA3_SCALING = {
    "llama3.1": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 32},
    "llama3.2": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 48},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "llama3.1", "llama3.2", "qwen3"])
def test_hf_import_train_zero_steps_consolidate_is_identity(tiny_data, tmp_path, family):
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_theta=20000.0, tie_word_embeddings=family in ("qwen3", "llama3.2"))  # fmt: skip
    if family in LLAMA3_SCALING:
        common["rope_scaling"] = dict(LLAMA3_SCALING[family])  # transformers adds rope_theta to the dict it gets
    config_cls = transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(config_cls(**common))
    original.save_pretrained(tmp_path / "hf_in", max_shard_size="100KB")  # sharded, with an index, as published
    assert (tmp_path / "hf_in" / "model.safetensors.index.json").is_file()

    tool("import_hf.py", tmp_path / "hf_in", tmp_path / "imported")
    run = tmp_path / "run"
    proc = train_cli(["--recipe", str(tiny_data), "--recipe", str(tmp_path / "imported" / "model.yaml"),
                      "--checkpoint.resume", str(tmp_path / "imported"), "--train.steps", "0",
                      "--checkpoint.every", "1", "--train.out_dir", str(run)])  # fmt: skip
    assert "loaded weights from" in proc.stdout
    tool("consolidate.py", run, tmp_path / "hf_out")

    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out")
    before, after = original.state_dict(), again.state_dict()
    assert set(before) == set(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    # The same weights under the same config (rope scaling included) compute the same logits.
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(original.eval()(tokens).logits, again.eval()(tokens).logits)
    scaling = yaml.safe_load((tmp_path / "imported" / "model.yaml").read_text())["model"]["rope_scaling"]
    expected = dict(LLAMA3_SCALING[family]) if family in LLAMA3_SCALING else None  # rope_type llama3 included
    assert scaling == expected


def test_large_models_are_sharded_with_an_index(tmp_path):
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=512, max_seq_len=64)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    model_yaml = yaml.safe_dump({"model": asdict(cfg)})
    save_model_weights(model.state_dict(), tmp_path / "ck", {"recipe.yaml": model_yaml.encode()})
    tool("consolidate.py", tmp_path / "ck", tmp_path / "hf", "--max_shard_gb", "0.0001", "--dtype", "bf16")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((tmp_path / "hf" / f).is_file() for f in files)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert hf.dtype == torch.bfloat16
    torch.testing.assert_close(hf.state_dict()["model.norm.weight"], model.state_dict()["model.norm.weight"].bfloat16())


def test_tool_errors_are_one_line(tiny_data, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    proc = tool("consolidate.py", tmp_path / "nope", tmp_path / "out", check=False)
    assert proc.returncode == 1 and proc.stderr.strip() == f"error: checkpoint {tmp_path / 'nope'} does not exist"
    (tmp_path / "hf").mkdir()
    for rope, message in (
        ({"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type='yarn' is not supported"),
        ({"type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type='dynamic' is not supported"),
        ({"rope_type": "llama3", "factor": 32.0}, "llama3 rope scaling lacks low_freq_factor"),
    ):
        (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama", "rope_scaling": rope}))
        proc = tool("import_hf.py", tmp_path / "hf", tmp_path / "imp", check=False)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert (tmp_path / "full" / "x").read_text() == "keep me"


def test_export_hf_at_the_end_of_a_sharded_run_equals_consolidate(tiny_data, tmp_path):
    """checkpoint.export_hf on 2 ranks: each writes its shards, DCP consolidates them; the tensors are bit-exact
    consolidate.py's from the last checkpoint, the config the same, and transformers loads it without a missing key."""
    run = tmp_path / "run"
    train_cli(run_args(tiny_data, run, 3, checkpoint={"every": 3, "export_hf": True}), nproc=2)
    tool("consolidate.py", run, tmp_path / "consolidated", "--verify", "files")
    exported = {}
    for path in sorted((run / "hf").glob("*.safetensors")):
        exported.update(safetensors.torch.load_file(path))
    consolidated = safetensors.torch.load_file(tmp_path / "consolidated" / "model.safetensors")
    assert sorted(exported) == sorted(consolidated)
    assert all(torch.equal(exported[name], consolidated[name]) for name in consolidated)
    config = json.loads((run / "hf" / "config.json").read_text())
    assert config == json.loads((tmp_path / "consolidated" / "config.json").read_text())
    assert not (run / "hf" / "sharded").exists() and not (run / ".hf.partial").exists()
    _, info = transformers.AutoModelForCausalLM.from_pretrained(run / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))


def test_import_holds_one_tensor_at_a_time_and_writes_what_it_read(tmp_path, monkeypatch):
    """import_hf reads each tensor as DCP writes it (one file per tensor, since DCP's writer holds a file's tensors
    until the file is done), so when a tensor is read only the one written before it may still be alive (DCP's loop
    variable): memory bounded by two tensors, not the model (docs/benchmarks.md measures it on 2.3 GB; a single file
    held all 20 here). The checkpoint holds exactly the published tensors."""
    import weakref

    from fsdp_trainer.convert import import_hf
    from fsdp_trainer.hf import StoredTensor

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    published = transformers.LlamaForCausalLM(config)  # fp32: the tensor read is the tensor written
    published.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    alive, most_alive = [], [0]

    class Buffer(bytearray):  # what StoredTensor.read reads into, but one a weak reference can watch
        pass

    def read(entry):  # freed when no reference is left, without a garbage collection's help
        alive[:] = [ref for ref in alive if ref() is not None]
        most_alive[0] = max(most_alive[0], len(alive))
        with open(entry.path, "rb") as f:
            f.seek(entry.offset)
            data = Buffer(f.read(entry.nbytes))
        alive.append(weakref.ref(data))
        return torch.frombuffer(data, dtype=entry.dtype).reshape(entry.shape)

    monkeypatch.setattr(StoredTensor, "read", read)
    path = import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"))
    assert most_alive[0] == 1
    expected = {name: t for name, t in published.state_dict().items() if "rotary" not in name}
    saved = load_model_weights(path, {name: t.shape for name, t in expected.items()})
    assert all(torch.equal(saved[name], expected[name]) for name in expected)
    assert len(list(path.glob("*.distcp"))) == len(expected)


def test_the_exported_config_carries_the_tokenizers_pad_token_id():
    from types import SimpleNamespace

    from fsdp_trainer.config import ModelConfig
    from fsdp_trainer.hf import hf_config

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512, max_seq_len=64)
    padded = SimpleNamespace(bos_id=1, eos_id=2, pad_id=5)
    assert hf_config(cfg, "fp32", padded)["pad_token_id"] == 5
    assert "pad_token_id" not in hf_config(cfg, "fp32", SimpleNamespace(bos_id=1, eos_id=2, pad_id=None))
    reward = hf_config(dataclasses.replace(cfg, num_labels=1), "fp32", None)
    assert reward["pad_token_id"] is None and reward["id2label"] == {"0": "LABEL_0"}
