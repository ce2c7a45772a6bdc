"""Ours against what fine-tuners run today: TRL's SFTTrainer and DPOTrainer (with PEFT for LoRA) on the HF Trainer's
DDP, the same work side by side on CPU ranks, alternating, in one run.

    python benchmarks/bench_peers.py --nproc 2 --examples 512 --kinds sft dpo lora --repeats 2 --out peers.json
    python benchmarks/bench_peers.py --kinds sft lora --trl_packing     # TRL packed as well as padded

From one config-built Qwen3 (saved by save_pretrained with a ChatML tokenizer trained on the bundled corpus; imported
for ours by convert.import_hf), each kind trains one pass over the same --examples examples of the bundled chat
set (sft, lora) or preference set (dpo), in fp32, with the same optimizer (AdamW, no weight decay, clipping at 1), peak
learning rate, warmup and cosine schedule, and the same examples a step: TRL pads each batch of --batch examples a
rank to its longest; ours packs whole examples into windows of a length that holds as many (block-causal, so none
sees another), `parallel.sharding NO_SHARD` (DDP, as TRL's Trainer runs on CPU ranks). Per row: the tokens that carry
a loss, trained per second of the training loop; that loop's wall time; the peak RSS of a rank; and, from the same
evaluator on both exports, the loss on --val held-out examples (SFT: the mean cross-entropy of their answers' tokens;
DPO: the mean DPO loss and reward accuracy against the starting model), so that a speed-up that trains something else
shows. Prints a table with ours / TRL ratios (the nearest run of the other side) and writes --out.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from runner import launch, torchrun_command, write_rows

from fsdp_trainer.convert import consolidate, import_hf
from fsdp_trainer.data.prepare import BUNDLED_CHAT, BUNDLED_CORPUS, BUNDLED_PREFERENCES
from fsdp_trainer.files import METRICS_FILE

REPO = Path(__file__).resolve().parents[1]
# ChatML (Qwen's), the assistant's turns marked with {% generation %}: TRL's assistant_only_loss then trains what ours
# trains, each assistant turn's content and its <|im_end|>, on the same rendered text.
CHATML = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
KINDS = ("sft", "dpo", "lora")
SIDES = ("ours", "trl")
PACKED = "trl packed"
"""TRL's own packing (SFT and LoRA SFT; --trl_packing). On a CPU its rows let an example attend to the examples before
it: transformers reads the packed boundaries (position ids, cu_seq_lens) in its flash attention kernels alone, and
SDPA, eager and flex_attention see each row as one causal sequence. The held-out loss shows what that trains."""


def tokenizer_and_model(work: Path, vocab: int, dim: int, layers: int) -> Path:
    """A byte-level BPE with ChatML's tokens trained on the bundled corpus, and a Qwen3 of that vocabulary (heads of 64,
    SwiGLU 3 x dim wide, tied embeddings) with seeded random weights, saved together as an HF directory."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        tk.train_from_iterator([f.read()], trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHATML
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=dim, intermediate_size=3 * dim, num_hidden_layers=layers,
        num_attention_heads=dim // 64, num_key_value_heads=max(1, dim // 128), head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    hf = work / "hf"
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    return hf


def split(path: Path, examples: int, val: int, work: Path, name: str) -> tuple[Path, Path]:
    """The first `examples` records of a bundled set for training, the next `val` held out."""
    with gzip.open(path, "rt") as f:
        lines = [next(f) for _ in range(examples + val)]
    train, held = work / f"{name}_train.jsonl", work / f"{name}_val.jsonl"
    train.write_text("".join(lines[:examples]))
    held.write_text("".join(lines[examples:]))
    return train, held


def tool(name: str, *args) -> str:
    proc = launch([sys.executable, str(REPO / "tools" / name), *map(str, args)])
    if proc.returncode:
        sys.exit(f"error: tools/{name} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def encode(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """The token ids of messages rendered by the chat template."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def window_for(train: Path, tokenizer, per_step: int, nproc: int) -> int:
    """A window length (a multiple of 64) that holds about per_step / nproc examples: the rank's share of a step's
    examples, as TRL's batch of examples a rank is, packed."""
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    lengths = []
    for r in rows:  # a pair is its two conversations, each with the prompt
        conversations = [r["messages"]] if "messages" in r else [r["prompt"] + r["chosen"], r["prompt"] + r["rejected"]]
        lengths.append(sum(len(encode(tokenizer, messages)) for messages in conversations))
    mean = sum(lengths) / len(lengths)
    return int(math.ceil(per_step / nproc * mean * 1.05 / 64) * 64)


def run_ours(kind, args, imported, data, seq_len, work: Path) -> dict:
    """One training pass of ours under torchrun; its numbers from metrics.jsonl, its model consolidated to HF."""
    out = work / f"ours_{kind}_{time.monotonic_ns()}"
    windows = json.loads(Path(f"{data}.meta.json").read_text())["n_tokens"] // seq_len
    steps = windows // args.nproc
    flags = ["--recipe", str(imported / "model.yaml"), "--checkpoint.resume", str(imported),
             "--train.out_dir", str(out), "--train.steps", str(steps), "--train.log_every", "1",
             "--train.eval_every", "0", "--checkpoint.every", str(steps), "--data.train_path", str(data),
             "--data.val_path", "null", "--data.tokenizer_path", "null", "--data.seq_len", str(seq_len),
             "--model.max_seq_len", str(max(seq_len, 64)), "--data.micro_batch_size", "1",
             "--parallel.sharding", args.sharding, "--parallel.mixed_precision", "fp32",
             "--parallel.activation_checkpointing", "none", "--parallel.compile", "false", "--optim.lr", str(args.lr),
             "--optim.min_lr", "0", "--optim.warmup_steps", str(max(1, steps // 10)), "--optim.weight_decay", "0",
             "--optim.grad_clip", "1.0", "--optim.betas", "[0.9, 0.999]"]  # fmt: skip
    if kind == "dpo":
        flags += ["--preference.loss", "sigmoid", "--preference.beta", str(args.beta)]
    if kind == "lora":
        targets = "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"
        rank = str(args.lora_rank)
        flags += ["--lora.rank", rank, "--lora.alpha", str(2 * args.lora_rank), "--lora.targets", targets]
    start = time.perf_counter()
    cmd = torchrun_command(["-m", "fsdp_trainer.train", *flags], args.nproc)
    proc = launch(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(f"error: ours ({kind}) exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    process_s = time.perf_counter() - start
    records = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    trained = sum(r.get("supervised_tokens") or r.get("pair_tokens") or 0 for r in logged)
    consolidate(out, out / "hf", verify="files")
    return {
        "steps": steps,
        "wall_s": logged[-1]["elapsed_s"],
        "process_s": process_s,
        "trained_tokens": trained,
        "peak_rss_gb": max(r["peak_mem_gb"] for r in logged),
        "model": str(out / "hf"),
        "seq_len": seq_len,
    }


def run_trl(kind, args, hf: Path, train: Path, work: Path, max_length: int, packing: bool = False) -> dict:
    """One training pass of TRL under torchrun (peers_trl.py); its numbers and its exported model. `packing`: TRL's
    own (best-fit into rows of max_length, our window, one a rank a step) in place of padded batches."""
    out = work / f"trl_{kind}_{time.monotonic_ns()}"
    out.mkdir()
    steps = args.examples // (args.batch * args.nproc)
    job = {"kind": "dpo" if kind == "dpo" else "sft", "model": str(hf), "train": str(train), "out": str(out),
           "batch": args.batch, "steps": steps, "lr": args.lr, "warmup": max(1, steps // 10), "seed": 0,
           "max_length": max_length, "beta": args.beta, "packing": packing}  # fmt: skip
    job["lora_rank"] = args.lora_rank if kind == "lora" else None
    (out / "job.json").write_text(json.dumps(job))
    start = time.perf_counter()
    cmd = torchrun_command([str(Path(__file__).with_name("peers_trl.py")), str(out / "job.json")], args.nproc)
    proc = launch(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(f"error: TRL ({kind}) exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    return {**result, "process_s": time.perf_counter() - start, "wall_s": result["train_runtime_s"],
            "model": str(out / "final")}  # fmt: skip


def completion_logps(model, tokenizer, prompt: list[dict], answer: list[dict]) -> tuple[float, int]:
    """(log-probability of the answer's tokens given the prompt, their number) under `model`, the texts rendered by the
    chat template as both sides render them."""
    first = encode(tokenizer, prompt, add_generation_prompt=True)
    whole = encode(tokenizer, [*prompt, *answer])
    ids = torch.tensor([whole])
    with torch.no_grad():
        logps = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    picked = logps.gather(1, targets[:, None])[:, 0][len(first) - 1 :]
    return picked.sum().item(), len(picked)


def answers_logp(model, tokenizer, messages: list[dict]) -> tuple[float, int]:
    """(log-probability of every assistant turn's tokens, content and end of turn, their number) of a conversation
    under `model`: the tokens the template's {% generation %} marks, which both sides train on."""
    encoded = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = torch.tensor([list(encoded["input_ids"])]), torch.tensor(list(encoded["assistant_masks"]))
    with torch.no_grad():
        logps = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    picked = logps.gather(1, ids[0, 1:, None])[:, 0][mask[1:] > 0]
    return picked.sum().item(), len(picked)


def held_out(kind: str, model_dir: str, start: Path, val: Path, beta: float) -> dict:
    """The same evaluator for both sides' exports: SFT, the mean cross-entropy of the held-out answers' tokens; DPO,
    the mean DPO loss and reward accuracy against the starting model."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(start)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    if kind != "dpo":
        total = count = 0
        for r in rows:
            logp, n = answers_logp(model, tokenizer, r["messages"])
            total, count = total - logp, count + n
        return {"val_loss": total / count}
    reference = transformers.AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32).eval()
    losses, right = [], 0
    for r in rows:
        margins = []
        for m in (model, reference):
            chosen, _ = completion_logps(m, tokenizer, r["prompt"], r["chosen"])
            rejected, _ = completion_logps(m, tokenizer, r["prompt"], r["rejected"])
            margins.append(chosen - rejected)
        z = beta * (margins[0] - margins[1])
        losses.append(-torch.nn.functional.logsigmoid(torch.tensor(z)).item())
        right += z > 0
    return {"val_loss": sum(losses) / len(losses), "val_reward_accuracy": right / len(rows)}


def trained_in_file(path: Path) -> int:
    """The tokens a pass over a prepared file trains on: those its flags mark as targets."""
    from fsdp_trainer.data.format import TARGET, TokenFile

    return int(((TokenFile(path).flags[:] & TARGET) > 0).sum())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--examples", type=int, default=512, help="training examples (or pairs): one pass")
    parser.add_argument("--val", type=int, default=100, help="held-out examples (or pairs)")
    parser.add_argument("--batch", type=int, default=8, help="examples (pairs) a rank a step, TRL's batch")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side, alternating which goes first")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lora_rank", type=int, default=16)
    parser.add_argument("--sharding", default="NO_SHARD", help="ours: NO_SHARD is DDP, as TRL's Trainer runs on CPUs")
    parser.add_argument("--trl_packing", action="store_true", help="SFT and LoRA: TRL with its packing as well")
    parser.add_argument("--work", default=None, help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--out", default="bench_out/peers.json")
    args = parser.parse_args(argv)
    import transformers

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_peers_"))
    work.mkdir(parents=True, exist_ok=True)
    hf = tokenizer_and_model(work, args.vocab, args.dim, args.layers)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    import_hf(hf, work / "imported")
    rows = []
    for kind in args.kinds:
        source, fmt = (BUNDLED_PREFERENCES, "preference") if kind == "dpo" else (BUNDLED_CHAT, "chat")
        train, val = split(source, args.examples, args.val, work, kind)
        seq_len = window_for(train, tokenizer, args.batch * args.nproc, args.nproc)
        data = work / f"{kind}_data" / "train.bin"
        tool("prepare_data.py", "--recipe", work / "imported" / "model.yaml", "--format", fmt, "--input", train,
             "--data.tokenizer_path", work / "imported", "--data.train_path", data, "--data.val_path", "null",
             "--val_fraction", "0", "--data.seq_len", seq_len, "--model.max_seq_len", seq_len)  # fmt: skip
        sides = (*SIDES, PACKED) if args.trl_packing and kind != "dpo" else SIDES
        for repeat in range(args.repeats):
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                if side == "ours":
                    result = run_ours(kind, args, work / "imported", data, seq_len, work)
                    result["trained_tokens"] = trained_in_file(data)
                else:
                    result = run_trl(kind, args, hf, train, work, max_length=seq_len, packing=side == PACKED)
                result.update(held_out(kind, result["model"], hf, val, args.beta))
                result.update(kind=kind, side=side, tokens_per_s=result["trained_tokens"] / result["wall_s"])
                rows.append(result)
                print(json.dumps(result), flush=True)
    print(table(rows, args))
    write_rows(args.out, args, rows)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


def table(rows: list[dict], args) -> str:
    """Markdown: a row a run, with ours / TRL ratios against each TRL side's nearest run of the same kind (padded, and
    packed where it ran)."""
    lines = [f"CPU capability: {torch.backends.cpu.get_cpu_capability()}; {args.nproc} ranks, {args.examples} examples",
             "| kind | side | steps | trained tokens | loop s | trained tokens/s | peak RSS GB / rank | held-out loss "
             "| ours / TRL tokens/s | ours / TRL peak |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, r in enumerate(rows):
        ratios, peaks = [], []
        for peer in ("trl", PACKED) if r["side"] == "ours" else ():
            others = [j for j, o in enumerate(rows) if o["kind"] == r["kind"] and o["side"] == peer]
            if others:
                o, tag = rows[min(others, key=lambda j: abs(j - i))], "" if peer == "trl" else " (packed)"
                ratios.append(f"{r['tokens_per_s'] / o['tokens_per_s']:.2f}x{tag}")
                peaks.append(f"{r['peak_rss_gb'] / o['peak_rss_gb']:.2f}x{tag}")
        ratio, peak = ", ".join(ratios), ", ".join(peaks)
        accuracy = f" (acc {r['val_reward_accuracy']:.2f})" if "val_reward_accuracy" in r else ""
        lines.append(f"| {r['kind']} | {r['side']} | {r['steps']} | {r['trained_tokens']:,} | {r['wall_s']:.1f} "
                     f"| {r['tokens_per_s']:,.0f} | {r['peak_rss_gb']:.2f} | {r['val_loss']:.4f}{accuracy} | {ratio} "
                     f"| {peak} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
