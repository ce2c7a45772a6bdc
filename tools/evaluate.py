"""Score a model on benchmark tasks with lm-evaluation-harness: a run directory or checkpoint of ours (any world size,
LoRA merged on the fly) or an HF model directory, without exporting first.

python tools/evaluate.py runs/debug --tasks shakespeare_next_line
python tools/evaluate.py runs/sft_qwen3_0.6b --tasks hellaswag,arc_easy --num_fewshot 0 --output_path scores.json
torchrun --nproc_per_node 4 tools/evaluate.py runs/sft --tasks gsm8k --apply_chat_template   # the requests split 4 ways

Each process holds the model whole (or, with --shard, its shard of it) and scores its share of each task's requests;
rank 0 prints a line per task and writes lm-eval's JSON to --output_path. Needs the `eval` extra:
pip install -e ".[eval]".
"""

from __future__ import annotations

import json
from pathlib import Path

from jsonargparse import ArgumentParser

from fsdp_trainer.checkpoint.holds import reading
from fsdp_trainer.config import ParallelConfig, one_line_errors
from fsdp_trainer.convert import is_hf_dir, load_model
from fsdp_trainer.distributed.runtime import close_distributed, init_distributed
from fsdp_trainer.files import write_atomic


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="tools/evaluate.py", description=__doc__.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("path", help="run directory, checkpoint directory, or HF model directory")
    parser.add_argument("--tasks", type=str, required=True, help="comma-separated names (shakespeare_next_line, ...)")
    parser.add_argument("--num_fewshot", type=int | None, default=None, help="examples before each (the task's own)")
    parser.add_argument("--limit", type=float | None, default=None, help="items per task (a fraction when below 1)")
    parser.add_argument("--batch_size", type=int, default=8, help="requests per forward pass")
    parser.add_argument("--max_gen_toks", type=int, default=256, help="most tokens generated, if a task sets none")
    parser.add_argument("--apply_chat_template", type=bool, nargs="?", const=True, default=False,
                        help="render each request with the tokenizer's chat template (a chat model)")  # fmt: skip
    parser.add_argument("--include_path", type=str | None, default=None, help="a directory of task YAML files")
    parser.add_argument("--output_path", type=str | None, default=None, help="where to write lm-eval's results JSON")
    parser.add_argument("--seed", type=str | None, default=None,
                        help="seeds of Python, numpy, torch and the few-shot draw: one integer for all four, or four "
                        "comma-separated; default lm-eval's, 0,1234,1234,1234 (lm_eval's examples)")  # fmt: skip
    parser.add_argument("--log_samples", type=bool, nargs="?", const=True, default=False,
                        help="write each document's result (arguments, responses, answer, metrics) as "
                        "OUTPUT_PATH's name + _samples_TASK.jsonl beside the results JSON (as lm_eval)")  # fmt: skip
    parser.add_argument("--shard", type=bool, nargs="?", const=True, default=False,
                        help="shard the model over the processes (FSDP2) instead of one whole copy each: for a model "
                        "that does not fit one device; our checkpoints only")  # fmt: skip
    with one_line_errors():
        args = parser.parse_args(argv)
        try:
            from fsdp_trainer.evaluation.lm import ModelLM
            from fsdp_trainer.evaluation.passes import load_sharded
            from fsdp_trainer.evaluation.tasks import check_tasks, evaluate, result_lines
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(f"tools/evaluate.py needs lm-eval ({e}): pip install -e '.[eval]'") from None
        tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
        try:
            check_tasks(tasks, args.include_path)
        except ValueError as e:
            raise ValueError(f"--tasks: {e}") from None
        seeds = parse_seeds(args.seed)
        if args.log_samples and not args.output_path:
            raise ValueError("--log_samples writes beside --output_path: name one")
        if args.shard and is_hf_dir(args.path):
            raise ValueError(f"--shard reads our checkpoints; import {args.path} first (tools/import_hf.py)")
        env = init_distributed(ParallelConfig())
        try:
            with reading(args.path, "tools/evaluate.py") as path:
                model, tokenizer = load_sharded(path, env) if args.shard else load_model(path)
            lm = ModelLM(model.to(env.device), tokenizer, args.batch_size, args.max_gen_toks, lockstep=args.shard)
            results = evaluate(lm, tasks, args.num_fewshot, args.limit, args.apply_chat_template, args.include_path,
                               seeds, args.log_samples)  # fmt: skip
        finally:
            close_distributed()
    if results is None:  # not rank 0
        return
    for line in result_lines(results):
        print(line)
    if args.output_path:
        write_results(results, Path(args.output_path))


def parse_seeds(seed: str | None) -> list[int] | None:
    """--seed as lm-eval's four seeds: one integer for all, or four comma-separated; None for lm-eval's defaults."""
    if seed is None:
        return None
    try:
        seeds = [int(s) for s in seed.split(",")]
    except ValueError:
        seeds = []
    if len(seeds) not in (1, 4):
        raise ValueError(f"--seed {seed}: one integer, or four comma-separated (python,numpy,torch,fewshot)")
    return seeds * 4 if len(seeds) == 1 else seeds


def write_results(results: dict, path: Path) -> None:
    """lm-eval's results JSON at `path`, and each task's per-document samples (if logged) beside it as
    NAME_samples_TASK.jsonl, a document a line."""
    samples = results.pop("samples", None) or {}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(results, indent=2, default=str) + "\n")
    for task, documents in samples.items():
        lines = "".join(json.dumps(doc, default=str, ensure_ascii=False) + "\n" for doc in documents)
        write_atomic(path.with_name(f"{path.stem}_samples_{task}.jsonl"), lines)


if __name__ == "__main__":
    main()
