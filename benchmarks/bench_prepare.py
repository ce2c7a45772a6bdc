"""Data preparation throughput and memory against the tokenizer's own in-process batch encode of the same documents.

    python benchmarks/bench_prepare.py --recipe recipes/debug.yaml --sizes_mb 100 1000 --workers 1 2 \
        [--tokenizers sp hf] [--work_dir bench_out/prepare]

For each size, a jsonl corpus of that many MB (the bundled plays, a record per paragraph, repeated); for each
tokenizer (sentencepiece and an HF byte-level BPE, both of 4,000 pieces trained on the plays), the direct encode
(tokenizer.encode_documents on batches of 1,024 documents in this process: sentencepiece's list encode, tokenizers'
encode_batch) and tools/prepare_data.py with each --workers, into a shard directory. Reports MB/s and tokens/s of
each, ours / direct, and the peak RSS of prepare_data.py's whole process tree (sampled from /proc every 0.1 s).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

from runner import report_header

from fsdp_trainer.config import parse_args, recipe_parser
from fsdp_trainer.data.format import open_tokens
from fsdp_trainer.data.loader import TokenLoader
from fsdp_trainer.data.prepare import BUNDLED_CORPUS
from fsdp_trainer.data.sources import BadRecords, read_documents
from fsdp_trainer.tokenizer import load_tokenizer, train_tokenizer

TOOL = Path(__file__).resolve().parents[1] / "tools" / "prepare_data.py"


def make_corpus(path: Path, megabytes: int) -> None:
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        lines = [json.dumps({"text": p}) + "\n" for p in f.read().split("\n\n") if p.strip()]
    with open(path, "w") as f:
        written = 0
        while written < megabytes * 1e6:
            for line in lines:
                written += f.write(line)


def make_tokenizers(work: Path, vocab: int = 4000) -> dict[str, str]:
    plays = work / "plays.txt"
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        plays.write_text(f.read())
    train_tokenizer([str(plays)], str(work / "sp.model"), vocab)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train(
        [str(plays)],
        trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    (work / "hf").mkdir(exist_ok=True)
    tk.save(str(work / "hf" / "tokenizer.json"))
    (work / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return {"sp": str(work / "sp.model"), "hf": str(work / "hf")}


def direct(corpus: Path, tokenizer_path: str) -> dict:
    tokenizer = load_tokenizer(tokenizer_path)
    start, tokens, batch = time.perf_counter(), 0, []
    for text in read_documents(str(corpus), "text", BadRecords(skip=False)):
        batch.append(text)
        if len(batch) == 1024:
            tokens += sum(map(len, tokenizer.encode_documents(batch)))
            batch = []
    tokens += sum(map(len, tokenizer.encode_documents(batch)))
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    rss = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        children.setdefault(int(fields["PPid"]), []).append(int(entry.name))
        rss[int(entry.name)] = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total


def ours(recipe_path: str, corpus: Path, tokenizer_path: str, workers: int, out: Path) -> dict:
    cmd = [
        sys.executable,
        str(TOOL),
        "--recipe",
        recipe_path,
        "--data.tokenizer_path",
        tokenizer_path,
        "--data.train_path",
        str(out / "train"),
        "--data.val_path",
        str(out / "val"),
        "--input",
        str(corpus),
        "--workers",
        str(workers),
        "--force",
        "true",
    ]
    start, peak = time.perf_counter(), 0
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        peak = max(peak, tree_rss_bytes(proc.pid))
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"error: {' '.join(cmd)} exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
    tokens = len(open_tokens(out / "train")) + len(open_tokens(out / "val"))
    return {"seconds": seconds, "tokens": tokens, "peak_rss_gb": peak / 1e9, "summary": proc.stdout.read().strip()}


def loader_cost(recipe_path: str, corpus: Path, tokenizer_path: str, work: Path, steps: int) -> dict:
    """Seconds per next_batch (micro-batch 8 x 2048 tokens, shuffled) over one token file and over the same tokens
    as shards of 5M tokens, alternating rounds of `steps` batches."""
    for target in ("one.bin", "shards"):
        subprocess.run(
            [
                sys.executable,
                str(TOOL),
                "--recipe",
                recipe_path,
                "--data.tokenizer_path",
                tokenizer_path,
                "--data.train_path",
                str(work / target),
                "--data.val_path",
                "null",
                "--input",
                str(corpus),
                "--shard_tokens",
                "5000000",
            ],
            check=True,
            capture_output=True,
        )
    times: dict[str, list[float]] = {"file": [], "shards": []}
    for _ in range(3):
        for name, path in (("file", work / "one.bin"), ("shards", work / "shards")):
            loader = TokenLoader(open_tokens(path), 2048, 8, seed=len(times[name]))
            start = time.perf_counter()
            for _ in range(steps):
                loader.next_batch()
            times[name].append((time.perf_counter() - start) / steps)
    return {name: min(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = recipe_parser("benchmarks/bench_prepare.py", __doc__.split("\n\n")[0])
    parser.add_argument("--sizes_mb", type=list[int], default=[100, 1000])
    parser.add_argument("--workers", type=list[int], default=[1, 2])
    parser.add_argument("--tokenizers", type=list[str], default=["sp", "hf"])
    parser.add_argument("--work_dir", default="bench_out/prepare")
    parser.add_argument("--loader_steps", type=int, default=0, help="also time the loader over shards (0: no)")
    parser.add_argument("--out", default="bench_out/prepare.json")
    recipe, args = parse_args(parser, argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    recipe_path = str(work / "recipe.yaml")
    Path(recipe_path).write_text(json.dumps({"model": {"vocab_size": 4096}}))
    tokenizers = make_tokenizers(work)
    rows = []
    for size in args.sizes_mb:
        corpus = work / f"corpus_{size}mb.jsonl"
        if not corpus.is_file():
            make_corpus(corpus, size)
        mb = corpus.stat().st_size / 1e6
        for name in args.tokenizers:
            base = direct(corpus, tokenizers[name])
            rows.append({"size_mb": mb, "tokenizer": name, "impl": "direct", **base})
            print(json.dumps(rows[-1]), flush=True)
            for workers in args.workers:
                result = ours(recipe_path, corpus, tokenizers[name], workers, work / "out")
                rows.append({"size_mb": mb, "tokenizer": name, "impl": f"ours, {workers} worker(s)", **result})
                print(json.dumps(rows[-1]), flush=True)
    print("| input | tokenizer | implementation | MB/s | tokens/s | ours / direct | peak RSS (process tree) |")
    print("|---|---|---|---|---|---|---|")
    directs = {(r["size_mb"], r["tokenizer"]): r for r in rows if r["impl"] == "direct"}
    for r in rows:
        ratio = directs[r["size_mb"], r["tokenizer"]]["seconds"] / r["seconds"]
        rss = f"{r['peak_rss_gb']:.2f} GB" if "peak_rss_gb" in r else "-"
        print(
            f"| {r['size_mb']:,.0f} MB jsonl | {r['tokenizer']} | {r['impl']} | {r['size_mb'] / r['seconds']:.2f} | "
            f"{r['tokens'] / r['seconds']:,.0f} | {ratio:.2f} | {rss} |"
        )
    loader = None
    if args.loader_steps:
        corpus = work / f"corpus_{min(args.sizes_mb)}mb.jsonl"
        loader = loader_cost(recipe_path, corpus, tokenizers["sp"], work, args.loader_steps)
        print(
            f"loader, seconds per batch of 8 x 2048: one file {loader['file'] * 1e3:.3f} ms, "
            f"shards {loader['shards'] * 1e3:.3f} ms"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    header = report_header(recipe, args, ("sizes_mb", "workers", "tokenizers", "loader_steps"))
    Path(args.out).write_text(json.dumps({**header, "rows": rows, "loader_s_per_batch": loader}, indent=1))


if __name__ == "__main__":
    main()
