"""QLoRA: the frozen projections in NF4 through torchao, sharded by FSDP2: each rank's shard is its rows of torchao's
quantization of the whole weight, the model computes with exactly those weights, only the adapters train, and a run on
an imported model is the same on 2 ranks as on one process, resumes bitwise and exports."""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from fsdp_trainer.adapters import meta_model
from fsdp_trainer.adapters.lora import LoRALinear, apply_lora, init_lora, is_adapter
from fsdp_trainer.adapters.nf4 import (
    BLOCK,
    VALUES_PER_SCALER_BLOCK,
    check_nf4_shapes,
    fill_shard,
    is_nf4,
    quantize_frozen,
    require_torchao,
    to_nf4,
)
from fsdp_trainer.config import LoraConfig, ModelConfig, OptimConfig, ParallelConfig
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import fill_local_shard, materialize, parallelize
from fsdp_trainer.metrics import local_gb
from fsdp_trainer.model import Transformer
from fsdp_trainer.optim import build_optimizer
from fsdp_trainer.train import train_step
from tests.helpers import REPO, run_args, run_distributed, tool, train_cli, train_losses
from tests.test_chat import CHATML
from tests.test_real_models import save_hf_tokenizer

RECIPES = REPO / "recipes"
BUNDLED_CHAT = REPO / "fsdp_trainer" / "assets" / "shakespeare_chat.jsonl.gz"

require_torchao()  # a test dependency; imported quietly
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# The smallest shapes whose projections split into whole NF4 scale blocks (16,384 values) over 2 ranks.
QSMALL = ModelConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=64, max_seq_len=16)
LORA = LoraConfig(rank=4, alpha=8.0, quantize_base="nf4")


def _qlora_model(world: int):
    """QSMALL as build_model makes it for a QLoRA run on `world` gloo ranks, and its optimizer."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        model = Transformer(QSMALL)
    apply_lora(model, LORA, frozen_dtype=torch.float32)
    quantize_frozen(model)
    applied = parallelize(model, ParallelConfig(mixed_precision="fp32"), mesh)
    materialize(model, torch.device("cpu"), 0, applied.cpu_offload, fill=fill_shard)
    init_lora(model, 0, fill_local_shard, torch.device("cpu"))
    return model, build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0))


def _nf4_parts(model, copy: bool = True) -> dict[str, list[torch.Tensor]]:
    """Every quantized shard's stored parts (4-bit data, scales, their factors and mean), copied unless not `copy`."""
    parts = {}
    for name, param in model.named_parameters():
        if is_nf4(param):
            local = param._local_tensor
            kept = [getattr(local, part) for part in local.__tensor_flatten__()[0]]
            parts[name] = [t.clone() for t in kept] if copy else kept
    return parts


def _shards_are_torchaos_whole_weight_quantized(rank, world):
    model, optimizer = _qlora_model(world)
    reference = Transformer(QSMALL)
    reference.init_weights(seed=0)  # the same seeded weights, unsharded and unquantized
    wanted = {name: to_nf4(w.detach()).to(torch.float32) for name, w in reference.named_parameters() if w.ndim == 2}
    block = model.model.layers["0"]
    assert isinstance(block, FSDPModule)
    block.unshard()  # FSDP2's all-gather of the NF4 shards, through torchao's hooks
    quantized = 0
    for name, module in block.named_modules():
        if isinstance(module, LoRALinear):
            full_name = f"model.layers.0.{name}.weight"
            assert is_nf4(module.weight), full_name
            # The gathered weight is torchao's quantization of the whole weight, bit for bit, at 2 ranks as at 1.
            assert torch.equal(module.weight.to(torch.float32), wanted[full_name]), full_name
            original = reference.get_parameter(full_name).detach()
            error = (wanted[full_name] - original).norm() / original.norm()
            assert 0 < error < 0.12, (full_name, error)  # 4 bits: close to the weight, not equal to it
            quantized += 1
    block.reshard()
    assert quantized == 7
    # A rank stores its rows' parts alone, not the whole weight's storage that its rows were cut from.
    for name, parts in _nf4_parts(model, copy=False).items():
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in parts), name

    # The model computes with exactly those weights: logits equal a plain model holding the dequantized weights.
    with torch.no_grad():
        for name, values in wanted.items():
            if any(f".{target}." in name for target in LORA.targets):
                reference.get_parameter(name).copy_(values)
    tokens = torch.randint(0, QSMALL.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-5, atol=1e-5)
    block.reshard()  # the last block stays gathered after a forward that has no backward

    # Only the adapters are optimized and change; the 4-bit parts stay bitwise.
    before = _nf4_parts(model)
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {
        id(p) for name, p in model.named_parameters() if is_adapter(name)
    }
    adapters = {name: p.full_tensor().clone() for name, p in model.named_parameters() if is_adapter(name)}
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        batch = torch.randint(0, QSMALL.vocab_size, (2, 17), generator=generator)
        train_step(model, optimizer, [MicroBatch(batch[:, :-1], batch[:, 1:], None)], 1e-2, 1.0)
    after = _nf4_parts(model)
    assert before.keys() == after.keys() and len(before) == 7
    assert all(torch.equal(a, b) for name in before for a, b in zip(before[name], after[name], strict=True))
    assert all(not torch.equal(p.full_tensor(), adapters[n]) for n, p in model.named_parameters() if is_adapter(n))


def test_nf4_shards_are_torchaos_quantization_of_the_whole_weight_and_only_adapters_train():
    run_distributed(_shards_are_torchaos_whole_weight_quantized)


def test_the_state_probe_counts_the_bytes_nf4_stores():
    """metrics.jsonl's params_gb (and bench_lora's state) count a 4-bit weight's stored parts, not its logical size:
    4 bits a value, an int8 scale per 64 values, a factor per 16,384 scales' block, the mean and the 16-entry table."""
    weight = to_nf4(torch.randn(512, 256))
    values = 512 * 256
    stored = values // 2 + values // BLOCK + 4 * (values // VALUES_PER_SCALER_BLOCK) + 4 + 16 * 4
    assert local_gb([weight]) * 1e9 == pytest.approx(stored, abs=0.5)
    assert local_gb([torch.randn(512, 256)]) * 1e9 == 4 * values


def test_nf4_shapes_that_do_not_split_are_one_line_naming_the_projection():
    check_nf4_shapes(meta_model(QSMALL, LORA), 2)
    with pytest.raises(ValueError, match=r"k_proj \(128 x 256\) does not split .* shard group of 4 ranks"):
        check_nf4_shapes(meta_model(QSMALL, LoraConfig(rank=4, targets=["q_proj", "k_proj"])), 4)
    # Qwen3's explicit head_dim sets the projections' shapes, not dim / n_heads (which would make q_proj 256 x 256).
    qwen3 = dataclasses.replace(QSMALL, family="qwen3", head_dim=32)
    with pytest.raises(ValueError, match=r"q_proj \(128 x 256\) does not split .* shard group of 4 ranks"):
        check_nf4_shapes(meta_model(qwen3, LoraConfig(rank=4, targets=["q_proj"])), 4)
    tiny = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64, max_seq_len=16)
    with pytest.raises(ValueError, match=r"q_proj \(64 x 64\) is not a whole number of NF4 scale blocks"):
        check_nf4_shapes(meta_model(tiny, LoraConfig(rank=4, targets=["q_proj"])), 1)
    with pytest.raises(ValueError, match="lora.quantize_base=nf4 needs lora.rank: it quantizes"):
        LoraConfig(quantize_base="nf4")


def _walkthrough_args(tmp_path, out, steps: int, quantize: str | None = "nf4", **sections) -> list[str]:
    """The README's launch of recipes/lora_qwen3_0.6b.yaml on the imported model, sized for a CPU."""
    sized = {
        "data": {"train_path": tmp_path / "data" / "train.bin", "val_path": tmp_path / "data" / "val.bin",
                 "seq_len": 64, "micro_batch_size": 2, **sections.pop("data", {})},
        "parallel": {"mixed_precision": "fp32", "compile": False, "activation_checkpointing": "none"},
        "lora": {"rank": 4, "alpha": 8.0, "quantize_base": quantize},
        "optim": {"warmup_steps": 0, "lr": 1e-2, "min_lr": 1e-2},
        "train": {"loss_chunks": 1, "log_every": 1, "eval_every": 0},
        "checkpoint": {"every": 3, "keep_last": 0},
    }  # fmt: skip
    recipes = ["--recipe", str(RECIPES / "lora_qwen3_0.6b.yaml"), "--recipe", str(tmp_path / "imported" / "model.yaml")]
    resume = ["--checkpoint.resume", str(tmp_path / "imported")]
    return [*recipes, *resume, *run_args("", out, steps, **sized, **sections)[2:]]


@pytest.mark.slow
def test_qlora_walkthrough_on_conversations_two_ranks_equal_one_process_resume_and_export(tmp_path):
    """README's commands for recipes/lora_qwen3_0.6b.yaml with lora.quantize_base nf4, on a Qwen3 saved by
    transformers (sharded) with a ChatML tokenizer, and conversations in the bundled chat set's format; 2 ranks as data
    parallel and as a context-parallel pair each equal 1 process."""
    hf_in = tmp_path / "hf_in"
    tokenizer = save_hf_tokenizer(hf_in, "qwen3", CHATML)
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer) + 8, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.Qwen3ForCausalLM(config).eval()
    base.save_pretrained(hf_in, max_shard_size="1MB")
    tool("import_hf.py", hf_in, tmp_path / "imported")
    with gzip.open(BUNDLED_CHAT, "rt") as f:
        (tmp_path / "my_chats.jsonl").write_text("".join(f.readline() for _ in range(300)))
    data = ["--data.train_path", tmp_path / "data" / "train.bin", "--data.val_path", tmp_path / "data" / "val.bin"]
    recipe, chats = RECIPES / "lora_qwen3_0.6b.yaml", tmp_path / "my_chats.jsonl"
    tokenizer_path, seq_len = ["--data.tokenizer_path", tmp_path / "imported"], ["--data.seq_len", "64"]
    tool("prepare_data.py", "--recipe", recipe, "--format", "chat", "--input", chats, *tokenizer_path, *data, *seq_len)

    two, one, split = tmp_path / "two", tmp_path / "one", tmp_path / "split"
    train_cli(_walkthrough_args(tmp_path, two, 6), nproc=2)
    train_cli(_walkthrough_args(tmp_path, one, 6, data={"grad_accum_steps": 2}))
    # and 2 ranks splitting each window (context parallelism): the one process's micro-batches, a half each
    halves = ["--parallel.context_parallel", "2"]
    train_cli([*_walkthrough_args(tmp_path, split, 6, data={"grad_accum_steps": 2}), *halves], nproc=2)
    losses = train_losses(two)
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1]  # it learns
    for run in (losses, train_losses(split)):
        torch.testing.assert_close(
            torch.tensor([train_losses(one)[s] for s in range(1, 7)]), torch.tensor([run[s] for s in range(1, 7)]),
            rtol=1e-5, atol=0,
        )  # fmt: skip
    # The base is the imported model in torchao's NF4: step 1 equals a LoRA run on that model with its projections
    # replaced by their dequantized NF4 values, imported the same way.
    with torch.no_grad():
        for name, param in base.named_parameters():
            if name.endswith(tuple(f"{target}.weight" for target in LORA.targets)):
                param.copy_(to_nf4(param).to(torch.float32))
    base.save_pretrained(tmp_path / "hf_nf4", max_shard_size="1MB")
    tokenizer.save_pretrained(tmp_path / "hf_nf4")
    tool("import_hf.py", tmp_path / "hf_nf4", tmp_path / "imported_nf4")
    dequantized = tmp_path / "dequantized"
    args = _walkthrough_args(tmp_path, dequantized, 1, quantize=None, data={"grad_accum_steps": 2})
    train_cli([a.replace(str(tmp_path / "imported"), str(tmp_path / "imported_nf4")) for a in args])
    assert train_losses(dequantized)[1] == pytest.approx(losses[1], rel=1e-6, abs=0)

    # Resume on the same world size is bitwise: the base is read and quantized again, to the same bits.
    halfway = tmp_path / "halfway"
    shutil.copytree(two, halfway)
    shutil.rmtree(halfway / "checkpoints" / "step_00000006")
    (halfway / "checkpoints" / "latest").write_text("step_00000003\n")
    records = (halfway / "metrics.jsonl").read_text().splitlines(keepends=True)
    (halfway / "metrics.jsonl").write_text("".join(r for r in records if json.loads(r).get("step", 0) <= 3))
    proc = train_cli(_walkthrough_args(tmp_path, halfway, 6), nproc=2)
    assert "at step 3" in proc.stdout
    assert train_losses(halfway) == losses

    # Exports: a PEFT adapter directory and a merged HF model; PEFT on the original base equals the merged model.
    tool("consolidate.py", two, tmp_path / "adapter_out", "--lora", "adapter")
    tool("consolidate.py", two, tmp_path / "merged_out", "--lora", "merge")
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_in).eval()  # as published, not quantized
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter_out").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged_out").eval()
    tokens = torch.randint(0, len(tokenizer), (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=tokens).logits, merged(tokens).logits, rtol=1e-5, atol=1e-5)
