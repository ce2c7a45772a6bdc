"""The yardstick for benchmarks/bench.py: a plain FSDP2 training loop, written the way one does without a framework.

    torchrun --standalone --nproc_per_node=2 benchmarks/baseline_loop.py --recipe R --steps 20 --warmup 5 --out r.json

Same model (fsdp_trainer.model, same init), same data file (the recipe's data.train_path), same global batch and
optimizer as the recipe; nothing else: no config system beyond reading the recipe, no checkpointing, no eval, no
logging until the end. Writes one JSON object: tokens/s over the `steps` after `warmup`, the median and largest time
of those steps (rank 0) and the largest peak memory of any rank.
"""

import json
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fsdp_trainer.config import compute_dtype, parse_args, recipe_parser
from fsdp_trainer.distributed.parallelize import materialize
from fsdp_trainer.distributed.runtime import close_distributed, precision_on
from fsdp_trainer.metrics import StepTimer, peak_memory_gb
from fsdp_trainer.model import Transformer

parser = recipe_parser("benchmarks/baseline_loop.py", __doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--warmup", type=int, default=5)
parser.add_argument("--out", required=True)
recipe, args = parse_args(parser)
data, mcfg = recipe.data, recipe.model

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)

with torch.device("meta"):
    model = Transformer(mcfg)
precision, _ = precision_on(recipe.parallel.mixed_precision, device.type)  # auto: what the trainer would choose
mp = MixedPrecisionPolicy(param_dtype=compute_dtype(precision), reduce_dtype=torch.float32)
for block in model.model.layers.values():
    fully_shard(block, mp_policy=mp)
fully_shard(model, mp_policy=mp)
materialize(model, device, seed=0)  # the trainer's init, so both start from the same weights (not timed)
optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.optim.lr, betas=recipe.optim.betas,
                              weight_decay=recipe.optim.weight_decay, fused=True)  # fmt: skip

tokens = np.memmap(data.train_path, dtype=np.uint16 if mcfg.vocab_size <= 65536 else np.uint32, mode="r")
rng = np.random.default_rng(rank)


def get_batch():  # nanoGPT's: random windows
    starts = rng.integers(0, len(tokens) - data.seq_len - 1, data.micro_batch_size)
    rows = torch.from_numpy(np.stack([tokens[s : s + data.seq_len + 1] for s in starts]).astype(np.int64))
    rows = rows.to(device, non_blocking=True)
    return rows[:, :-1], rows[:, 1:]


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


step_timer = StepTimer(device)  # the trainer's per-step clock (CUDA events on a GPU), so the spreads compare
for step in range(args.warmup + args.steps):
    if step == args.warmup:
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        step_timer.restart()
    for micro in range(data.grad_accum_steps):
        model.set_requires_gradient_sync(micro == data.grad_accum_steps - 1)
        x, y = get_batch()
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        (loss / data.grad_accum_steps).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.optim.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step_timer.mark()
step_times = step_timer.durations()
sync()
elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start

mem = torch.tensor(peak_memory_gb(device), device=device)
dist.all_reduce(mem, op=dist.ReduceOp.MAX)
tokens_per_step = data.micro_batch_size * data.grad_accum_steps * data.seq_len * world
if rank == 0:
    tokens = tokens_per_step * args.steps
    result = {"tokens_per_s": tokens / elapsed, "tokens_per_cpu_s": tokens / cpu, "peak_mem_gb": mem.item(),
              "step_time_s": statistics.median(step_times), "step_time_max_s": max(step_times),
              "loss": loss.item()}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f)
# Drop the model (its FSDP state holds the process group) and free the groups now: a gloo group freed at interpreter
# exit can abort the process (see close_distributed).
del model, optimizer
close_distributed()
