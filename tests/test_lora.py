"""LoRA: adapters applied from outside the model, against PEFT on a transformers model built from a config (logits
and gradients), and trained sharded on 2 gloo ranks against one process, with resume and consolidation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from fsdp_trainer.adapters.lora import apply_lora, init_lora, is_adapter
from fsdp_trainer.checkpoint import load_model_weights
from fsdp_trainer.config import LORA_TARGETS, LoraConfig, ModelConfig
from fsdp_trainer.hf import model_config_from_hf
from fsdp_trainer.model import Transformer
from tests.helpers import run_args, train_cli, train_losses
from tests.test_hf import tool

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = LoraConfig(rank=4, alpha=8.0)


def _hf_model():
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval(), model_config_from_hf(config.to_dict(), "test")


def test_adapters_give_peft_logits_and_gradients():
    hf, cfg = _hf_model()
    ours = Transformer(cfg)
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("rope_") for name in missing)
    apply_lora(ours, LORA)
    init_lora(ours, seed=0, fill=lambda param, values: param.copy_(values), device=torch.device("cpu"))
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == {
        n for n, _ in ours.named_parameters() if is_adapter(n)
    }
    reference = peft.get_peft_model(
        hf, peft.LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
    )
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with reference.disable_adapter():
            base = reference(input_ids=tokens).logits
        # Step 0: B is zero in both, so both are the base model exactly.
        torch.testing.assert_close(ours(tokens), base, rtol=0, atol=1e-5)
        torch.testing.assert_close(reference(input_ids=tokens).logits, base, rtol=0, atol=0)

    # The same adapters in both (PEFT's A, a random B), then the logits and the gradients of A and B.
    theirs = dict(reference.named_parameters())
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if is_adapter(name):
                peft_name = "base_model.model." + name.replace(".weight", ".default.weight")
                if ".lora_B." in name:
                    theirs[peft_name].copy_(torch.randn(param.shape, generator=generator) * 0.1)
                param.copy_(theirs[peft_name])
    targets = torch.randint(0, cfg.vocab_size, tokens.shape, generator=generator)
    logits = ours(tokens)
    reference_logits = reference(input_ids=tokens).logits
    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=1e-5)
    assert (logits - base).abs().max() > 1e-2  # the adapters do change the output
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(reference_logits.flatten(0, 1), targets.flatten()).backward()
    for name, param in ours.named_parameters():
        if is_adapter(name):
            expected = theirs["base_model.model." + name.replace(".weight", ".default.weight")].grad
            torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-7)
        else:
            assert param.grad is None  # frozen


def _values(losses: dict[int, float]) -> torch.Tensor:
    return torch.tensor([losses[step] for step in sorted(losses)])


def _lora_args(tiny_data, out, steps, **overrides):
    constant = {"warmup_steps": 0, "min_lr": 1e-2, "lr": 1e-2}
    return run_args(tiny_data, out, steps, lora={"rank": 4, "alpha": 8.0}, optim=constant, **overrides)


@pytest.mark.slow
def test_lora_two_ranks_equal_one_process_resume_and_only_adapters_change(tiny_data, tmp_path):
    every = {"every": 5, "keep_last": 0}
    two = tmp_path / "two"
    train_cli(_lora_args(tiny_data, two, 10, checkpoint=every), nproc=2)
    one = tmp_path / "one"
    train_cli(_lora_args(tiny_data, one, 10, checkpoint=every, data={"grad_accum_steps": 2}))
    losses_two, losses_one = train_losses(two), train_losses(one)
    assert sorted(losses_two) == sorted(losses_one) == list(range(1, 11))
    assert losses_two[10] < losses_two[1]  # it learns
    torch.testing.assert_close(_values(losses_one), _values(losses_two), rtol=1e-5, atol=0)

    # Resume on the same world size: bitwise; from 2 ranks onto 1: to float order.
    halfway = tmp_path / "halfway"
    train_cli(_lora_args(tiny_data, halfway, 5, checkpoint=every), nproc=2)
    train_cli(_lora_args(tiny_data, halfway, 10, checkpoint=every), nproc=2)
    assert train_losses(halfway) == losses_two
    moved = tmp_path / "moved"
    shutil.copytree(two, moved)
    shutil.rmtree(moved / "checkpoints" / "step_00000010")
    (moved / "checkpoints" / "latest").write_text("step_00000005\n")
    proc = train_cli(_lora_args(tiny_data, moved, 10, checkpoint=every, data={"grad_accum_steps": 2}))
    assert "at step 5" in proc.stdout
    torch.testing.assert_close(_values(train_losses(moved)), _values(losses_two), rtol=1e-5, atol=0)

    # The frozen weights are the init's, to the bit; the adapters moved.
    cfg = ModelConfig(**json.loads(tiny_data.read_text())["model"])
    with torch.device("meta"):
        model = Transformer(cfg)
        apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    start = load_model_weights(two / "checkpoints" / "step_00000005", shapes)
    end = load_model_weights(two / "checkpoints" / "step_00000010", shapes)
    init = Transformer(cfg)
    init.init_weights(seed=0)
    for name, tensor in end.items():
        if is_adapter(name):
            assert not torch.equal(tensor, start[name]), name
        elif not name.startswith("rope_"):
            assert torch.equal(tensor, init.state_dict()[name]), name
    assert any(end[n].abs().max() > 0 for n in end if n.endswith("lora_B.weight"))


@pytest.mark.slow
def test_lora_from_an_imported_model_starts_as_it_and_consolidates_merged(tiny_data, tmp_path):
    """import_hf's weights-only checkpoint is the base: step 0's loss is the base model's; consolidate merges the
    adapters into the weights, and transformers' logits on the result equal our model's with its adapters."""
    hf, cfg = _hf_model()
    hf.save_pretrained(tmp_path / "hf_in")
    tool("import_hf.py", tmp_path / "hf_in", tmp_path / "imported")
    model_yaml = tmp_path / "imported" / "model.yaml"
    run = tmp_path / "run"
    args = ["--recipe", str(tiny_data), "--recipe", str(model_yaml), "--checkpoint.resume", str(tmp_path / "imported")]
    overrides = _lora_args(tiny_data, run, 4, checkpoint={"every": 4}, data={"seq_len": 16})[2:]
    train_cli([*args, *overrides])
    base_run = tmp_path / "base"
    base_args = [a if a != str(run) else str(base_run) for a in overrides]
    lora_at = base_args.index("--lora.rank")
    train_cli([*args, *base_args[:lora_at], "--lora.rank", "null", *base_args[lora_at + 2 :], "--train.steps", "1"])
    assert train_losses(run)[1] == pytest.approx(train_losses(base_run)[1], rel=1e-6, abs=0)

    tool("consolidate.py", run, tmp_path / "merged", "--verify", "files")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.device("meta"):
        ours = Transformer(cfg)
        apply_lora(ours, LoraConfig(rank=4, alpha=8.0))
    shapes = {name: t.shape for name, t in ours.state_dict().items()}
    state = load_model_weights(run / "checkpoints" / "step_00000004", shapes)
    ours = Transformer(cfg)
    apply_lora(ours, LoraConfig(rank=4, alpha=8.0))
    ours.load_state_dict(state)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() > 1e-4  # trained: not the base any more
        torch.testing.assert_close(merged(tokens).logits, ours.eval()(tokens), rtol=1e-5, atol=1e-5)

    # The adapters alone, as PEFT's adapter directory, onto the base model: the same logits.
    tool("consolidate.py", run, tmp_path / "adapter", "--lora", "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"
    ]  # fmt: skip
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)
    proc = tool("consolidate.py", base_run, tmp_path / "none", "--lora", "adapter", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "was trained without LoRA" in proc.stderr
