"""Qwen3-MoE against transformers built from a config (several experts, top-2, a dense layer among them by
mlp_only_layers, renormalized top-k probabilities): both published layouts import to the same weights, the logits and
the loss with the router's load-balancing term are transformers', the export loads back in transformers, and 2 ranks
train as 1 process with accumulation (the same router choices), resuming bitwise."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from fsdp_trainer.data.loader import MicroBatch
from fsdp_trainer.distributed.parallelize import SHARDING
from fsdp_trainer.hf import load_safetensors, model_config_from_hf
from fsdp_trainer.metrics import attention_flops_per_token, expert_flops_per_token, flops_per_token
from fsdp_trainer.model import Transformer
from fsdp_trainer.moe import MixtureOfExperts, moe_layers
from fsdp_trainer.steps.next_token import NextTokenStep
from tests.helpers import read_metrics, run_args, tool, train_cli

transformers = pytest.importorskip("transformers")

MOE = {"experts": 6, "top_k": 2, "ffn_dim": 48, "dense_layers": [1], "aux_loss_coef": 0.01}
"""The recipes' moe section of the tests' model: six experts, top-2, layer 1 dense."""


def published(tmp_path, tie: bool = False):
    """A Qwen3-MoE saved by save_pretrained (sharded, the Hub's per-expert layout), its routers moved off their init
    so that tokens spread over the experts; and the model, in fp32."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1], router_aux_loss_coef=0.01,
        tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    return model


def test_both_layouts_import_with_transformers_logits_loss_and_export(tmp_path, one_rank):
    original = published(tmp_path / "hub")
    # transformers 5's own layout: the experts stacked, as it holds them in memory.
    (tmp_path / "fused").mkdir()
    save_file({k: v.contiguous() for k, v in original.state_dict().items()}, tmp_path / "fused" / "model.safetensors")
    shutil.copy(tmp_path / "hub" / "config.json", tmp_path / "fused" / "config.json")
    hub, fused = load_safetensors(tmp_path / "hub"), load_safetensors(tmp_path / "fused")
    assert sorted(hub) == sorted(fused) and all(torch.equal(hub[k], fused[k]) for k in hub)
    assert any(name.endswith("experts.0.gate_proj.weight") for name in json.loads(
        (tmp_path / "hub" / "model.safetensors.index.json").read_text())["weight_map"])  # fmt: skip

    cfg = model_config_from_hf(json.loads((tmp_path / "hub" / "config.json").read_text()))
    assert moe_layers(cfg) == {0, 2} and cfg.moe.top_k == 2 and cfg.moe.norm_topk_prob
    ours = Transformer(cfg)
    ours.load_state_dict(hub, strict=True)
    assert isinstance(ours.model.layers["0"].mlp, MixtureOfExperts)
    assert not isinstance(ours.model.layers["1"].mlp, MixtureOfExperts)

    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    inputs = tokens[:, :-1]
    reference = original(input_ids=inputs, labels=inputs, output_router_logits=True)
    with torch.no_grad():
        torch.testing.assert_close(ours(inputs), reference.logits, rtol=1e-5, atol=1e-5)
    # The step's loss: the cross-entropy plus 0.01 x the load-balancing loss, transformers' `loss` on the same batch
    # (its labels shifted inside; ours given as targets).
    # One example a row (documents): the targets are counted, the last position has none, as transformers' labels.
    targets = torch.cat([inputs[:, 1:], torch.full((2, 1), -100)], dim=1)
    batch = MicroBatch(inputs, targets, documents=torch.zeros_like(inputs))
    ours.set_requires_gradient_sync = lambda enabled: None  # one process, no FSDP: nothing to reduce
    loss, numbers = NextTokenStep()(ours, [batch], SHARDING["NO_SHARD"], lambda loss: loss.backward(), 1)
    assert loss.item() == pytest.approx(reference.loss.item(), rel=1e-5)
    assert numbers["aux_loss"].item() == pytest.approx(reference.aux_loss.item(), rel=1e-5)
    assert ours.model.layers["0"].mlp.gate.weight.grad.abs().sum() > 0  # the router learns through the aux loss

    tool("import_hf.py", tmp_path / "hub", tmp_path / "imported")
    tool("consolidate.py", tmp_path / "imported", tmp_path / "hf_out")
    with safe_open(tmp_path / "hf_out" / "model.safetensors", "pt") as exported:
        assert "model.layers.0.mlp.experts.5.down_proj.weight" in exported.keys()  # the Hub's layout
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(inputs).logits, reference.logits, rtol=1e-5, atol=1e-5)


def test_the_flops_a_token_counts_the_experts_it_goes_through(tmp_path):
    """MFU's and the planner's FLOPs a token of a mixture of experts: 6 a weight the token goes through, counted on
    transformers' own Qwen3-MoE (attention's projections, the router, top_k of each MoE layer's experts, the dense
    layer's feed-forward, the output layer; norms and the embedding are no matmul), plus attention's scores; of them
    the routed experts' are the ones the planner prices at the tokens each expert is sent."""
    original = published(tmp_path)
    cfg = model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    share = cfg.moe.top_k / cfg.moe.experts
    weights = {name: p.numel() * (share if ".mlp.experts." in name else 1.0)
               for name, p in original.named_parameters() if p.dim() == 2 or ".mlp.experts." in name}  # fmt: skip
    del weights["model.embed_tokens.weight"]
    experts = sum(n for name, n in weights.items() if ".mlp.experts." in name)
    assert experts == 2 * 2 * 64 * (96 + 48)  # two MoE layers, two experts a token, gate_up and down
    assert expert_flops_per_token(cfg) == pytest.approx(6 * experts)
    assert flops_per_token(cfg, 24) == pytest.approx(6 * sum(weights.values()) + attention_flops_per_token(cfg, 24))


def test_grouped_experts_equal_a_loop_over_experts():
    """The grouped matmul gives each token copy its own expert's SwiGLU, weighted by the router: as a plain loop over
    experts computes it (transformers' way), forward and gradients."""
    from fsdp_trainer.config import ModelConfig, MoEConfig

    cfg = ModelConfig(family="qwen3_moe", dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                      moe=MoEConfig(experts=5, top_k=2, ffn_dim=24))  # fmt: skip
    torch.manual_seed(0)
    layer = MixtureOfExperts(cfg)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(3, 7, 32, requires_grad=True)
    out = layer(x)
    probabilities = torch.softmax(layer.gate(x.reshape(-1, 32)).float(), dim=-1)
    weights, chosen = torch.topk(probabilities, 2)
    weights = weights / weights.sum(-1, keepdim=True)
    rows = x.reshape(-1, 32)
    expected = torch.zeros_like(rows)
    for e in range(5):
        token, slot = torch.where(chosen == e)
        gate, up = F.linear(rows[token], layer.experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, layer.experts.down_proj[e]) * weights[token, slot, None]
        expected = expected.index_add(0, token, y)
    torch.testing.assert_close(out.reshape(-1, 32), expected, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), [x, layer.experts.gate_up_proj, layer.gate.weight])
    expected_grads = torch.autograd.grad(expected.square().sum(), [x, layer.experts.gate_up_proj, layer.gate.weight])
    for ours, theirs in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)  # sums over the experts in another order


def test_the_loop_a_gpu_runs_in_fp32_equals_the_grouped_matmul():
    from fsdp_trainer.moe import grouped_linear, looped_linear

    x, weight = torch.randn(10, 8), torch.randn(3, 12, 8)  # widths of 16 bytes' multiples, as the kernel needs
    offsets = torch.tensor([4, 4, 10], dtype=torch.int32)  # an expert with no rows
    torch.testing.assert_close(looped_linear(x, weight.transpose(-2, -1), offsets), grouped_linear(x, weight, offsets))


def tiny_moe(n_layers: int = 2):
    from fsdp_trainer.config import ModelConfig, MoEConfig

    cfg = ModelConfig(family="qwen3_moe", dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      vocab_size=64, moe=MoEConfig(experts=4, top_k=2, ffn_dim=16))  # fmt: skip
    model = Transformer(cfg)
    model.init_weights(seed=0)
    return model


def test_a_checkpointed_block_recomputed_in_backward_keeps_no_routing():
    """Activation checkpointing recomputes each block's forward in backward. The recomputation must not keep its
    routing as the step's forward does for the load-balancing loss: the recomputed graph hanging from it would hold
    each layer's recomputed activations (its attention's, up to the router) until backward ends, 0.45 GB a layer at
    Qwen3-30B-A3B's shapes. The gradients are those of the block without checkpointing."""
    from fsdp_trainer.distributed.parallelize import apply_ac
    from fsdp_trainer.moe import aux_loss, routed_layers

    checkpointed, plain = tiny_moe(), tiny_moe()
    apply_ac(checkpointed, "full")
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    for model in (checkpointed, plain):
        (model(tokens).square().mean() + aux_loss(model)).backward()
        assert all(layer.routing is None for layer in routed_layers(model))
    for (name, ours), theirs in zip(checkpointed.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("ac, lora_rank", [("full", None), ("selective", 4)])
def test_compiled_blocks_compute_as_eager_in_bf16_and_other_precisions_are_refused(ac, lora_rank):
    """parallel.compile with either AC: the router keeps its routing through dynamo (not replayed in the compiled
    recomputation), so the loss, the load-balancing loss and every gradient are as near an fp32 computation as eager
    bf16's are (torch's accuracy check for compiled bf16 models, torch._dynamo.utils.same: each tensor's RMS error
    against the same weights in fp32 at most 3x eager's; eager's rounding differs by CPU, and on an AVX2-only one an
    expert adapter's gradient lay 2.7% of its largest value from eager's with 0.64x eager's error); with the 30B
    recipe's adapters on the attention and the experts too, at a rank of 4: 8 bytes in bf16, less than the 16 bytes
    apart a grouped matmul's rows must start (lora.py pads it), whose B factor inductor would hand the kernel in a
    layout it refuses (parallelize.apply_compile). torch compiles the grouped matmuls in bf16 only: fp32 is refused in
    one line naming the keys."""
    from fsdp_trainer.adapters.lora import apply_lora, is_adapter
    from fsdp_trainer.config import LoraConfig, parse_recipe
    from fsdp_trainer.distributed.parallelize import apply_ac, apply_compile
    from fsdp_trainer.moe import aux_loss, routed_layers

    def built():
        model = tiny_moe(1)
        if lora_rank:
            apply_lora(model, LoraConfig(rank=lora_rank, alpha=8.0, targets=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                              "experts"]))  # fmt: skip
            g = torch.Generator().manual_seed(2)
            with torch.no_grad():  # B off its zeros, so that every adapter's gradient is
                for name, param in model.named_parameters():
                    if is_adapter(name):
                        param.copy_(torch.randn(param.shape, generator=g) / 10)
        return model.to(torch.bfloat16)

    compiled, eager, reference = built(), built(), built().float()  # the reference: the same weights, in fp32
    apply_ac(compiled, ac)
    apply_compile(compiled, "bf16")
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    results = []
    for model in (compiled, eager, reference):
        logits = model(tokens).float()
        routed = [layer.routing[0].tolist() for layer in routed_layers(model)]
        router = aux_loss(model)
        (logits.square().mean() + router).backward()
        grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
        results.append((routed, [logits, router, *grads]))
    (routed, ours), (eager_routes, theirs), (reference_routes, exact) = results
    assert routed == eager_routes == reference_routes  # the same experts chosen, or no gradient below could match
    assert len(ours) == len(theirs) == 2 + (12 if lora_rank else len(list(eager.parameters())))

    def rms(x):
        return x.square().mean().sqrt()

    for a, b, c in zip(ours, theirs, exact, strict=True):
        assert rms(a - c) <= 3 * rms(b - c) + 1e-3 * rms(c)  # and a quarter of a bf16 rounding, where eager's is 0
    with pytest.raises(ValueError, match="compile with a mixture of experts .* and parallel.mixed_precision is fp32"):
        apply_compile(tiny_moe(1), "fp32")  # auto resolved to fp32 (a CPU without bf16)
    with pytest.raises(SystemExit):
        parse_recipe(["--recipe", "recipes/qwen3_30b_a3b_lora.yaml", "--parallel.mixed_precision", "fp32",
                      "--parallel.compile", "true", "--parallel.expert_parallel", "1"])  # fmt: skip


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_accumulation_and_resume_bitwise(tiny_data, tmp_path):
    """A Qwen3-MoE from scratch: 2 ranks FULL_SHARD (the experts sharded) equal 1 process x accumulation 2 over 10
    steps, the loss, the load-balancing loss and the validation loss; a resume from step 5 is bitwise."""
    model = {"family": "qwen3_moe", "head_dim": 32, "moe": MOE}
    every = {"every": 5, "keep_last": 0}
    two, one = tmp_path / "two", tmp_path / "one"
    train = {"eval_every": 5}
    train_cli(run_args(tiny_data, two, 10, model=model, checkpoint=every, train=train), nproc=2)
    # One process evaluates the batches both ranks did: twice as many.
    train_cli(run_args(tiny_data, one, 10, model=model, data={"grad_accum_steps": 2}, train={**train, "eval_steps": 4}))
    records_two, records_one = read_metrics(two), read_metrics(one)
    assert sum("aux_loss" in r for r in records_two) == 10 and any("val_loss" in r for r in records_two)
    for a, b in zip(records_two, records_one, strict=True):
        for key in {"loss", "aux_loss", "val_loss"} & set(a):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a["step"])

    shutil.rmtree(two / "checkpoints" / "step_00000010")
    (two / "checkpoints" / "latest").write_text("step_00000005\n")
    train_cli(run_args(tiny_data, two, 10, model=model, checkpoint=every, train=train), nproc=2)
    resumed = {r["step"]: r for r in read_metrics(two) if "loss" in r}
    for record in (r for r in records_two if "loss" in r and r["step"] > 5):
        assert (resumed[record["step"]]["loss"], resumed[record["step"]]["aux_loss"]) == (
            record["loss"], record["aux_loss"]), record["step"]  # fmt: skip


def test_lora_on_the_experts_equals_peft_and_exports_in_its_format(tmp_path):
    """Adapters on attention and on every expert (PEFT's target_parameters on the stacked experts): the same logits
    and adapter gradients as peft on the transformers model; our adapter file loads in peft with those logits, and
    the merged weights are peft's merge_and_unload's."""
    import peft

    from fsdp_trainer.adapters.lora import apply_lora, is_adapter, merged
    from fsdp_trainer.adapters.peft_format import (
        EXPERT_PARAMETERS,
        our_layout,
        peft_layout,
        peft_name,
        save_peft_adapter,
    )
    from fsdp_trainer.config import LoraConfig

    original = published(tmp_path / "hub")
    cfg = model_config_from_hf(json.loads((tmp_path / "hub" / "config.json").read_text()))
    ours = Transformer(cfg)
    ours.load_state_dict(load_safetensors(tmp_path / "hub"))
    lora = LoraConfig(rank=4, alpha=8.0, targets=["q_proj", "v_proj", "experts"])
    apply_lora(ours, lora)
    reference = peft.get_peft_model(original, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_PARAMETERS))  # fmt: skip
    theirs = dict(reference.named_parameters())

    def peft_param(name: str) -> torch.Tensor:
        return theirs[peft_name(name).replace(".weight", ".default.weight")]

    generator = torch.Generator().manual_seed(2)
    adapters = {name: param for name, param in ours.named_parameters() if is_adapter(name)}
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == set(adapters)
    assert "model.layers.0.mlp.experts.gate_up_lora.lora_A.weight" in adapters  # layer 1 is dense: none there
    assert not any(name.startswith("model.layers.1.mlp") for name in adapters)
    with torch.no_grad():
        for name, param in adapters.items():
            theirs_param = peft_param(name)  # PEFT's layout: an expert adapter's factors stacked otherwise than ours
            theirs_param.copy_(torch.randn(theirs_param.shape, generator=generator) * 0.1)
            param.copy_(our_layout(name, theirs_param, lora.rank))
    tokens = torch.randint(0, 300, (2, 20), generator=generator)
    logits, reference_logits = ours(tokens), reference(input_ids=tokens).logits
    torch.testing.assert_close(logits, reference_logits, rtol=1e-5, atol=1e-5)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    F.cross_entropy(reference_logits.flatten(0, 1), tokens.flatten()).backward()
    for name, param in adapters.items():
        torch.testing.assert_close(peft_layout(name, param.grad), peft_param(name).grad, rtol=1e-5, atol=1e-7)

    (tmp_path / "adapter").mkdir()
    save_peft_adapter({n: p.detach() for n, p in adapters.items()}, lora, tmp_path / "adapter", "fp32")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hub").eval()
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=tokens).logits, logits, rtol=1e-5, atol=1e-5)
        folded = reference.merge_and_unload().state_dict()
    state = {n: p.detach() for n, p in ours.named_parameters()}
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"):
        torch.testing.assert_close(merged(name, state[name], state, lora), folded[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_lora_on_the_experts_trains_sharded_as_one_process_and_consolidates(tiny_data, tmp_path):
    """LoRA on attention and the experts of a Qwen3-MoE: 2 ranks FULL_SHARD equal 1 process x accumulation 2, and
    the run consolidates to a PEFT adapter (target_parameters) and to a merged model transformers computes as we do."""
    model = {"family": "qwen3_moe", "head_dim": 32, "moe": MOE}
    lora = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "experts"]}
    optim = {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 0}
    two, one = tmp_path / "two", tmp_path / "one"
    train_cli(run_args(tiny_data, two, 6, model=model, lora=lora, optim=optim, checkpoint={"every": 6}), nproc=2)
    train_cli(run_args(tiny_data, one, 6, model=model, lora=lora, optim=optim, data={"grad_accum_steps": 2}))
    losses_two = [r["loss"] for r in read_metrics(two) if "loss" in r]
    losses_one = [r["loss"] for r in read_metrics(one) if "loss" in r]
    assert losses_two == pytest.approx(losses_one, rel=1e-5) and losses_two[-1] < losses_two[0]

    tool("consolidate.py", two, tmp_path / "adapter", "--lora", "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["target_modules"] == ["q_proj", "v_proj"]
    # The adapters merged into the experts and written per expert; transformers' logits checked against ours.
    printed = tool("consolidate.py", two, tmp_path / "merged", "--check_logits").stdout
    assert "max |logits(transformers) - logits(ours)|" in printed
