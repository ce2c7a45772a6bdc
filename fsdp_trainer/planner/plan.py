"""Will it fit? Predicted memory per rank for every sharding x activation-checkpointing choice of a recipe.

    python -m fsdp_trainer.planner.plan --recipe recipes/8b.yaml --nproc 8 [--nnodes 2] [--device_mem_gb 80]
        [--device cuda] [--host_mem_gb 200]

Prints a table (training state, gathered parameters, activations, logits, runtime, total, bytes sent per step, and on
GPUs the same with the state offloaded to the host) and recommends the fastest configuration that fits.

The terms of a row's memory and communication are planner/memory.py's, its predicted step time (with --gpu)
planner/speed.py's. With --max_seq_len it prints instead, per AC mode, the longest data.seq_len and the largest
micro-batch that fit.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from typing import Literal

import torch

from fsdp_trainer.adapters import check_quantized_split, quantizes_base
from fsdp_trainer.checkpoint.storage import CheckpointError
from fsdp_trainer.config import Recipe, fail, parse_args, recipe_parser
from fsdp_trainer.distributed.expert_parallel import SHARDINGS as EP_SHARDINGS
from fsdp_trainer.distributed.expert_parallel import check_expert_parallel
from fsdp_trainer.distributed.parallelize import SHARDING
from fsdp_trainer.distributed.runtime import precision_on
from fsdp_trainer.metrics import PEAK_FLOPS
from fsdp_trainer.model import count_params
from fsdp_trainer.planner.fake import measured_peak_gb, measured_rows_gb
from fsdp_trainer.planner.memory import Estimate, estimate
from fsdp_trainer.planner.speed import (
    GPUS,
    StepTime,
    gpu_named,
    matmul_efficiency,
    matmul_tokens,
    peak_flops,
    step_time,
)
from fsdp_trainer.steps import training_kind

AC_MODES = ("none", "selective", "full")  # least to most recomputation


def shardings_of(nproc: int, nnodes: int, recipe: Recipe | None = None) -> list[str]:
    """The shardings a plan compares: HYBRID_SHARD only across nodes; under expert parallelism those it runs under.
    On one device there is nothing to shard over: the shardings differ only in whether a block's gathered weights are
    freed after its forward, as FULL_SHARD frees them, so its rows stand for all (the least memory, the same step)."""
    if nproc * nnodes == 1:
        return ["FULL_SHARD"]
    experts = recipe is not None and recipe.parallel.expert_parallel > 1
    return [
        s
        for s, p in SHARDING.items()
        if (nnodes > 1 or p.replicas != "per_node") and (not experts or s in EP_SHARDINGS)
    ]


def plan(recipe: Recipe, nproc: int, nnodes: int, device: str) -> list[Estimate]:
    """Every sharding x AC choice, and on GPUs each of them again with the state offloaded to the host."""
    # NF4 weights and split experts do not run offloaded yet (config.Recipe, check_expert_parallel refuse it)
    offloadable = not quantizes_base(recipe.lora) and recipe.parallel.expert_parallel == 1
    offloads = (False, True) if device == "cuda" and offloadable else (False,)
    return [
        estimate(recipe, nproc, nnodes, s, ac, device, offload)
        for offload in offloads
        for ac in AC_MODES
        for s in shardings_of(nproc, nnodes, recipe)
    ]


SEQ_LEN_STEP = 256
"""plan --max_seq_len tries sequence lengths in multiples of this."""


def fitting(recipe: Recipe, nproc: int, nnodes: int, ac: str, device: str, mem: float) -> Estimate | None:
    """The row (without offload) recommend() takes among the shardings with activation checkpointing `ac`, if any
    fits in `mem` GB a device."""
    rows = [estimate(recipe, nproc, nnodes, s, ac, device) for s in shardings_of(nproc, nnodes, recipe)]
    return recommend(rows, mem)


def largest(fits, low: int, high: int) -> int:
    """The largest n in [low, high] for which fits(n) holds, fits being monotone (low - 1 if none)."""
    while low <= high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if fits(middle) else (low, middle - 1)
    return high


def shaped(recipe: Recipe, seq_len: int, micro_batch_size: int, context_parallel: int | None = None) -> Recipe:
    """A copy of `recipe` with micro-batches of micro_batch_size x seq_len tokens (and a context-parallel degree)."""
    copied = copy.deepcopy(recipe)
    copied.data.seq_len, copied.data.micro_batch_size = seq_len, micro_batch_size
    copied.parallel.context_parallel = context_parallel or recipe.parallel.context_parallel
    return copied


def context_degrees(recipe: Recipe, nproc: int) -> list[int]:
    """The context-parallel degrees --max_seq_len tries: 1, and where the recipe's windows may be split, each power of
    2 that divides a node's ranks (a group within a node)."""
    degrees = [1]
    while training_kind(recipe).splits_windows and nproc % (2 * degrees[-1]) == 0:
        degrees.append(2 * degrees[-1])
    return degrees


def longest_fits(recipe: Recipe, nproc: int, nnodes: int, device: str, mem: float) -> list[tuple]:
    """Per context-parallel degree and AC mode: (degree, AC, the longest data.seq_len that fits at micro-batch 1, a
    multiple of SEQ_LEN_STEP up to model.max_seq_len, and its row; the largest data.micro_batch_size that fits at the
    recipe's seq_len, and its row), a length or size 0 and a row None where nothing fits (or the seq_len does not
    split into the degree's chunks)."""
    found, seq_len_now = [], recipe.data.seq_len
    for cp, ac in [(cp, ac) for cp in context_degrees(recipe, nproc) for ac in AC_MODES]:

        def row(seq_len: int, micro_batch_size: int, ac: str = ac, cp: int = cp) -> Estimate | None:
            return fitting(shaped(recipe, seq_len, micro_batch_size, cp), nproc, nnodes, ac, device, mem)

        steps = largest(lambda n: row(n * SEQ_LEN_STEP, 1) is not None, 1, recipe.model.max_seq_len // SEQ_LEN_STEP)
        batch = largest(lambda n: row(seq_len_now, n) is not None, 1, 4096) if seq_len_now % (2 * cp) == 0 else 0
        seq_len = max(steps, 0) * SEQ_LEN_STEP
        seq_row = row(seq_len, 1) if seq_len else None
        found.append((cp, ac, seq_len, seq_row, max(batch, 0), row(seq_len_now, batch) if batch > 0 else None))
    return found


def longest_table(recipe: Recipe, nproc: int, nnodes: int, device: str, mem: float, check: bool) -> str:
    """longest_fits as a table; with `check`, each longest sequence's row run on fake tensors beside its estimate."""
    columns = ["context parallel", "AC", "longest data.seq_len (micro-batch 1)", "sharding", "GB / rank",
               f"largest micro-batch at seq_len {recipe.data.seq_len}", "sharding", "GB / rank"]  # fmt: skip
    if check:
        columns.append("longest: planned / measured on fake tensors (GB, no runtime)")
    rows = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for cp, ac, seq_len, seq_row, batch, batch_row in longest_fits(recipe, nproc, nnodes, device, mem):
        limit = " (model.max_seq_len)" if seq_len + SEQ_LEN_STEP > recipe.model.max_seq_len else ""
        cells = [str(cp), ac, f"{seq_len:,}{limit}", *_row_cells(seq_row), str(batch), *_row_cells(batch_row)]
        if check:
            cells.append("-")
            if seq_row is not None:
                longest = shaped(recipe, seq_len, 1, cp)
                longest.parallel.sharding, longest.parallel.activation_checkpointing = seq_row.sharding, ac
                planned = seq_row.total_gb - seq_row.runtime_gb
                cells[-1] = f"{planned:.2f} / {measured_peak_gb(longest, nproc, nnodes):.2f}"
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _row_cells(row: Estimate | None) -> list[str]:
    return ["-", "-"] if row is None else [row.sharding, f"{row.total_gb:.1f}"]


SAME_STEP = 0.01
"""Predicted steps within 1% of each other are the same to the step-time model, whose overlap of communication and
compute is coarser than that (ZeRO-2's all-gathers saved move the shipped recipes' steps by 0.04-0.8%); the least
memory among them leaves the allocator room at the card's edge and the micro-batch room to grow."""


HEADROOM = 0.05
"""The share of a device's memory the recommendation leaves free when it can. The planner's peak is what tensors take;
the caching allocator's fragmentation adds to it (5-10%), and at the card's edge it frees its cache and retries:
llm-foundry's MPT-30B ran 23-30% slower at 8,192 tokens than at 4,096, where the planner puts it at 97% of the card
(the 4,096 row at 91%, 2,048 at 94%), and 21-27% slower than the step-time model predicts, which prices no retry: 5%
is the least room to leave, not enough for every stack. A row that fits only in the last 5% is recommended when
nothing else fits, with that said, and named when it would run faster."""


def leaves_headroom(total_gb: float, device_mem_gb: float, headroom: float = HEADROOM) -> bool:
    """Whether a row of `total_gb` leaves `headroom` of the device's memory free."""
    return total_gb <= device_mem_gb * (1 - headroom)


def recommend(
    estimates: list[Estimate],
    device_mem_gb: float,
    host_mem_gb: float = math.inf,
    times: list[StepTime | None] | None = None,
    headroom: float = HEADROOM,
) -> Estimate | None:
    """The fastest that fits, without offload if anything fits so (the host's optimizer step and the copies cost far
    more than recomputation), and leaving `headroom` of the device's memory free if anything does so. With predicted
    step `times` (one per estimate, on a named GPU): of the steps within SAME_STEP of the shortest, the least memory.
    Without: the least recomputation (AC costs compute on every step), then the fewest bytes over the network between
    nodes (the slowest link), then the fewest bytes sent, then the least memory."""
    times = times or [None] * len(estimates)
    fits = [(e, t) for e, t in zip(estimates, times, strict=True) if e.fits(device_mem_gb, host_mem_gb)]
    if not fits:
        return None
    offload = min(e.offload for e, _ in fits)
    fits = [(e, t) for e, t in fits if e.offload == offload]
    fits = [(e, t) for e, t in fits if leaves_headroom(e.total_gb, device_mem_gb, headroom)] or fits

    def cost(e: Estimate) -> tuple:
        return AC_MODES.index(e.ac), round(e.internode_gb, 3), round(e.sent_gb, 3), e.total_gb

    steps = [t.step_s for _, t in fits if t is not None]
    if steps:
        fast = [e for e, t in fits if t is not None and t.step_s <= min(steps) * (1 + SAME_STEP)]
        return min(fast, key=lambda e: (e.total_gb, *cost(e)))
    return min((e for e, _ in fits), key=cost)


def expert_cases(recipe: Recipe, nproc: int) -> list[Recipe]:
    """A mixture-of-experts recipe planned without expert parallelism, with each degree worth pricing: each power of 2
    that divides a node's ranks and the experts, where the recipe could run with it (expert_parallel.check)."""
    if recipe.model.moe is None or recipe.parallel.expert_parallel > 1:
        return []
    cases, degree = [], 2
    while nproc % degree == 0 and recipe.model.moe.experts % degree == 0:
        case = copy.deepcopy(recipe)
        case.parallel.expert_parallel = degree
        try:
            check_expert_parallel(case)
        except ValueError:
            return []  # the recipe's offload or context parallelism: no degree runs
        cases.append(case)
        degree *= 2
    return cases


def expert_parallel_line(
    recipe: Recipe, args, device: str, mem: float, host_mem: float, best: Estimate, best_time: StepTime | None
) -> str | None:
    """For a mixture of experts planned without expert parallelism: the degree whose recommended row is fastest
    (--gpu), else sends the fewest bytes, beside the row recommended without it (`best`, its `best_time` with --gpu);
    None where no degree runs, fits or does better than `best`."""
    found = []
    for case in expert_cases(recipe, args.nproc):
        rows = plan(case, args.nproc, args.nnodes, device)
        times = [step_time(case, e, args.gpu, args.nproc, args.nnodes) for e in rows] if args.gpu else None
        row = recommend(rows, mem, host_mem, times)
        if row is not None:
            t = times[rows.index(row)] if times else None
            found.append((t.step_s if t else 0.0, row.sent_gb, case.parallel.expert_parallel, row, t))
    if not found:
        return None
    _, _, degree, row, t = min(found, key=lambda f: f[:2])
    if (t.step_s >= best_time.step_s) if t and best_time else row.sent_gb >= best.sent_gb:
        return None
    step = f", {t.step_s:.2f} s a step against {best_time.step_s:.2f}" if t and best_time else ""
    return (f"expert parallelism: --parallel.expert_parallel {degree} {_flags(row)} ({row.total_gb:.1f} GB) sends "
            f"{row.sent_gb:.3g} GB a step against {best.sent_gb:.3g}{step}")  # fmt: skip


def table(
    estimates: list[Estimate], device_mem_gb: float, host_mem_gb: float, times: list[StepTime | None] | None = None
) -> str:
    """The estimates as a markdown table, a row each, with whether it fits and, on a named GPU, its predicted step."""
    speed = " | step s | exposed comm s | tokens/s / GPU | MFU" if times else ""
    rows = [
        "| sharding | AC | state | reference | gathered | activations | logits | block backward | grad buffers "
        "| accumulated grads | optimizer step | runtime | total GB / rank | fits | sent GB / step (between nodes) "
        f"| host GB / rank | host<->device GB / step{speed} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" * 4 if times else ""),
    ]
    for e, t in zip(estimates, times or [None] * len(estimates), strict=True):
        terms = (e.state_gb, e.reference_gb, e.gathered_gb, e.activations_gb, e.logits_gb, e.backward_gb,
                 e.grad_buffers_gb, e.accumulated_gb, e.optimizer_step_gb, e.runtime_gb, e.total_gb)  # fmt: skip
        fits = "yes" if e.fits(device_mem_gb, host_mem_gb) else "no"
        name = f"{e.sharding} + offload" if e.offload else e.sharding
        predicted = ""
        if times:
            predicted = (
                " - | - | - | - |"
                if t is None
                else (
                    f" {t.step_s:.2f} | {t.exposed_comm_s:.2f} | {t.tokens_per_s_per_gpu:,.0f} | {100 * t.mfu:.1f}% |"
                )
            )
        rows.append(
            f"| {name} | {e.ac} | {' | '.join(f'{x:.2f}' for x in terms)} | {fits} | {e.sent_gb:.2f} "
            f"({e.internode_gb:.2f}) | {e.host_gb:.2f} | {e.host_traffic_gb:.2f} |{predicted}"
        )
    return "\n".join(rows)


def check_table(recipe: Recipe, estimates: list[Estimate], nproc: int, nnodes: int) -> str:
    """The estimate of each row without offload beside the peak one step allocates at the real shapes on fake tensors
    (planner/fake.py), both without the runtime term (CUDA context, NCCL, fragmentation), which a fake step has
    none of."""
    rows = ["| sharding | AC | planned GB / rank (no runtime) | measured on fake tensors | planned / measured |",
            "|---|---|---|---|---|"]  # fmt: skip
    # The AC modes to measure by sharding; by sharding, why a run would refuse it (QLoRA's weights not splitting, EP)
    modes, refused = {}, {}
    checked = [e for e in estimates if not e.offload]
    for sharding in dict.fromkeys(e.sharding for e in checked):
        case = copy.deepcopy(recipe)
        case.parallel.sharding = sharding
        try:
            if quantizes_base(recipe.lora):
                check_quantized_split(recipe.model, recipe.lora, sharding, nproc * nnodes, nproc)
            check_expert_parallel(case)
        except ValueError as error:
            refused[sharding] = f"{sharding}: {error}"
            continue
        modes[sharding] = [e.ac for e in checked if e.sharding == sharding]
    measured = measured_rows_gb(recipe, nproc, nnodes, modes)
    for e in checked:
        planned = e.total_gb - e.runtime_gb
        if e.sharding in refused:
            rows.append(f"| {e.sharding} | {e.ac} | {planned:.2f} | - | - |")
            continue
        gb = measured[e.sharding, e.ac]
        rows.append(f"| {e.sharding} | {e.ac} | {planned:.2f} | {gb:.2f} | {planned / gb:.2f} |")
    return "\n".join([*rows, *refused.values()])


def _parser():
    parser = recipe_parser("fsdp_trainer.planner.plan", __doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, required=True, help="processes (devices) per node")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument(
        "--device_mem_gb", type=float | None, help="memory per device (default: the GPU's, or RAM / nproc)"
    )
    parser.add_argument(
        "--host_mem_gb",
        type=float | None,
        help="host memory per rank, for offload (default: this machine's RAM / nproc)",
    )
    parser.add_argument("--device", type=Literal["cuda", "cpu"] | None, help="default: cuda if a GPU is visible")
    parser.add_argument(
        "--gpu",
        type=Literal[tuple(GPUS)] | None,
        help="predict each row's step time, tokens/s per GPU and MFU on this GPU (planner/speed.py), recommend "
        "the fastest that fits; sets --device cuda and --device_mem_gb to its memory unless given; default: this "
        "machine's GPU where it is one of these",
    )
    parser.add_argument(
        "--train_tokens", type=float | None, help="with --gpu: the time and GPU-hours to train this many tokens"
    )
    parser.add_argument(
        "--check",
        type=bool,
        nargs="?",
        const=True,
        default=False,
        help="also run one step of each row at the real shapes and world size on fake tensors and a fake process "
        "group (no memory, no devices: seconds per row) and print its measured peak beside the estimate",
    )
    parser.add_argument(
        "--max_seq_len",
        type=bool,
        nargs="?",
        const=True,
        default=False,
        help="instead of the table: per AC mode, the longest data.seq_len that fits at micro-batch 1 and the largest "
        "data.micro_batch_size at the recipe's seq_len, with the sharding that fits each (with --check, each "
        "longest one run on fake tensors)",
    )
    return parser


def _checked_args(args) -> None:
    if args.nproc < 1 or args.nnodes < 1:
        fail("--nproc and --nnodes must be >= 1")
    for flag in ("device_mem_gb", "host_mem_gb"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            fail(f"--{flag} must be positive, not {getattr(args, flag)}")
    if args.train_tokens is not None and (args.gpu is None or args.train_tokens <= 0):
        fail("--train_tokens needs --gpu and a positive number of tokens")


def _memories(args, device: str) -> tuple[float, float]:
    """(memory per device, host memory per rank) in GB: as given, else the GPU's and this machine's; a plan for GPUs
    on a machine without one names the GPU or its memory (this machine's RAM is no GPU's)."""
    host_mem = args.host_mem_gb or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / args.nproc
    mem = args.device_mem_gb or (GPUS[args.gpu].memory_gb if args.gpu else None)
    if mem is None and device == "cuda" and not torch.cuda.is_available():
        fail(
            "--device cuda on a machine without a GPU: name the GPU to plan for with --gpu "
            f"({', '.join(GPUS)}), or its memory with --device_mem_gb"
        )
    if mem is None:
        mem = torch.cuda.get_device_properties(0).total_memory / 1e9 if device == "cuda" else host_mem
    return mem, host_mem


def _gpu_line(gpu: str) -> str:
    spec = GPUS[gpu]
    fp8 = f" ({spec.fp8_flops / 1e12:,.0f} fp8)" if spec.fp8_flops else ""
    return (
        f"{gpu}: {PEAK_FLOPS[gpu]['bf16'] / 1e12:,.0f} TFLOP/s dense bf16{fp8}, HBM {spec.hbm_gb_s / 1e3:.2f} TB/s, "
        f"NVLink {spec.nvlink_gb_s} GB/s and network {spec.network_gb_s} GB/s per GPU and direction (datasheets)"
    )


def _flags(row: Estimate) -> str:
    offload = " --parallel.cpu_offload true" if row.offload else ""
    return f"--parallel.sharding {row.sharding} --parallel.activation_checkpointing {row.ac}{offload}"


def _nothing_fits(estimates: list[Estimate], mem: float, host_mem: float) -> str:
    smallest = min(estimates, key=lambda e: e.total_gb)
    offload = host = ""
    if smallest.offload:
        offload, host = " + offload", f", and {smallest.host_gb:.1f} GB on a host of {host_mem:.1f}"
    return (
        f"nothing fits in {mem:.1f} GB per device (smallest: {smallest.sharding} + {smallest.ac} AC{offload}, "
        f"{smallest.total_gb:.1f} GB{host}): lower data.micro_batch_size (and raise data.grad_accum_steps) or add "
        "devices"
    )


def _prediction(args, recipe: Recipe, t: StepTime) -> str:
    gpus = args.nproc * args.nnodes
    lines = [f"predicted on {gpus} x {args.gpu}: {t.step_s:.2f} s a step, {t.tokens_per_s_per_gpu:,.0f} tokens/s per "
             f"GPU, MFU {100 * t.mfu:.1f}% (a model calibrated on published runs: docs/benchmarks.md)"]  # fmt: skip
    moe = recipe.model.moe
    if moe is not None:  # why a mixture of experts runs further from peak, and what a longer micro-batch buys it
        tokens, per_expert = matmul_tokens(recipe)
        peak = peak_flops(recipe, args.gpu)
        hbm = GPUS[args.gpu].hbm_gb_s * 1e9
        n = recipe.parallel.expert_parallel
        held = f", each rank holding {moe.experts // n} and taking their copies from {n} ranks" if n > 1 else ""
        lines.append(
            f"experts: each sees {per_expert:,.0f} tokens a micro-batch of {tokens:,} (top_k {moe.top_k} of "
            f"{moe.experts}{held}), their matmuls at {matmul_efficiency(per_expert, peak, hbm):.0%} of peak, the other "
            f"matmuls at {matmul_efficiency(tokens, peak, hbm):.0%}; a longer data.micro_batch_size raises both"
        )
    if args.train_tokens:
        hours = args.train_tokens / (t.tokens_per_s_per_gpu * gpus) / 3600
        lines.append(f"{args.train_tokens:.3g} tokens: {hours:,.1f} hours, {hours * gpus:,.0f} GPU-hours")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    recipe, args = parse_args(_parser(), argv)
    _checked_args(args)
    device = "cuda" if args.gpu else args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.gpu is None and device == "cuda" and torch.cuda.is_available():  # this machine's GPU, if known
        args.gpu = gpu_named(torch.cuda.get_device_name(0))
    recipe.parallel.mixed_precision, why = precision_on(recipe.parallel.mixed_precision, device)
    mem, host_mem = _memories(args, device)
    try:
        estimates = plan(recipe, args.nproc, args.nnodes, device)
    except CheckpointError as e:  # a checkpoint the plan reads a size from (distill.teacher)
        fail(e)
    data = recipe.data
    print(
        f"{recipe.model.family} {count_params(recipe.model) / 1e6:,.1f}M params, {recipe.parallel.mixed_precision} "
        f"({why}), micro-batch {data.micro_batch_size} x {data.seq_len} tokens, {args.nnodes} node(s) x {args.nproc} "
        f"{device} device(s) of {mem:.1f} GB"
    )
    if args.max_seq_len:
        print(longest_table(recipe, args.nproc, args.nnodes, device, mem, args.check))
        return
    times = None
    if args.gpu:
        print(_gpu_line(args.gpu))
        times = [step_time(recipe, e, args.gpu, args.nproc, args.nnodes) for e in estimates]
    print(table(estimates, mem, host_mem, times))
    note = training_kind(recipe).plan_note(recipe, estimates)
    if note:
        print(note)
    if args.check:
        print(check_table(recipe, estimates, args.nproc, args.nnodes))
    best = recommend(estimates, mem, host_mem, times)
    if best is None:
        sys.exit(_nothing_fits(estimates, mem, host_mem))  # a verdict, not an error of input: no `error:` prefix
    print(f"recommended: {_flags(best)} ({best.total_gb:.1f} of {mem:.1f} GB)")
    t = times[estimates.index(best)] if times else None
    if t is not None:
        print(_prediction(args, recipe, t))
    if line := expert_parallel_line(recipe, args, device, mem, host_mem, best, t):
        print(line)
    if not leaves_headroom(best.total_gb, mem):
        print(f"at the edge: nothing else fits, and this leaves less than plan.HEADROOM ({HEADROOM:.0%}) of the device "
              f"free, which the allocator's fragmentation may take; its retries there slow a step beyond any "
              f"prediction above (llm-foundry's MPT-30B at 97% of its card: 21-27%)")  # fmt: skip
    tight = recommend(estimates, mem, host_mem, times, headroom=0.0)
    if tight is not best:
        step = f", {times[estimates.index(tight)].step_s:.2f} s a step" if times else ""
        print(
            f"tight: {_flags(tight)} fits at {tight.total_gb:.1f} of {mem:.1f} GB{step}, within plan.HEADROOM "
            f"({HEADROOM:.0%}) of the device, which the allocator's fragmentation may take"
        )


if __name__ == "__main__":
    main()
