"""LoRA: adapters applied from outside the model, against PEFT on a transformers model built from a config (logits
and gradients), and trained sharded on 2 gloo ranks against one process, with resume and consolidation."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from fsdp_trainer.adapters.lora import apply_lora, init_lora, is_adapter
from fsdp_trainer.checkpoint.storage import read_metadata
from fsdp_trainer.checkpoint.weights import load_model_weights
from fsdp_trainer.config import LORA_PROJECTIONS, LORA_TARGETS, LoraConfig, ModelConfig, OptimConfig, ParallelConfig
from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import fill_local_shard, materialize, parallelize
from fsdp_trainer.hf import model_config_from_hf
from fsdp_trainer.model import Transformer, unwrapped_name
from fsdp_trainer.optim import build_optimizer
from fsdp_trainer.train import train_step
from tests.helpers import run_args, run_distributed, tool, train_cli, train_losses

DENSE_TARGETS = [target for target in LORA_TARGETS if target != "experts"]
"""Every target a dense model has (tests/test_moe.py adapts the experts of a mixture)."""

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = LoraConfig(rank=4, alpha=8.0)


def _hf_model(seed: int = 0, family: str = "llama"):
    shape = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6)  # fmt: skip
    if family == "gemma3":  # both layer types, a window shorter than the tokens, norms moved off their start
        config = transformers.Gemma3TextConfig(**shape, head_dim=8, query_pre_attn_scalar=12, sliding_window=6,
                                               layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    else:
        config = transformers.LlamaConfig(**shape, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if family == "gemma3" and "norm" in name:
                param.normal_(0.0, 0.2)
    return model, model_config_from_hf(config.to_dict(), "test")


def _peft_name(name: str) -> str:
    """Our adapter's name in a PeftModel: `.default` for the adapter's name, before `.weight` of a linear layer's
    factors, after an embedding's (ParameterDict entries)."""
    if ".lora_embedding_" in name:
        return "base_model.model." + name + ".default"
    return "base_model.model." + name.replace(".weight", ".default.weight")


@pytest.mark.parametrize(
    ("family", "targets"),
    [("llama", LORA_PROJECTIONS), ("llama", DENSE_TARGETS), ("gemma3", LORA_PROJECTIONS)],
    ids=["blocks", "and_lm_head_embed_tokens", "gemma3"],
)
def test_adapters_give_peft_logits_and_gradients(family, targets):
    hf, cfg = _hf_model(family=family)
    ours = Transformer(cfg)
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("rope_") for name in missing)
    lora = LoraConfig(rank=LORA.rank, alpha=LORA.alpha, targets=list(targets))
    apply_lora(ours, lora)
    names = dict(ours.named_parameters())
    assert (
        ("lm_head.lora_A.weight" in names) == ("model.embed_tokens.lora_embedding_A" in names) == ("lm_head" in targets)
    )
    init_lora(ours, seed=0, fill=lambda param, values: param.copy_(values), device=torch.device("cpu"))
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == {
        n for n, _ in ours.named_parameters() if is_adapter(n)
    }
    reference = peft.get_peft_model(
        hf, peft.LoraConfig(r=LORA.rank, lora_alpha=LORA.alpha, lora_dropout=0.0, target_modules=list(targets))
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
                peft_name = _peft_name(name)
                if ".lora_B." in name or ".lora_embedding_A" in name:  # the factor that starts at zero
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
            torch.testing.assert_close(param.grad, theirs[_peft_name(name)].grad, rtol=1e-5, atol=1e-7)
        else:
            assert param.grad is None  # frozen


def _values(losses: dict[int, float]) -> torch.Tensor:
    return torch.tensor([losses[step] for step in sorted(losses)])


def _lora_args(tiny_data, out, steps, lora_extra=None, **overrides):
    constant = {"warmup_steps": 0, "min_lr": 1e-2, "lr": 1e-2}
    lora = {"rank": 4, "alpha": 8.0, **(lora_extra or {})}
    return run_args(tiny_data, out, steps, lora=lora, optim=constant, **overrides)


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

    # A LoRA checkpoint holds the adapters, their optimizer state and the training state, not the frozen weights.
    saved = read_metadata(two / "checkpoints" / "step_00000010").state_dict_metadata
    model_keys = [key for key in saved if key.startswith("model.")]
    assert model_keys and all(is_adapter(key) for key in model_keys)
    assert all(is_adapter(key) for key in saved if key.startswith("optim.state."))


SMALL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)


def _sharded_lora_model(world: int, precision: str, frozen_dtype: torch.dtype | None = None):
    """SMALL with adapters, sharded over `world` gloo ranks and initialised as build_model does, and its optimizer."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        model = Transformer(SMALL)
    apply_lora(model, LORA, frozen_dtype=frozen_dtype)
    applied = parallelize(model, ParallelConfig(mixed_precision=precision), mesh)
    materialize(model, torch.device("cpu"), 0, applied.cpu_offload)
    init_lora(model, 0, fill_local_shard, torch.device("cpu"))
    return model, build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0))


def _three_steps(model, optimizer, rank: int) -> list[float]:
    """Three optimizer steps on random tokens (each rank its own); their losses."""
    generator, losses = torch.Generator().manual_seed(rank), []
    for _ in range(3):
        tokens = torch.randint(0, SMALL.vocab_size, (2, 17), generator=generator)
        stats = train_step(model, optimizer, [MicroBatch(tokens[:, :-1], tokens[:, 1:], None)], 1e-2, 1.0)
        losses.append(stats["loss"].item())
    return losses


def _frozen_weights_stay_bitwise(rank, world):
    model, optimizer = _sharded_lora_model(world, "fp32")
    before = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {
        id(p) for name, p in model.named_parameters() if is_adapter(name)
    }
    _three_steps(model, optimizer, rank)
    for name, param in model.named_parameters():
        if is_adapter(name):
            assert not torch.equal(param.full_tensor(), before[name]), name
        else:
            assert torch.equal(param.full_tensor(), before[name]), name


def test_only_the_adapters_change_and_only_they_have_optimizer_state():
    run_distributed(_frozen_weights_stay_bitwise)


def _bf16_frozen_weights(rank, world):
    losses = {}
    for frozen_dtype in (None, torch.bfloat16):
        model, optimizer = _sharded_lora_model(world, "bf16", frozen_dtype)
        if frozen_dtype is not None:  # stored as it is gathered: half the bytes; the adapters stay fp32
            dtypes = {name: p.dtype for name, p in model.named_parameters()}
            assert all(d == (torch.float32 if is_adapter(n) else torch.bfloat16) for n, d in dtypes.items()), dtypes
        losses[frozen_dtype] = _three_steps(model, optimizer, rank)
    assert losses[None] == losses[torch.bfloat16]  # the same bf16 weights reach the matmuls either way: bitwise


def test_frozen_weights_held_in_bf16_train_bitwise_as_fp32_shards_gathered_to_bf16():
    run_distributed(_bf16_frozen_weights)


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
    # Every projection and the output layer (untied here), through training, both exports and a PEFT start.
    all_targets = {"targets": "[" + ", ".join(DENSE_TARGETS) + "]"}
    overrides = _lora_args(tiny_data, run, 4, checkpoint={"every": 4}, data={"seq_len": 16}, lora_extra=all_targets)[2:]
    # Without the import's model section: refused before any model is built, with the fix.
    forgot = train_cli([*args[:2], *args[4:], *overrides], check=False)
    assert forgot.returncode == 1 and forgot.stderr.strip().splitlines()[-1].endswith(
        f"the recipe's model section differs from the run that saved it; add `--recipe {model_yaml}` after your "
        "recipe (the model section of that import)"
    ), forgot.stderr
    train_cli([*args, *overrides])
    base_run = tmp_path / "base"
    base_args = [a if a != str(run) else str(base_run) for a in overrides]
    lora_at = base_args.index("--lora.rank")
    train_cli([*args, *base_args[:lora_at], "--lora.rank", "null", *base_args[lora_at + 2 :], "--train.steps", "1"])
    assert train_losses(run)[1] == pytest.approx(train_losses(base_run)[1], rel=1e-6, abs=0)

    tool("consolidate.py", run, tmp_path / "merged", "--verify", "files")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    # Ours: the imported weights and the run's adapters (all its checkpoint holds of the model).
    ours = Transformer(cfg)
    apply_lora(ours, LoraConfig(rank=4, alpha=8.0, targets=list(DENSE_TARGETS)))
    shapes = {name: t.shape for name, t in ours.state_dict().items() if is_adapter(name)}
    adapters = load_model_weights(run / "checkpoints" / "step_00000004", shapes)
    missing, unexpected = ours.load_state_dict({**hf.state_dict(), **adapters}, strict=False)
    assert not unexpected and all(name.startswith("rope_") for name in missing)
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
    # A new run from the same base and that PEFT adapter starts with exactly its adapters; another rank: one line.
    cont = tmp_path / "cont"
    start = [a if a != str(run) else str(cont) for a in overrides]
    train_cli([*args, *start, "--lora.adapter", str(tmp_path / "adapter"), "--train.steps", "0"])  # saves step 0
    started = load_model_weights(cont / "checkpoints" / "step_00000000", shapes)
    assert all(torch.equal(started[name], adapters[name]) for name in shapes)
    peft_start = [*args, *start, "--lora.adapter", str(tmp_path / "adapter")]
    wrong_rank = train_cli([*peft_start, "--lora.rank", "8"], check=False)
    assert wrong_rank.returncode == 1 and wrong_rank.stderr.count("\n") == 1, wrong_rank.stderr
    assert "adapter_config.json has r=4, the recipe lora.rank=8; make them agree" in wrong_rank.stderr

    # The same command again (a preemption, a restart) goes on from the run's own checkpoint, on the same base.
    again = train_cli([*args, *overrides, "--train.steps", "6"])
    assert "resumed from" in again.stdout and "at step 4" in again.stdout
    assert sorted(train_losses(run)) == list(range(1, 7))

    # Another base under the same run: one line, nothing trained on it; the base gone: one line from the exporters.
    other, _ = _hf_model(seed=1)
    other.save_pretrained(tmp_path / "hf_other")
    tool("import_hf.py", tmp_path / "hf_other", tmp_path / "other")
    wrong = [a if a != str(tmp_path / "imported") else str(tmp_path / "other") for a in args]
    proc = train_cli([*wrong, *overrides], check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"this run's adapters were trained on {tmp_path / 'imported'}" in proc.stderr, proc.stderr
    shutil.move(tmp_path / "imported", tmp_path / "moved")
    proc = tool("consolidate.py", run, tmp_path / "gone", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "which is gone" in proc.stderr, proc.stderr
    proc = tool("consolidate.py", base_run, tmp_path / "none", "--lora", "adapter", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "was trained without LoRA (lora.rank null), so it has no adapters; drop --lora" in proc.stderr


def test_selective_ac_recomputes_an_adapters_widening_matmul_and_trains_as_without_ac():
    """Selective AC keeps a LoRA adapter's A output (rank wide) and recomputes its B (rank in, the projection's width
    out: more than parallelize.WIDENING times wider), whose output is a whole projection's width to keep for 2 x rank
    FLOPs an output to redo; it keeps every projection of a model (Gemma 3 1B's feed-forward widens the most, 6x). The
    adapters' gradients are those without AC, bit for bit (fp32)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from fsdp_trainer.distributed.parallelize import WIDENING, _save_matmuls_policy, apply_ac

    def kept(op, k: int, n: int, *, bias: bool = False, experts: int = 0) -> bool:
        x, weight = torch.empty(3, k), torch.empty(*([experts] if experts else []), k, n)
        args = (torch.empty(n), x, weight) if bias else (x, weight)
        return _save_matmuls_policy(None, op, *args) == CheckpointPolicy.MUST_SAVE

    mm, addmm = torch.ops.aten.mm.default, torch.ops.aten.addmm.default
    assert not kept(mm, 16, 4096) and not kept(addmm, 16, 4096, bias=True)  # a B of rank 16 on a 4,096-wide projection
    assert not kept(torch.ops.aten._grouped_mm.default, 16, 1536, experts=8)  # an expert adapter's B
    assert kept(mm, 4096, 16) and kept(mm, 1152, 6912) and kept(mm, 16, WIDENING * 16)  # A, Gemma 3 1B's up, 8x
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=101, max_seq_len=64)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    grads = []
    for ac in ("none", "selective"):
        model = Transformer(cfg)
        model.init_weights(seed=0)
        apply_lora(model, LORA)  # rank 4: B widens 16x (to 64) and 40x (to 160)
        init_lora(model, seed=0, fill=lambda param, values: param.copy_(values), device=torch.device("cpu"))
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():  # B starts at zero; give every path a gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=generator))
        apply_ac(model, ac)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads.append({unwrapped_name(name): p.grad for name, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 2 * 7
    assert all(torch.equal(grads[0][name], grads[1][name]) for name in grads[0])
