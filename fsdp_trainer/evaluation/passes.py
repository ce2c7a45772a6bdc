"""What the model computes for lm-eval's requests, whole on each process or sharded over them: continuations' scores
from one forward pass per batch, and continuations generated a token per pass through a KV cache.

A sharded model (FSDP2, as it trains) gathers its weights from every rank in each forward pass, so the ranks must
make the same number of passes whatever their share of the work: in `lockstep` they agree after each pass whether any
rank has more to do (one all-reduce of a flag), and a rank with none left runs a one-token pass whose answer it drops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_trainer.checkpoint.restore import load_weights
from fsdp_trainer.checkpoint.weights import read_saved_model
from fsdp_trainer.config import ParallelConfig
from fsdp_trainer.distributed.parallelize import materialize, parallelize
from fsdp_trainer.distributed.runtime import DistEnv
from fsdp_trainer.generation import sample
from fsdp_trainer.model import KVCache, Transformer, on_meta
from fsdp_trainer.tokenizer import Tokenizer, load_tokenizer


class Passes:
    """The forward passes of `model` on `device`; `lockstep`: the model is sharded over the ranks."""

    def __init__(self, model: Transformer, device: torch.device, lockstep: bool):
        self.model, self.device, self.lockstep = model, device, lockstep

    def more(self, mine: bool) -> bool:
        """Whether this rank (or, in lockstep, any rank) has another forward pass to make."""
        if not self.lockstep:
            return mine
        flag = torch.tensor([float(mine)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def idle(self) -> None:
        """A forward pass with nothing to compute, for a rank whose work is done while others' is not."""
        self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device))

    def each(self, work: list, idle: Callable[[], object] | None = None) -> Iterator:
        """The items of `work`, each taking the passes its consumer makes (in lockstep, then `idle`, by default one
        idle pass, as long as another rank has items left: the passes an item of its takes)."""
        done = 0
        while self.more(done < len(work)):
            if done == len(work):
                (idle or self.idle)()
            else:
                done += 1
                yield work[done - 1]


class ContinuationScores:
    """An objective for Transformer.forward (loss.py's kind): from the final hidden states, each continuation's summed
    log-probability and whether greedy decoding would have produced it, computing logits only where a continuation's
    tokens are predicted."""

    def __init__(self, rows: torch.Tensor, columns: torch.Tensor, targets: torch.Tensor, owner: torch.Tensor, n: int):
        self.rows, self.columns, self.targets, self.owner, self.n = rows, columns, targets, owner, n

    def __call__(self, hidden: torch.Tensor, head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        logps = torch.log_softmax(head(hidden[self.rows, self.columns]).float(), dim=-1)  # (predicted tokens, vocab)
        token_logps = logps.gather(1, self.targets[:, None])[:, 0]
        missed = (logps.argmax(-1) != self.targets).float()
        sums = torch.zeros(self.n, dtype=torch.float32, device=hidden.device)
        misses = torch.zeros(self.n, dtype=torch.float32, device=hidden.device)
        return sums.index_add_(0, self.owner, token_logps), misses.index_add_(0, self.owner, missed) == 0


@torch.no_grad()
def score(passes: Passes, contexts: list[list[int]], continuations: list[list[int]]) -> list[tuple[float, bool]]:
    """(each continuation's log-probability given its context, whether it is the greedy one) in one forward pass, each
    context + continuation cut on the left to max_seq_len tokens as HFLM cuts them, right-padded."""
    max_len = passes.model.cfg.max_seq_len
    windows = [(c + x)[-(max_len + 1) :][:-1] for c, x in zip(contexts, continuations, strict=True)]
    tokens = torch.zeros(len(windows), max(len(window) for window in windows), dtype=torch.long)
    rows, columns, targets, owner = [], [], [], []
    for i, (window, continuation) in enumerate(zip(windows, continuations, strict=True)):
        tokens[i, : len(window)] = torch.tensor(window)
        end = len(window)  # the logits at end - k predict the k-th last token of the continuation
        columns += range(end - len(continuation), end)
        rows += [i] * len(continuation)
        targets += continuation
        owner += [i] * len(continuation)
    picked = (torch.tensor(x, device=passes.device) for x in (rows, columns, targets, owner))
    sums, greedy = passes.model(tokens.to(passes.device), loss=ContinuationScores(*picked, len(windows)))
    return list(zip(sums.tolist(), greedy.tolist(), strict=True))


@torch.no_grad()
def continuation(
    passes: Passes, prompt: torch.Tensor | None, max_new: int, temperature: float, stop: Callable[[int, list], bool]
) -> list[int]:
    """The tokens that continue `prompt` (None: none, keeping step with the ranks that generate), a pass each, the
    prompt read once into a KV cache; until `stop(token, tokens so far)` or max_new tokens."""
    new: list[int] = []
    cache = None if prompt is None else KVCache(passes.model.cfg, len(prompt) + max_new)
    step_in = prompt
    while passes.more(prompt is not None and len(new) < max_new):
        if prompt is None or len(new) == max_new:
            passes.idle()
            continue
        logits = passes.model(step_in[None], cache=cache)[0, -1].float()
        new.append(int(sample(logits, temperature, None, None)))
        step_in = torch.tensor(new[-1:], device=passes.device)
        if stop(new[-1], new):
            max_new = len(new)
    return new


def load_sharded(path: str, env: DistEnv) -> tuple[Transformer, Tokenizer]:
    """A checkpoint's model (any world size; a LoRA run's adapters merged) sharded over this run's ranks by FSDP2 in
    fp32, frozen, and its tokenizer: for a model that does not fit one device whole (Passes in `lockstep`)."""
    saved = read_saved_model(path)
    if saved.tokenizer is None:
        raise FileNotFoundError(f"{saved.path} carries no tokenizer, and its recipe's data.tokenizer_path is gone")
    with on_meta():
        model = Transformer(saved.model)
    model.requires_grad_(False)
    parallelize(model, ParallelConfig(mixed_precision="fp32"), env.mesh)
    materialize(model, env.device, seed=0)
    load_weights(saved.path, model)
    return model.eval(), load_tokenizer(saved.tokenizer)
