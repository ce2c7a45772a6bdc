"""benchmarks/*.py, tools/generate.py and tools/plot.py on tiny shapes: they run and report what they claim (no timing
asserts)."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import subprocess
import sys

import pytest
import torch

from fsdp_trainer.config import ModelConfig
from fsdp_trainer.generation import generate
from fsdp_trainer.model import Transformer, count_params
from tests.helpers import REPO, TINY_MODEL, forked, run_args, script, train_cli, train_losses
from tests.helpers import tool as run_tool

BENCHMARKS = REPO / "benchmarks"


def run_bench(name: str, *args, cwd=REPO, check: bool = True) -> subprocess.CompletedProcess:
    """A benchmark script run as `python benchmarks/name ...` runs it, but in this process, and the jobs it launches
    (benchmarks/runner.py's launch) forked as that many ranks (tests/helpers/forked.py) instead of new interpreters
    under torchrun: each of those spends 3-6 s of CPU importing torch and the package before the job starts."""
    import runner  # the module the benchmark scripts import, as tests/helpers puts their folder on the path

    out, err, code = io.StringIO(), io.StringIO(), 0
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.setattr(runner, "launch", forked.run_command)
        patch.chdir(cwd)
        patch.setattr(sys, "argv", [str(BENCHMARKS / name), *map(str, args)])
        try:
            runpy.run_path(str(BENCHMARKS / name), run_name="__main__")
        except SystemExit as e:
            code = forked.exit_code(e.code)  # its message, if any, printed to err as the interpreter would
    proc = subprocess.CompletedProcess([name, *map(str, args)], code, out.getvalue(), err.getvalue())
    if check and proc.returncode:
        raise AssertionError(proc.stderr[-3000:])
    return proc


def run_forked(name: str, *args, nproc: int = 1, env: dict | None = None) -> subprocess.CompletedProcess:
    """A benchmark script that launches no jobs, forked as `python benchmarks/name ...` (as `nproc` ranks under
    torchrun's environment when more than one): what it times runs on one thread, as its own process."""
    return script(BENCHMARKS / name, *args, nproc=nproc, env=env)


@pytest.mark.slow
def test_bench_compares_ours_with_the_baseline(tiny_data, tmp_path):
    out = tmp_path / "bench.json"
    proc = run_bench("bench.py", "--recipe", tiny_data, "--nproc", 2, "--steps", 4, "--log_every", 2, "--repeats", 2,
                     "--out", out, "--model.dim", 32)  # fmt: skip
    report = json.loads(out.read_text())
    runs = report["runs"]
    for impl in ("ours", "baseline"):
        assert len(runs[impl]) == 2
        assert all(r["tokens_per_s"] > 0 and 0 < r["peak_mem_gb"] < 20 for r in runs[impl])
        assert report["summary"][impl]["mfu"] is None  # no GPU, no MFU
    assert all(r["tokens_per_cpu_s"] > 0 for impl in ("ours", "baseline") for r in runs[impl])
    # The step-time spread: the median and the largest step of each run, and over the runs.
    for impl in ("ours", "baseline"):
        assert all(0 < r["step_time_s"] <= r["step_time_max_s"] for r in runs[impl])
        summary = report["summary"][impl]
        assert summary["step_time_max_s"] == max(r["step_time_max_s"] for r in runs[impl])
        assert summary["step_time_s_median"] == pytest.approx(sum(r["step_time_s"] for r in runs[impl]) / 2)
    # The headline, and its CPU-time twin: the median over the pairs of ours / baseline.
    for key, ratio_key in (("tokens_per_s", "ratio"), ("tokens_per_cpu_s", "cpu_ratio")):
        pairs = [o[key] / b[key] for o, b in zip(runs["ours"], runs["baseline"], strict=True)]
        assert report[ratio_key] == pytest.approx((pairs[0] + pairs[1]) / 2)
        if key == "tokens_per_s":
            assert report["pair_ratios"] == pytest.approx(pairs)
    assert "ours / baseline = " in proc.stdout and "dim 32 x 2 layers" in proc.stdout


@pytest.mark.slow
def test_bench_lora_measures_state_and_checkpoints_against_full_fine_tuning(tiny_data, tmp_path):
    """Full fine-tuning holds 16 bytes x P / 2 per rank; LoRA the frozen fp32 weights and its adapters' state; QLoRA
    the adapted projections in 4 bits; both save checkpoints of their adapters alone. An unknown kind is one line."""
    out = tmp_path / "lora.json"
    shapes = ["--model.dim", "256", "--model.ffn_dim", "512", "--model.n_heads", "4", "--model.n_kv_heads", "2"]
    command = ["--recipe", tiny_data, "--nproc", 2, "--steps", 3, "--out", out, *shapes, "--kinds"]
    bad = run_bench("bench_lora.py", *command, "full", "dora", check=False)
    assert bad.returncode == 1 and bad.stderr == "error: --kinds: ['dora'] are not among full, lora, qlora\n"
    proc = run_bench("bench_lora.py", *command, "full", "lora", "qlora")
    full, lora, qlora = json.loads(out.read_text())["rows"]
    n_params = count_params(ModelConfig(**{**TINY_MODEL, "dim": 256, "ffn_dim": 512, "n_heads": 4, "n_kv_heads": 2}))
    assert full["state_gb"] == pytest.approx(16 * n_params / 2 / 1e9, rel=1e-3)
    assert lora["state_gb"] < full["state_gb"] / 2 and qlora["params_gb"] < lora["params_gb"] / 2
    assert qlora["grads_gb"] == lora["grads_gb"] and lora["checkpoint_gb"] < full["checkpoint_gb"] / 3
    assert all(r["save_s"] > 0 and r["tokens_per_s"] > 0 for r in (full, lora, qlora))
    assert "| 3 | qlora |" in proc.stdout and "vs the nearest full run" in proc.stdout


def test_bench_memory_measures_the_zero_formulas(tiny_data, tmp_path):
    """Per rank: FULL_SHARD (here offloaded, which on a CPU moves nothing) holds 16 bytes x P / 2 of parameters,
    gradients and AdamW state, NO_SHARD all 16 x P; a config it cannot read is one line naming it."""
    out = tmp_path / "memory.json"
    command = ["--recipe", tiny_data, "--nproc", 2, "--steps", 2, "--out", out, "--configs"]
    bad = run_bench("bench_memory.py", *command, "NO_SHARD/fp32/none", "FULL_SHARD/fp32/none/pinned", check=False)
    assert bad.returncode == 1 and "--configs: 'FULL_SHARD/fp32/none/pinned' is not SHARDING" in bad.stderr
    assert '"config"' not in bad.stdout  # refused before the good config ran
    proc = run_bench("bench_memory.py", *command, "FULL_SHARD/fp32/none/offload", "NO_SHARD/bf16/full")
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    n_params = count_params(ModelConfig(**TINY_MODEL))
    assert rows["FULL_SHARD/fp32/none/offload"]["state_gb"] == pytest.approx(16 * n_params / 2 / 1e9, rel=1e-3)
    assert rows["NO_SHARD/bf16/full"]["state_gb"] == pytest.approx(16 * n_params / 1e9, rel=1e-3)
    for row in rows.values():
        assert (
            row["optimizer_gb"] == pytest.approx(2 * row["params_gb"], rel=1e-3)
            and row["plan_total_gb"] > row["state_gb"]
        )
    assert "| FULL_SHARD/fp32/none/offload |" in proc.stdout


@pytest.mark.slow
def test_bench_scaling_reports_each_size_and_world_size(tiny_data, tmp_path):
    out = tmp_path / "scaling.json"
    run_bench("bench_scaling.py", "--recipe", tiny_data, "--sizes", "32x1", "64x2", "--nproc", 1, 2, "--steps", 2,
              "--log_every", 1, "--parallel.mixed_precision", "fp32", "--out", out)  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["size"], r["nproc"]) for r in rows] == [("32x1", 1), ("32x1", 2), ("64x2", 1), ("64x2", 2)]
    for r in rows:
        # ZeRO-3 in fp32: an all-gather of every parameter in forward, again in backward of every block but the last,
        # and a reduce-scatter, 4 bytes a parameter, each sending (n - 1) / n of it.
        gathered_and_reduced = 4 * (r["params"] + r["regathered"]) + 4 * r["params"]
        assert r["comm_gb_per_rank"] == pytest.approx(gathered_and_reduced * (r["nproc"] - 1) / r["nproc"] / 1e9)
        assert (r["regathered"] == 0) == (r["size"] == "32x1")  # one block: it is the last, kept gathered
        assert r["state_gb"] == pytest.approx(16 * r["params"] / r["nproc"] / 1e9, rel=1e-3)
        assert r["step_s"] > 0
    assert rows[2]["params"] > rows[0]["params"]


def test_greedy_generation_follows_the_argmax():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=50, max_seq_len=16)
    model = Transformer(cfg)
    model.init_weights(seed=2)
    prompt = torch.tensor([3, 4, 5])
    out = generate(model, prompt, max_new_tokens=20, temperature=0)
    assert out.shape == (23,) and torch.equal(out[:3], prompt)
    for t in range(3, 23):  # each new token is the argmax given the (last max_seq_len) tokens before it
        context = out[max(0, t - cfg.max_seq_len) : t]
        assert out[t] == model(context[None])[0, -1].argmax()
    sampled = [generate(model, prompt, 10, 1.0, 5, torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    assert torch.equal(sampled[0], sampled[1]) and not torch.equal(sampled[0], sampled[2])


def test_generate_cli_reads_our_checkpoint_and_the_hf_export(tiny_data, tmp_path):
    train_cli(run_args(tiny_data, tmp_path / "run", 2, checkpoint={"every": 2}))
    run_tool("consolidate.py", tmp_path / "run", tmp_path / "hf", "--verify", "files")
    texts = []
    for source in ("run", "hf"):
        proc = run_tool("generate.py", tmp_path / source, "--prompt", "KING.", "--max_new_tokens", 12,
                        "--temperature", 0, check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        texts.append(proc.stdout)
    assert texts[0].startswith("KING.") and texts[0] == texts[1]  # same weights, same greedy continuation


def test_plot_draws_several_runs(tiny_data, tmp_path):
    for name, lr in (("a", "3e-3"), ("b", "1e-3")):
        train_cli(run_args(tiny_data, tmp_path / name, 4, train={"eval_every": 2}, optim={"lr": lr}))
    from tools.plot import plot, read_run

    runs = {name: read_run(tmp_path / name) for name in ("a", "b")}
    proc = run_tool("plot.py", tmp_path / "a", tmp_path / "b", check=False)
    assert proc.returncode == 0, proc.stderr
    png = (tmp_path / "a" / "metrics.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000

    # Each curve drawn is the run's own numbers.
    drawn = plot(runs, tmp_path / "c.png")
    for name in ("a", "b"):
        losses = train_losses(tmp_path / name)
        assert drawn[name, "loss"] == (list(losses), list(losses.values()))
        assert drawn[name, "val_loss"][0] == [2, 4]
    assert drawn["a", "loss"] != drawn["b", "loss"]
    missing = run_tool("plot.py", tmp_path / "nope", check=False)
    assert missing.returncode == 1 and missing.stderr.strip() == (
        f"error: {tmp_path}/nope/metrics.jsonl does not exist: pass the train.out_dir of a run"
    )


def test_bench_checkpoint_times_both_writers_and_both_verifications(tiny_data, tmp_path):
    out = tmp_path / "checkpoint.json"
    args = ["--recipe", tiny_data, "--nproc", 2, "--repeats", 2, "--work_dir", tmp_path / "ckpts", "--out", out]
    proc = run_bench("bench_checkpoint.py", *args, cwd=tmp_path)
    report = json.loads(out.read_text())
    assert sorted(report["summary"]) == ["async_crc", "async_plain", "sync_crc", "sync_plain"]
    assert len(report["saves"]) == 2 * 2 * 2 and len(report["verify_split_s"]) == len(report["verify_all_s"]) == 2
    params = count_params(ModelConfig(**TINY_MODEL))
    assert report["bytes"] > 12 * params  # fp32 weights and two AdamW moments, plus DCP's framing
    for row in report["saves"]:
        assert 0 < row["blocked_s"] <= row["total_s"]
    assert "| async | ChecksummedWriter |" in proc.stdout


def test_bench_loss_chunks_reports_each_chunk_count_against_one(tiny_data, tmp_path):
    out = tmp_path / "chunks.json"
    args = ["--recipe", tiny_data, "--chunks", "[3]", "--repeats", 1, "--steps", 1, "--out", out]
    run_bench("bench_loss_chunks.py", *args, "--parallel.mixed_precision", "fp32", cwd=tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert [r["loss_chunks"] for r in rows] == [1, 3] and rows[0]["ratio_to_1"] == 1.0
    assert rows[1]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-5)  # same numbers, chunked or not
    # One slice of 64 tokens, then of ceil(64 / 3) = 22, beside the output layer's fp32 weight gradient (three of
    # them where two are summed into a new one, the larger beside so small a slice).
    vocab, head = TINY_MODEL["vocab_size"], 4 * TINY_MODEL["vocab_size"] * TINY_MODEL["dim"]
    for row, tokens in zip(rows, (64, 22), strict=True):
        planned = max(12 * tokens * vocab + head, 8 * tokens * vocab + 2 * head, 3 * head) / 1e9
        assert row["planned_logits_gb"] == pytest.approx(planned)


def test_bench_lean_ops_times_both_sides_each_round():
    proc = run_forked("bench_lean_ops.py", "--shapes", "16x8", "32x4", "--calls", 2, "--rounds", 2, "--dtype", "fp32")
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith(("| 16x8", "| 32x4"))]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [("16x8", "1"), ("16x8", "2"), ("32x4", "1"), ("32x4", "2")]
    for _, _, plain, lean, ratio in rows:
        plain, lean = float(plain.replace(",", "")), float(lean.replace(",", ""))
        assert plain > 0 and lean > 0
        # The ratio of the timings before they were rounded to whole microseconds, itself rounded to 2 decimals: off
        # the printed timings' ratio by at most this, whatever the machine's load makes of them (lean 36x plain once,
        # beside another suite: 0.07 off).
        rounding = (lean + 0.5) / (plain - 0.5) - lean / plain + 0.005
        assert float(ratio) == pytest.approx(lean / plain, abs=rounding)


def test_bench_window_mask_prints_the_peak_and_the_loss():
    proc = run_forked("bench_window_mask.py", "--seq_len", 64, "--layers", 2, "--window", 8)
    assert "2 layers (2 windowed), 64 tokens, window 8: peak RSS" in proc.stdout
    assert float(proc.stdout.split("loss ")[-1]) > 0


def test_bench_block_causal_times_both_attentions(tiny_data):
    args = ["--recipe", tiny_data, "--repeats", 2, "--steps", 1, "--example_tokens", 8]
    # flex_attention compiles on a CPU with vectorized kernels only; its one kernel, the only vectorized one of the
    # suite, compiles in less time alone than with a precompiled header made for it (14 against 18 s of CPU)
    vectors = {"TORCHINDUCTOR_VEC_ISA_OK": "1", "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}
    proc = run_forked("bench_block_causal.py", *args, env=vectors)
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith(("| model", "| attention"))]
    assert [r[0].strip() for r in rows] == [
        "model forward + backward",
        "attention forward + backward",
        "attention forward",
        "attention forward, flex_attention (compiled)",
    ]
    assert all(float(r[1]) >= 0 and float(r[2]) >= 0 and float(r[3]) > 0 for r in rows)  # ms to 0.1, ratio exact


def test_bench_moe_times_grouped_experts_against_transformers_loop(tmp_path):
    model = {"family": "qwen3_moe", "dim": 64, "n_heads": 4, "n_kv_heads": 2,
             "moe": {"experts": 8, "top_k": 2, "ffn_dim": 32}}  # fmt: skip
    (tmp_path / "moe.yaml").write_text(json.dumps({"model": model}))
    proc = run_forked("bench_moe.py", "--recipe", tmp_path / "moe.yaml", "--tokens", 64, "--repeats", 2, "--steps", 1)
    assert float(proc.stdout.split("max |ours - transformers'| = ")[1].split()[0]) <= 1e-5  # the same layer
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith(("| grouped", "| loop"))]
    assert [r[0].strip() for r in rows] == ["grouped (ours)", "loop over experts (transformers)"]
    assert float(rows[1][3].strip().rstrip("x")) == 1.0 and float(rows[0][3].strip().rstrip("x")) > 0


@pytest.mark.slow
def test_bench_optimizer_times_adamw_and_muon_on_two_ranks(tiny_data):
    """bench_optimizer.py as torchrun's two workers run it (their environment, forked): each optimizer's step time,
    over the two ranks' FULL_SHARD."""
    proc = run_forked("bench_optimizer.py", "--recipe", tiny_data, "--repeats", 2, "--steps", 1, nproc=2)
    rows = {line.split("|")[1].strip(): line.split("|")[2:4] for line in proc.stdout.splitlines() if "| " in line}
    assert float(rows["AdamW (fused)"][0]) >= 0 and float(rows["Muon (+ AdamW for embeddings, head, norms)"][1]) > 0
    assert "2 rank(s), FULL_SHARD" in proc.stdout


@pytest.mark.slow
def test_bench_peers_trains_the_same_tokens_on_both_sides_and_scores_both_exports(tmp_path):
    """bench_peers.py at toy size: from one config-built Qwen3, ours (packed) and TRL's SFTTrainer / DPOTrainer
    (padded; SFT packed by TRL as well) train one pass over the same examples, the same tokens carrying a loss on
    both sides (SFT: every assistant turn, through TRL's assistant_only_loss on the template's {% generation %} marks),
    and the same evaluator scores both exports on the held-out examples."""
    out = tmp_path / "peers.json"
    args = ["--examples", 16, "--val", 4, "--batch", 2, "--dim", 64, "--layers", 1, "--vocab", 512,
            "--kinds", "sft", "dpo", "--trl_packing", "--work", tmp_path / "work", "--out", out]  # fmt: skip
    proc = run_bench("bench_peers.py", *args)
    report = json.loads(out.read_text())
    rows = {(r["kind"], r["side"]): r for r in report["rows"]}
    assert sorted(rows) == [("dpo", "ours"), ("dpo", "trl"), ("sft", "ours"), ("sft", "trl"), ("sft", "trl packed")]
    # TRL's packing (SFT only) trains the same tokens as its padded batches and ours.
    assert rows["sft", "ours"]["trained_tokens"] == rows["sft", "trl"]["trained_tokens"]
    assert rows["sft", "trl packed"]["trained_tokens"] == rows["sft", "ours"]["trained_tokens"]
    # A pair's answers: TRL also trains the newline ChatML writes after each answer's <|im_end|>.
    assert rows["dpo", "trl"]["trained_tokens"] - rows["dpo", "ours"]["trained_tokens"] == 2 * 16
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["peak_rss_gb"] > 0 and 0 < r["val_loss"] < 10
    assert 0 <= rows["dpo", "ours"]["val_reward_accuracy"] <= 1
    assert "| sft | ours |" in proc.stdout and report["cpu_capability"]
