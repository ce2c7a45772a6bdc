"""Expert parallelism (distributed/expert_parallel.py): a mixture of experts' experts split over the ranks of a group,
each token copy computed on the rank holding its expert. Against the whole model on one process."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from fsdp_trainer.adapters.lora import apply_lora
from fsdp_trainer.checkpoint.weights import saved_shapes
from fsdp_trainer.config import LoraConfig, ModelConfig, MoEConfig
from fsdp_trainer.distributed.expert_parallel import apply_expert_parallel, experts_mesh
from fsdp_trainer.distributed.parallelize import apply_ac
from fsdp_trainer.loss import NextTokenLoss
from fsdp_trainer.model import Transformer
from fsdp_trainer.moe import aux_loss, routed_layers
from tests.conftest import PAIRS_SEQ_LEN
from tests.helpers import metrics_by_step, rewind, run_args, run_distributed, tool, train_cli
from tests.test_moe import MOE

CFG = ModelConfig(family="qwen3_moe", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                  moe=MoEConfig(experts=4, top_k=2, ffn_dim=16))  # fmt: skip


def _model(lora: bool = False) -> Transformer:
    model = Transformer(CFG)
    model.init_weights(seed=0)
    if lora:  # adapters on attention's queries and on every expert, B not zero: every factor gets a gradient
        apply_lora(model, LoraConfig(rank=2, alpha=4.0, targets=["q_proj", "experts"]))
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in model.parameters():
                if param.requires_grad:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def _loss(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss, the load-balancing loss and the first layer's copies per expert."""
    loss = model(tokens[:, :-1], loss=NextTokenLoss(tokens[:, 1:]))
    first = routed_layers(model)[0].routing[0].clone()
    return loss, aux_loss(model), first


def _equals_the_whole_model(rank: int, world: int, ac: str, lora: bool, saved: str | None) -> None:
    # Rank 0's batch repeats one token: its first layer routes every copy to the same 2 experts, none to the others.
    batches = [torch.full((2, 13), 5), torch.randint(0, CFG.vocab_size, (2, 13), generator=torch.Generator())]
    whole, split = _model(lora), _model(lora)
    expected = [_loss(whole, tokens) for tokens in batches]  # each rank's batch: its loss and load-balancing loss
    sum(loss + 0.1 * aux for loss, aux, _ in expected).backward()
    apply_expert_parallel(split, experts_mesh(world, world, "cpu"))
    apply_ac(split, ac)
    loss, aux, first = _loss(split, batches[rank])
    assert (first == 0).sum() == (2 if rank == 0 else 0), first
    (loss + 0.1 * aux).backward()
    torch.testing.assert_close(loss, expected[rank][0].detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(aux, expected[rank][1].detach(), rtol=1e-6, atol=0)
    local = CFG.moe.experts // world
    trained = [
        (name, p, theirs) for (name, p), theirs in zip(split.named_parameters(), whole.parameters(), strict=True)
    ]
    trained = [(name, ours, theirs) for name, ours, theirs in trained if ours.requires_grad]
    assert len(trained) == (2 * 2 + 4 * 2 if lora else len(list(whole.parameters())))  # adapters: q_proj, 2 experts'
    for name, ours, theirs in trained:
        if "experts" in name:  # this rank's experts' gradients: every rank's copies of them, sent back here
            theirs_grad, grad = theirs.grad[rank * local : (rank + 1) * local], ours.grad.to_local()
        else:  # the rest: each rank's share, summed (as FSDP's reduce-scatter sums them)
            theirs_grad, grad = theirs.grad, ours.grad.clone()
            dist.all_reduce(grad)
        assert (grad - theirs_grad).abs().max() <= 1e-5 * theirs_grad.abs().max(), name
    held = split.model.layers["0"].mlp.experts.gate_up_proj
    assert held.shape[0] == CFG.moe.experts and held.to_local().shape[0] == local  # the whole tensor, its part here
    if saved is not None:  # DCP writes each rank's experts into the whole tensors: read back, the model's bits
        dcp.save({"model": split.state_dict()}, checkpoint_id=saved)
        dist.barrier()  # every rank's part written before rank 0 reads them
        if rank == 0:
            state = {"model": {name: torch.empty_like(t) for name, t in whole.state_dict().items()}}
            dcp.load(state, checkpoint_id=saved, no_dist=True)
            assert all(torch.equal(t, state["model"][name]) for name, t in whole.state_dict().items())


@pytest.mark.parametrize("ac, lora", [("none", False), ("full", False), ("none", True)])
def test_two_ranks_of_experts_compute_the_whole_models_loss_and_gradients(ac, lora, tmp_path):
    """EP 2: each rank holds 2 of the 4 experts and routes its own tokens; its loss and load-balancing loss are the
    whole model's on its batch, its experts' gradients the whole model's over both ranks' batches, and every other
    gradient summed over the ranks is the whole model's (fp32, 1e-5), with uneven routing: rank 0 sends no copy to
    two of the experts. Under full AC each block's recomputation dispatches its copies again, to the same result.
    With LoRA on the experts, each rank holds its experts' adapters, and their gradients are the whole model's. Saved
    through DCP, the split model reads back on one process as the whole model's weights, bit for bit."""
    run_distributed(_equals_the_whole_model, ac, lora, str(tmp_path) if (ac, lora) == ("none", True) else None)


def test_sampling_with_the_weights_held_gathered_leaves_each_fsdp_module_as_its_sharding_set_it():
    """Online RL and on-policy distillation sample with every FSDP module's weights held gathered (held_gathered);
    after it each frees them after forward as the sharding says again, the experts' own modules under expert
    parallelism too (they once stayed gathered after every forward: FULL_SHARD then held every block's experts). And
    the planner's check, which switches a model between the shardings of one mesh (switch_sharding), leaves each
    module as a model built for the other sharding has it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from fsdp_trainer.config import ParallelConfig
    from fsdp_trainer.distributed.parallelize import SHARDING, held_gathered, parallelize, switch_sharding
    from fsdp_trainer.model import on_meta
    from fsdp_trainer.planner.fake import fake_world

    def built(sharding: str) -> Transformer:
        with on_meta():
            model = Transformer(CFG)
        parallelize(model, ParallelConfig(sharding=sharding, expert_parallel=2, mixed_precision="fp32"), mesh)
        return model

    def reshards(model: Transformer) -> dict[str, bool]:
        modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        return {name: m._get_fsdp_state()._fsdp_param_group._reshard_after_forward for name, m in modules}

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        model = built("FULL_SHARD")
        sharded = reshards(model)
        assert sharded["model.layers.0"] and sharded["model.layers.0.mlp.experts"] and not sharded["model.layers.1"]
        with held_gathered(model, SHARDING["FULL_SHARD"]):
            assert not any(reshards(model).values())
        assert reshards(model) == sharded
        for sharding in ("SHARD_GRAD_OP", "FULL_SHARD"):
            switch_sharding(model, SHARDING[sharding])
            assert reshards(model) == reshards(built(sharding)), sharding


def test_expert_parallel_runs_equal_one_process_and_checkpoints_cross_both_ways(tiny_data, tmp_path):
    """fsdp-train with parallel.expert_parallel 2 (each rank 3 of the 6 experts; everything else FSDP over all): on 2
    ranks over 6 steps, and on 4 over 10 (2 groups; each rank's experts sharded by FSDP over the 2 ranks holding them;
    selective AC), the loss, load-balancing loss, validation loss and gradient norm equal 1 process with the same
    micro-batches accumulated (the experts' gradients reduced over fewer ranks, divided as the rest); the 2 ranks'
    step-3 checkpoint resumes bitwise on the same 2 ranks, and on 1 process, and the 1 process's under EP 2, each
    continuing as the other run does (DCP keeps the experts' whole tensors whatever the split); the EP run
    consolidates to the Hub's per-expert layout, which transformers computes as we do."""
    model = {"family": "qwen3_moe", "head_dim": 32, "moe": MOE}
    every, train, ep2 = {"every": 3, "keep_last": 0}, {"eval_every": 3}, {"expert_parallel": 2}
    runs = {  # name: (processes, sections); the load-balancing loss is each micro-batch's, so the same micro-batches
        "ep": (2, {"parallel": ep2, "checkpoint": every}),
        "one": (1, {"data": {"grad_accum_steps": 2}, "train": {**train, "eval_steps": 4}, "checkpoint": every}),
        "four": (4, {"parallel": {**ep2, "activation_checkpointing": "selective"}, "data": {"micro_batch_size": 1}}),
        "by_one": (1, {"data": {"micro_batch_size": 1, "grad_accum_steps": 4}, "train": {**train, "eval_steps": 8}}),
    }
    for name, (nproc, sections) in runs.items():
        steps = 10 if name in ("four", "by_one") else 6
        args = run_args(tiny_data, tmp_path / name, steps, model=model, **{"train": train, **sections})
        train_cli(args, nproc=nproc)
    for got, expected, steps, evals in (("ep", "one", 6, 2), ("four", "by_one", 10, 4)):  # every 3 and the last
        got, expected = metrics_by_step(tmp_path / got), metrics_by_step(tmp_path / expected)
        assert sum("aux_loss" in r for r in got.values()) == steps
        assert sum("val_loss" in r for r in got.values()) == evals
        for step, record in got.items():
            for key in {"loss", "aux_loss", "val_loss", "grad_norm"} & set(record):
                assert record[key] == pytest.approx(expected[step][key], rel=1e-5), (key, step)
    shapes = [saved_shapes(tmp_path / run / "checkpoints" / "step_00000003") for run in ("ep", "one")]
    assert shapes[0] == shapes[1] and shapes[0]["model.layers.0.mlp.experts.gate_up_proj"] == (6, 96, 64)
    # consolidated to the Hub's per-expert layout, which transformers computes as ours does
    printed = tool("consolidate.py", tmp_path / "ep", tmp_path / "hf", "--check_logits").stdout
    assert "max |logits(transformers) - logits(ours)|" in printed
    again = tmp_path / "again"  # the same 2 ranks at EP 2 from step 3: bitwise
    shutil.copytree(tmp_path / "ep", again)
    rewind(again, 3)
    train_cli(run_args(tiny_data, again, 6, model=model, checkpoint=every, train=train, parallel=ep2), nproc=2)
    straight = metrics_by_step(tmp_path / "ep")
    for step, record in metrics_by_step(again).items():
        assert all(record[k] == straight[step][k] for k in ("loss", "aux_loss", "grad_norm") if k in record), step
    expected = metrics_by_step(tmp_path / "one")
    for source, nproc, sections in (("ep", 1, {"data": {"grad_accum_steps": 2}}), ("one", 2, {"parallel": ep2})):
        across = tmp_path / f"from_{source}"
        shutil.copytree(tmp_path / source, across)
        rewind(across, 3)
        train_cli(run_args(tiny_data, across, 6, model=model, checkpoint=every, **sections), nproc=nproc)
        for step, record in metrics_by_step(across).items():
            if "loss" in record:
                assert record["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), (across.name, step)


def test_expert_lora_on_four_ranks_equals_one_process_and_consolidates_alike(tiny_data, tmp_path):
    """LoRA on attention and on every expert, FSDP 2 x EP 2 on 4 ranks (each rank 3 of the 6 experts and their
    adapters) with full AC: loss, load-balancing loss and gradient norm of 10 steps equal 1 process with the same
    micro-batches; both checkpoints consolidate to PEFT adapters (target_parameters) of the same names and shapes and
    the same values (1e-5: ten steps' rounding through Adam), and the run under EP resumes on 1 process (the same
    saved layout)."""
    model = {"family": "qwen3_moe", "head_dim": 32, "moe": MOE}
    lora = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "experts"]}
    common = {"model": model, "lora": lora, "optim": {"lr": 1e-2, "min_lr": 1e-3}, "checkpoint": {"every": 5}}
    parallel = {"expert_parallel": 2, "activation_checkpointing": "full"}
    four, one = tmp_path / "four", tmp_path / "one"
    train_cli(run_args(tiny_data, four, 10, data={"micro_batch_size": 1}, parallel=parallel, **common), nproc=4)
    train_cli(run_args(tiny_data, one, 10, data={"micro_batch_size": 1, "grad_accum_steps": 4}, **common))
    got, expected = metrics_by_step(four), metrics_by_step(one)
    assert sum("loss" in r for r in got.values()) == 10 and got[10]["loss"] < got[1]["loss"]
    for step, record in got.items():
        for key in {"loss", "aux_loss", "grad_norm"} & set(record):
            assert record[key] == pytest.approx(expected[step][key], rel=1e-5), (key, step)
    adapters = {}
    for run in (four, one):
        tool("consolidate.py", run, tmp_path / f"{run.name}_adapter", "--lora", "adapter")
        adapters[run.name] = load_file(tmp_path / f"{run.name}_adapter" / "adapter_model.safetensors")
    assert adapters["four"].keys() == adapters["one"].keys() and any(".experts.lora_B" in k for k in adapters["one"])
    for name, tensor in adapters["four"].items():
        torch.testing.assert_close(tensor, adapters["one"][name], rtol=0, atol=1e-5)
    rewind(four, 5)
    train_cli(run_args(tiny_data, four, 10, data={"micro_batch_size": 1, "grad_accum_steps": 4}, **common))
    for step, record in metrics_by_step(four).items():
        if "loss" in record:
            assert record["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), step


def test_qlora_sft_with_adapters_on_the_experts_under_expert_parallelism_equals_one_process(chat_data, tmp_path):
    """SFT on packed conversations (the trained positions the assistant's) with QLoRA (attention's projections in
    NF4, sharded over both ranks) and adapters on the experts split by EP 2: 2 ranks equal 1 process x accumulation 2
    over 3 steps (loss, load-balancing loss, gradient norm)."""
    pytest.importorskip("torchao")
    model = {"family": "qwen3_moe", "dim": 256, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "moe": MOE}
    lora = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "experts"], "quantize_base": "nf4"}
    common = {"model": {**model, "max_seq_len": 128}, "lora": lora, "optim": {"lr": 1e-2, "min_lr": 1e-2}}
    train_cli(run_args(chat_data, tmp_path / "ep", 3, parallel={"expert_parallel": 2}, **common), nproc=2)
    train_cli(run_args(chat_data, tmp_path / "one", 3, data={"grad_accum_steps": 2}, **common))
    got, expected = metrics_by_step(tmp_path / "ep"), metrics_by_step(tmp_path / "one")
    for step in (1, 2, 3):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-5), (key, step)


def test_compiled_blocks_under_expert_parallelism_train_as_eager(tiny_data, tmp_path):
    """parallel.compile with EP 2 on 2 ranks, bf16 (a compiled grouped matmul's only dtype), selective AC: each block
    one graph with its dispatch, the all-to-all's sizes traced as symbolic integers and the experts sharded in the
    block's FSDP module; loss, load-balancing loss and gradient norm of 3 steps as eager's to bf16's rounding."""
    model = {"family": "qwen3_moe", "head_dim": 32, "n_layers": 1, "moe": MOE}
    parallel = {"expert_parallel": 2, "mixed_precision": "bf16", "activation_checkpointing": "selective"}
    for name, compile in (("eager", False), ("compiled", True)):
        args = run_args(tiny_data, tmp_path / name, 3, model=model, parallel={**parallel, "compile": compile})
        train_cli(args, nproc=2)
    got, expected = metrics_by_step(tmp_path / "compiled"), metrics_by_step(tmp_path / "eager")
    for step in (1, 2, 3):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-2), (key, step)


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "parallel.expert_parallel=2 splits a mixture of experts' experts; model.family=llama has none"),
        (["moe", "--model.moe.experts", "5"], "model.moe.experts (5) must be a multiple of it"),
        (["moe", "--parallel.context_parallel", "2"], "does not run with parallel.context_parallel yet"),
        (["moe", "--parallel.cpu_offload", "true"], "does not run with parallel.cpu_offload yet"),
        (
            ["moe", "--parallel.sharding", "NO_SHARD"],
            "runs under FULL_SHARD, SHARD_GRAD_OP, SHARD_OP, not NO_SHARD yet",
        ),
        (["moe"], "parallel.expert_parallel=2 needs the world size (1) to be a multiple of it"),
    ],
)
def test_what_expert_parallelism_cannot_run_is_one_line_before_training(tiny_data, tmp_path, flags, message):
    moe = ["--model.family", "qwen3_moe", "--model.head_dim", "32", "--model.moe", str(MOE)]
    flags = [*moe, *flags[1:]] if flags[:1] == ["moe"] else flags
    proc = train_cli([*run_args(tiny_data, tmp_path), "--parallel.expert_parallel", "2", *flags], check=False)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_dpo_with_a_mixture_of_experts_under_expert_parallelism_equals_one_process(tiny_data, pairs, tmp_path):
    """The preference kind with its frozen reference beside the policy, both split by EP 2 (the reference's experts
    dispatched over the same group): 2 ranks equal 1 process x accumulation 2, loss and reward margins."""
    model = {"family": "qwen3_moe", "head_dim": 32, "moe": MOE, "max_seq_len": PAIRS_SEQ_LEN}
    data = {"train_path": pairs / "train.bin", "val_path": None, "seq_len": PAIRS_SEQ_LEN}
    dpo = {"model": model, "preference": {"loss": "sigmoid"}, "optim": {"lr": 1e-2, "min_lr": 1e-2}}
    train_cli(run_args(tiny_data, tmp_path / "ep", 3, data=data, parallel={"expert_parallel": 2}, **dpo), nproc=2)
    train_cli(run_args(tiny_data, tmp_path / "one", 3, data={**data, "grad_accum_steps": 2}, **dpo))
    got, expected = metrics_by_step(tmp_path / "ep"), metrics_by_step(tmp_path / "one")
    for step in (1, 2, 3):
        for key in ("loss", "aux_loss"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-5), (key, step)
        # a difference of two sums of log-probs: to their rounding
        assert got[step]["rewards/margins"] == pytest.approx(expected[step]["rewards/margins"], abs=1e-5), step
