"""The first hour on a GPU, prepared: one command that checks and measures what only a GPU runs, on a machine that
may be offline, and writes what it found for the planner and docs/benchmarks.md to be held against.

    python benchmarks/gpu_check.py --out gpu_check                  # one CUDA GPU, about 8 minutes
    python benchmarks/gpu_check.py --device cpu --tiny --out DIR    # every check at toy size on a CPU (CI runs it)

From a source checkout on a machine that has PyTorch (2.11 or newer) but not our other dependencies: `make wheels` on
a connected machine, copy `wheels/` over, `pip install --no-index --find-links wheels jsonargparse ...` (the list
README's "Many GPUs" guide gives), then `PYTHONPATH=. python benchmarks/gpu_check.py --out gpu_check`.

Each check runs in a process of its own with its own time limit, so one that fails, hangs or runs out of memory
leaves the others to run; each writes its status, what it measured and, beside each measurement, the planner's
prediction for the GPU it found (planner/speed.py knows H100, H200, A100, B200). DIR/gpu_check.json holds it all,
DIR/gpu_check.md the same as tables.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from fsdp_trainer.files import METRICS_FILE
from fsdp_trainer.planner.speed import gpu_named

REPO = Path(__file__).resolve().parents[1]

OLDEST_TORCH = (2, 11)
"""The oldest torch a GPU machine is expected to bring: FSDP2, DCP and flex_attention as 2.11 has them."""
TINY_MODEL = {"family": "qwen3", "dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64,
              "ffn_dim": 512, "vocab_size": 512, "max_seq_len": 128, "tie_embeddings": True}  # fmt: skip
"""Every check's model at --tiny: Qwen3's block, dims whole NF4 blocks (QLoRA)."""
QWEN3_4B = {"dim": 2560, "n_layers": 36, "n_heads": 32, "n_kv_heads": 8, "head_dim": 128, "ffn_dim": 9728}
"""Qwen3-4B's model keys over recipes/qwen3_0.6b.yaml's (Qwen3-0.6B)."""


class Context:
    """What every check is given: where to write, the device, the size, the precision, the GPU's planner name."""

    def __init__(self, args):
        self.device, self.tiny, self.work = args.device, args.tiny, Path(args.out) / "work"
        self.gpu = gpu_named(torch.cuda.get_device_name(0)) if self.device == "cuda" else None
        self.precision = "fp32" if self.device == "cpu" else "bf16"

    def shape(self, recipe: str, seq_len: int, model: dict | None = None) -> list[str]:
        """A recipe's flags: its model (TINY_MODEL at --tiny) on synthetic tokens of `seq_len` (64 at --tiny), compiled
        as the recipe says on a GPU."""
        from runner import synthetic_data

        seq_len = 64 if self.tiny else seq_len
        model = TINY_MODEL if self.tiny else (model or {})
        vocab = model.get("vocab_size", 151936)
        data_dir = self.work / f"tokens_{vocab}_{seq_len}"
        if not (data_dir / "train.bin").exists():
            data_dir.mkdir(parents=True, exist_ok=True)
            synthetic_data(data_dir, vocab, 40 * seq_len * 4 + 1)
        flags = ["--recipe", str(REPO / "recipes" / recipe), "--data.train_path", str(data_dir / "train.bin"),
                 "--data.val_path", "null", "--data.tokenizer_path", str(data_dir / "synthetic.tokenizer"),
                 "--data.seq_len", str(seq_len), "--data.micro_batch_size", "1", "--data.grad_accum_steps", "1",
                 "--parallel.mixed_precision", self.precision, "--train.eval_every", "0", "--train.log_every", "1",
                 "--checkpoint.every", "0", "--checkpoint.resume", "none", "--optim.warmup_steps", "2"]  # fmt: skip
        for key, value in model.items():
            flags += [f"--model.{key}", json.dumps(value) if isinstance(value, bool) else str(value)]
        if self.device == "cpu":  # the recipe compiles its blocks: minutes of C++ on a CPU, for no GPU's kernel
            flags += ["--parallel.compile", "false"]
        return flags


def step_records(out: Path) -> list[dict]:
    """A run directory's step records in step order, the last logged of each (a resumed run logs again the steps
    after its checkpoint)."""
    records = (json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines())
    return list(dict(sorted({r["step"]: r for r in records if "loss" in r}.items())).values())


def train(ctx: Context, name: str, flags: list[str], steps: int) -> dict:
    """One run of the trainer in this process (`python -m fsdp_trainer.train` on one device), to step `steps`: the
    run's losses by step (step_records'), its speed over its steps but the first two (compilation, warm-up), its peak
    memory, allocated and (CUDA) reserved."""
    from fsdp_trainer.train import main

    out = ctx.work / name
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    main([*flags, "--train.out_dir", str(out), "--train.steps", str(steps)])
    records = step_records(out)
    timed = records[2:] or records
    measured = {
        "losses": [r["loss"] for r in records],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed if r.get("tokens_per_s")),
        "mfu": statistics.median(r["mfu"] for r in timed) if all(r.get("mfu") for r in timed) else None,
        "peak_allocated_gb": max(r["peak_mem_gb"] for r in records if "peak_mem_gb" in r),
    }
    if torch.cuda.is_available():
        measured["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    return measured


def planned(ctx: Context, flags: list[str], offload: bool = False) -> dict:
    """The planner's figures for the run `flags` describe, on one device: its memory, and on a GPU it knows its
    tokens/s and MFU."""
    from fsdp_trainer.config import parse_recipe
    from fsdp_trainer.planner.memory import estimate
    from fsdp_trainer.planner.speed import step_time

    recipe = parse_recipe(flags)
    row = estimate(recipe, 1, 1, "FULL_SHARD", recipe.parallel.activation_checkpointing, ctx.device, offload)
    out = {"planned_gb": round(row.total_gb, 3)}
    if ctx.gpu is not None and not offload:
        t = step_time(recipe, row, ctx.gpu, 1, 1)
        out.update(planned_tokens_per_s=round(t.tokens_per_s_per_gpu), planned_mfu=round(t.mfu, 4))
    return out


# --- the checks: each returns what it measured, and raises (AssertionError, ...) where what it checks does not hold


def environment(ctx: Context) -> dict:
    """torch, CUDA, the GPU, its memory and bf16 peak (metrics.PEAK_FLOPS), SDPA's backends, flex_attention."""
    from fsdp_trainer.metrics import peak_flops

    found = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda}
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (major, minor) < OLDEST_TORCH:
        found["torch_note"] = (
            f"torch {torch.__version__} is older than {'.'.join(map(str, OLDEST_TORCH))}, the oldest these checks "
            "were written against: a check that fails on an attribute torch lacks names the feature; upgrade torch"
        )
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        found.update(gpu=props.name, planner_gpu=ctx.gpu, memory_gb=round(props.total_memory / 1e9, 1),
                     bf16_supported=torch.cuda.is_bf16_supported(), capability=f"{props.major}.{props.minor}",
                     bf16_peak_tflops=(peak_flops(torch.device("cuda"), "bf16") or 0) / 1e12,
                     sdpa_flash=torch.backends.cuda.flash_sdp_enabled(),
                     sdpa_mem_efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
                     sdpa_cudnn=torch.backends.cuda.cudnn_sdp_enabled())  # fmt: skip
    else:
        found["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        found["flex_attention"] = True
    except ImportError as e:
        found["flex_attention"] = f"not available: {e}"
    return found


def debug_recipe(ctx: Context) -> dict:
    """recipes/debug.yaml on the bundled corpus (prepared here): the loss falls as on a CPU; a run stopped at its
    checkpoint and resumed gives the later steps the uninterrupted run's losses (bitwise where the kernels are
    deterministic: the largest difference is reported either way)."""
    from fsdp_trainer.data.prepare import BUNDLED_CORPUS

    data = ctx.work / "shakespeare"
    data_flags = ["--data.train_path", str(data / "train.bin"), "--data.val_path", str(data / "val.bin"),
                  "--data.tokenizer_path", str(data / "tokenizer.model")]  # fmt: skip
    recipe = ["--recipe", str(REPO / "recipes" / "debug.yaml"), *data_flags]
    if not (data / "train.bin").exists():
        inputs = []
        if ctx.tiny:  # the corpus's first 300 KB
            data.mkdir(parents=True, exist_ok=True)
            with gzip.open(BUNDLED_CORPUS, "rt") as f:
                (data / "corpus.txt").write_text(f.read(300_000))
            inputs = ["--input", str(data / "corpus.txt")]
        tool = [sys.executable, str(REPO / "tools" / "prepare_data.py"), *recipe, *inputs]
        subprocess.run(tool, check=True, capture_output=True)
    steps, every = (12, 6) if ctx.tiny else (150, 50)
    flags = [*recipe, "--train.log_every", "1", "--train.eval_every", "0", "--checkpoint.resume", "auto",
             "--checkpoint.every", str(every), "--parallel.mixed_precision", ctx.precision]  # fmt: skip
    if ctx.tiny:
        flags += ["--data.micro_batch_size", "2", "--optim.warmup_steps", "2"]
    killed_after_checkpoint(ctx, "debug_resumed", flags, steps, every)  # first: forked before a process group exists
    straight = train(ctx, "debug_straight", flags, steps)
    resumed = train(ctx, "debug_resumed", flags, steps)  # from its checkpoint at `every`
    first, last = straight["losses"][0], straight["losses"][-1]
    assert last < 0.8 * first, f"the loss did not fall: {first:.4f} at step 1, {last:.4f} at step {steps}"
    after = straight["losses"][every:]
    gap = max(abs(a - b) for a, b in zip(after, resumed["losses"][every:], strict=True))
    assert gap <= 1e-3 * abs(after[-1]), f"resumed losses differ from the uninterrupted run's by up to {gap:.3g}"
    return {"first_loss": first, "last_loss": last, "steps": steps, "killed_after_step": every,
            "resume_max_loss_difference": gap, "resume_bitwise": gap == 0,
            "tokens_per_s": straight["tokens_per_s"]}  # fmt: skip


def _train_main(argv: list[str]) -> None:
    from fsdp_trainer.train import main

    main(argv)


def process_context(device: str):
    """How a process of its own is started: forked on a CPU (from a process that has run no process group yet: a fork
    of its threads can hang), a fresh interpreter where CUDA runs (CUDA does not survive a fork)."""
    return multiprocessing.get_context("spawn" if device == "cuda" else "fork")


def killed_after_checkpoint(ctx: Context, name: str, flags: list[str], steps: int, every: int) -> None:
    """The run of `flags` to `steps`, SIGKILLed once its checkpoint of step `every` is published: a process of its
    own (process_context: the caller has run no process group yet)."""
    context = process_context(ctx.device)
    out = ctx.work / name
    child = context.Process(target=_train_main, args=([*flags, "--train.out_dir", str(out), "--train.steps",
                                                         str(steps)],))  # fmt: skip
    child.start()
    latest = out / "checkpoints" / "latest"
    while child.is_alive() and not (latest.exists() and latest.read_text().strip() == f"step_{every:08d}"):
        time.sleep(0.05)
    child.kill()
    child.join()
    assert latest.exists() and latest.read_text().strip() == f"step_{every:08d}", f"no checkpoint of step {every}"


def sft_speed(ctx: Context) -> dict:
    """A Qwen3-0.6B-shaped SFT step at 8,192 tokens (config-built, random weights, synthetic tokens), compile on and
    off x AC none and selective: tokens/s, MFU and peak memory, each beside the planner's (compiled rows are skipped
    at --tiny on a CPU: there they compile C++ for minutes and measure nothing a GPU does)."""
    rows = {}
    for compiled in (False, True):
        if compiled and ctx.device == "cpu":
            rows["compile"] = "skipped on a CPU"
            continue
        for ac in ("none", "selective"):
            flags = ctx.shape("qwen3_0.6b.yaml", 8192) + ["--parallel.activation_checkpointing", ac,
                                                           "--parallel.compile", str(compiled).lower()]  # fmt: skip
            name = f"sft_{'compiled' if compiled else 'eager'}_{ac}"
            measured = train(ctx, name, flags, 6 if ctx.tiny else 12)
            measured.pop("losses")
            rows[name] = {**measured, **planned(ctx, flags)}
    return rows


def flex_equals_dense(ctx: Context) -> dict:
    """Packed SFT with several documents a window: flex_attention's block mask (block-causal, and a sliding window)
    gives the dense boolean mask's loss."""
    from fsdp_trainer.config import ModelConfig
    from fsdp_trainer.model import Transformer

    device, out = torch.device(ctx.device), {}
    T = 64 if ctx.tiny else 4096
    for family, extra in (("qwen3", {}), ("mistral", {"sliding_window": T // 4})):
        shape = TINY_MODEL if ctx.tiny else {**TINY_MODEL, "dim": 1024, "n_heads": 16, "n_kv_heads": 8}
        cfg = ModelConfig(**{**shape, "family": family, "max_seq_len": T, **extra, "head_dim": 64})
        tokens = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0)).to(device)
        documents = (torch.arange(T) // (T // 5)).expand(2, T).contiguous().to(device)  # five documents a row
        losses = []
        for flex in (False, True):
            model = Transformer(cfg, flex_attention=flex).to(device)
            model.init_weights(seed=0)
            with torch.no_grad():
                logits = model(tokens[:, :-1], documents[:, :-1]).float()
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item())
        gap = abs(losses[0] - losses[1]) / abs(losses[0])
        assert gap < 1e-4, f"{family}: flex_attention's loss {losses[1]:.6f}, the dense mask's {losses[0]:.6f}"
        out[family] = {"dense": losses[0], "flex": losses[1], "relative_gap": gap}
    return out


def lora_speed(ctx: Context) -> dict:
    """LoRA r16 on a Qwen3-4B shape at 16,384 tokens: tokens/s and memory beside the plan; QLoRA (NF4) where torchao
    is installed, else a line saying why it was skipped."""
    rows = {}
    for quantize in (None, "nf4"):
        name = "qlora" if quantize else "lora"
        if quantize:
            try:
                import torchao  # noqa: F401
            except ImportError:
                rows[name] = "skipped: torchao is not installed (pip install -e '.[qlora]')"
                continue
        flags = ctx.shape("qwen3_0.6b.yaml", 16384, QWEN3_4B) + [
            "--lora.rank",
            "16",
            "--lora.alpha",
            "32",
            "--parallel.activation_checkpointing",
            "selective",
        ]
        if quantize:
            flags += ["--lora.quantize_base", quantize]
        measured = train(ctx, name, flags, 4 if ctx.tiny else 8)
        measured.pop("losses")
        rows[name] = {**measured, **planned(ctx, flags)}
    return rows


def cpu_offload(ctx: Context) -> dict:
    """parallel.cpu_offload on a short run: it trains (a finite, falling loss), and its device memory is the plan's
    (on a CPU host and device are one memory: only that it trains is checked)."""
    flags = ctx.shape("qwen3_0.6b.yaml", 4096) + ["--parallel.cpu_offload", "true"]
    measured = train(ctx, "offload", flags, 6 if ctx.tiny else 10)
    losses = measured.pop("losses")
    assert all(map(lambda loss: loss == loss, losses)), f"a non-finite loss: {losses}"
    return {**measured, **planned(ctx, flags, offload=True), "first_loss": losses[0], "last_loss": losses[-1]}


def rollouts(ctx: Context) -> dict:
    """Online RL's sampling (generation.sample_groups) at G = 8: completion tokens a second, 8 prompts of 256 tokens
    (32 at --tiny) and up to 256 new tokens (16) each, on the Qwen3-0.6B shape (TINY_MODEL)."""
    from fsdp_trainer.config import ModelConfig
    from fsdp_trainer.generation import sample_groups
    from fsdp_trainer.model import Transformer

    device = torch.device(ctx.device)
    shape = TINY_MODEL if ctx.tiny else {"family": "qwen3", **QWEN3_06B}
    cfg = ModelConfig(**{**shape, "max_seq_len": 1024})
    model = Transformer(cfg).to(device)
    model.init_weights(seed=0)
    if ctx.precision == "bf16":
        model = model.to(torch.bfloat16)
    prompt, new, g = (32, 16, 8) if ctx.tiny else (256, 256, 8)
    prompts = [torch.randint(0, cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(i)).to(device)
               for i in range(8)]  # fmt: skip
    generators = [torch.Generator(device=device).manual_seed(i) for i in range(8 * g)]
    start = time.perf_counter()
    completions, _ = sample_groups(model, prompts, g, [new] * 8, 1.0, None, 1.0, torch.tensor([-1], device=device),
                                   generators)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(map(len, completions))
    assert tokens == 8 * g * new, f"{tokens} tokens sampled, {8 * g * new} asked"
    return {"completions": 8 * g, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


QWEN3_06B = {"dim": 1024, "n_layers": 28, "n_heads": 16, "n_kv_heads": 8, "head_dim": 128, "ffn_dim": 3072,
             "vocab_size": 151936, "tie_embeddings": True, "rope_theta": 1e6}  # fmt: skip

CHECKS = {
    "environment": (environment, 20),
    "debug_recipe": (debug_recipe, 60),
    "sft_speed": (sft_speed, 180),
    "flex_equals_dense": (flex_equals_dense, 30),
    "lora_speed": (lora_speed, 120),
    "cpu_offload": (cpu_offload, 40),
    "rollouts": (rollouts, 30),
}
"""Each check and its time limit in seconds, 8 minutes in all (--tiny keeps them: its checks take seconds)."""


def _child(name: str, args, results) -> None:
    os.setpgrp()  # a group of its own, which a timeout kills whole (the trainer and tools it started too)
    torch.manual_seed(0)
    try:
        results.put({"status": "passed", "found": CHECKS[name][0](Context(args))})
    except Exception as e:  # a check's own failure: said, and the next check runs
        cause = str(e).splitlines()[0] if str(e) else ""
        results.put({"status": "failed", "error": f"{type(e).__name__}: {cause}", "traceback": traceback.format_exc()})


def run_check(name: str, args) -> dict:
    """One check in a process of its own (process_context), within its limit."""
    context = process_context(args.device)
    results = context.Queue()
    child = context.Process(target=_child, args=(name, args, results))
    start = time.perf_counter()
    child.start()
    limit = dict(args.limit).get(name, CHECKS[name][1] * args.time_scale)
    child.join(limit)
    if child.is_alive():
        os.killpg(child.pid, signal.SIGKILL)
        child.join()
        return {"status": "timeout", "error": f"no result within {limit:g} s (--time_scale, --limit)", "seconds": limit}
    try:
        result = results.get(timeout=5)
    except Exception:
        result = {"status": "failed", "error": f"the check's process exited {child.exitcode} without a result"}
    return {**result, "seconds": round(time.perf_counter() - start, 1)}


def _named_limit(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    if name not in CHECKS or not seconds:
        raise argparse.ArgumentTypeError(f"{text!r}: write CHECK=SECONDS, CHECK one of {', '.join(CHECKS)}")
    return name, float(seconds)


def markdown(report: dict) -> str:
    """gpu_check.json as tables: the checks' verdicts, then each check's figures."""
    lines = [f"# gpu_check ({report['device']}{', tiny' if report['tiny'] else ''}), {report['date']}", "",
             "| check | status | seconds | note |", "|---|---|---|---|"]  # fmt: skip
    for name, result in report["checks"].items():
        lines.append(f"| {name} | {result['status']} | {result['seconds']} | {result.get('error', '')} |")
    for name, result in report["checks"].items():
        if isinstance(result.get("found"), dict):
            lines += ["", f"## {name}", "", "```json", json.dumps(result["found"], indent=1), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where gpu_check.json and gpu_check.md go")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="every check at toy size (seconds on a CPU)")
    parser.add_argument("--only", nargs="*", choices=list(CHECKS), help="these checks alone")
    parser.add_argument("--time_scale", type=float, default=1.0, help="every check's time limit times this")
    parser.add_argument("--limit", type=_named_limit, action="append", default=[], metavar="CHECK=SECONDS",
                        help="one check's time limit instead")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: this machine has no CUDA device torch can use; --device cpu --tiny runs "
                 "every check at toy size on the CPU")  # fmt: skip
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the trainer takes a GPU where it sees one
    out = Path(args.out)
    (out / "work").mkdir(parents=True, exist_ok=True)
    report = {"device": args.device, "tiny": args.tiny, "date": time.strftime("%Y-%m-%d %H:%M"), "checks": {}}
    for name in args.only or CHECKS:
        print(f"gpu_check: {name} ...", flush=True)
        report["checks"][name] = result = run_check(name, args)
        print(f"gpu_check: {name} {result['status']} in {result['seconds']} s {result.get('error', '')}", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))  # what is known so far, should one hang
        (out / "gpu_check.md").write_text(markdown(report))
    failed = [name for name, result in report["checks"].items() if result["status"] != "passed"]
    print(f"gpu_check: {len(report['checks']) - len(failed)} of {len(report['checks'])} passed; {out}/gpu_check.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
