"""Context parallelism: each window's positions split over the `parallel.context_parallel` ranks of a group, for
windows longer than one device's activations hold.

The ranks of a group read the same windows (they count as one data-parallel rank) and each keeps 2 of its 2N equal
chunks, r and 2N - 1 - r (head and tail), so the causal attention work is even over the group. Each block's keys and
values are all-gathered in the group (their gradients reduce-scattered back) and the local queries attend to them
with the whole window's mask (model.ContextShard). Nothing else changes: FSDP shards the parameters over every rank of
the world, CP's included (torchtitan's dp_shard_cp), so CP costs no parameter memory; and the loss is already the sum
over the global batch's targets, wherever they are, divided by their number.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention.flex_attention import create_block_mask

from fsdp_trainer.data.loader import MicroBatch, trained_positions
from fsdp_trainer.model import ContextMask, additive, causal, example_positions


class ContextShard(NamedTuple):
    """This rank's share of each window: runs of consecutive positions of the whole window, held one after the
    other, the keys and values of every rank gathered in attention (model.Context)."""

    runs: tuple[tuple[int, int], ...]
    """(start, end) of each run in the whole window, in the order this rank holds them."""
    documents: torch.Tensor | None
    """(B, length) packed data: the whole window's example numbers (model.block_causal)."""
    gather: Callable[[torch.Tensor], torch.Tensor]
    """ContextParallel.gather."""
    summed: Callable[[torch.Tensor], torch.Tensor]
    """ContextParallel.summed: a statistic of the whole windows (a mixture of experts' routing)."""

    def attention_inputs(
        self, rope_cos: torch.Tensor, rope_sin: torch.Tensor, window: int | None, flex: bool, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, ContextMask]:
        """The rotary angles of the positions this rank holds, and for each run the gathered keys it may see (from the
        first its window reaches to its last query) under the whole window's rows of the mask there: causal, by
        example when packed, within a sliding `window`. A BlockMask with `flex`, else additive in `dtype`."""
        documents, device = self.documents, rope_cos.device
        index = torch.cat([torch.arange(a, b, device=device) for a, b in self.runs])
        if documents is None:
            cos, sin = rope_cos[index], rope_sin[index]
        else:
            places = example_positions(documents)[:, index]
            cos, sin = rope_cos[places][:, None], rope_sin[places][:, None]
        runs, masks, held = [], [], 0
        for start, end in self.runs:
            first = max(0, start - window + 1) if window else 0  # no key before the window of the run's first query
            if flex:
                masks.append(_block_mask(documents, start, end, first, window, device))
            else:
                seen = causal(end - start, window, device, start - first)  # (queries, keys first..end - 1)
                if documents is not None:
                    seen = seen & (documents[:, start:end, None] == documents[:, None, first:end])
                masks.append(additive(seen[None, None] if documents is None else seen[:, None], dtype))
            runs.append((held, held + end - start, first, end))
            held += end - start
        return cos, sin, ContextMask(tuple(runs), tuple(masks), self.gather)


def _block_mask(documents: torch.Tensor | None, start: int, end: int, first: int, window: int | None, device):
    """The flex_attention BlockMask of queries start..end - 1 over keys first..end - 1 (ContextShard's masks)."""

    def visible(b, h, q, k):
        seen = q + start >= k + first
        if window:
            seen = seen & (q + start - k - first < window)
        if documents is not None:
            seen = seen & (documents[b, q + start] == documents[b, k + first])
        return seen

    rows = None if documents is None else len(documents)
    return create_block_mask(visible, rows, None, end - start, end - first, device=device)


def held_runs(rank: int, degree: int, length: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (start, end) of the two chunks of a window of `length` positions that rank `rank` of a group of `degree`
    holds: the rank-th from the start and the rank-th from the end."""
    chunk = length // (2 * degree)
    tail = 2 * degree - 1 - rank
    return (rank * chunk, (rank + 1) * chunk), (tail * chunk, (tail + 1) * chunk)


class ContextParallel:
    """This rank's place in its context-parallel group: cuts micro-batches to its share (`shard`) and gathers a
    block's keys and values from the group (`gather`)."""

    def __init__(self, group: dist.ProcessGroup, degree: int, rank: int, device: torch.device):
        self.group, self.degree, self.rank, self.device = group, degree, rank, device

    def shard(self, batch: MicroBatch) -> MicroBatch:
        """This rank's share of a micro-batch read on the host, moved to the device: its positions' tokens, targets
        and example numbers, with the whole window's example numbers in `context` for attention."""
        runs = held_runs(self.rank, self.degree, batch.inputs.shape[1])
        index = torch.cat([torch.arange(a, b) for a, b in runs])
        inputs, targets = batch.inputs[:, index], batch.targets[:, index]
        documents = None if batch.documents is None else batch.documents[:, index]
        trained = None if batch.trained is None else trained_positions(targets.numpy(), self.device)

        def moved(x: torch.Tensor | None) -> torch.Tensor | None:
            if x is None or self.device.type != "cuda":
                return x
            return x.pin_memory().to(self.device, non_blocking=True)

        context = ContextShard(runs, moved(batch.documents), self.gather, self.summed)
        fields = dict(inputs=moved(inputs), targets=moved(targets), documents=moved(documents), trained=trained)
        return batch._replace(**fields, context=context)

    def summed(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group, its gradient summed back to every rank's x (an all-reduce each way)."""
        return dist_nn.all_reduce(x, group=self.group)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(..., this rank's positions, d) -> (..., window, d): every rank's positions in the window's order. Its
        backward sums each position's gradient over the group and hands each rank its own (a reduce-scatter)."""
        parts = funcol.all_gather_single_autograd(x.movedim(-2, 0).contiguous(), 0, self.group)
        chunks = parts.unflatten(0, (self.degree, 2, -1))  # rank j: chunk j, then chunk 2N - 1 - j
        return torch.cat([chunks[:, 0], chunks[:, 1].flip(0)]).flatten(0, 1).movedim(0, -2)


def context_group(degree: int, world_size: int, device: torch.device) -> ContextParallel | None:
    """This rank's group of `degree` consecutive ranks (within a node when the node's ranks are a multiple of it), or
    None at degree 1. Every rank calls it: the groups are made collectively."""
    if degree == 1:
        return None
    mesh = init_device_mesh(device.type, (world_size // degree, degree), mesh_dim_names=("dp", "cp"))
    return ContextParallel(mesh.get_group("cp"), degree, mesh.get_local_rank("cp"), device)


def check_context_parallel(recipe: Any, kind: Any) -> None:
    """What context parallelism needs of a recipe, before any process starts: windows of 2 x degree whole chunks, and a
    training kind whose step can run on a share of each window (`kind.splits_windows`)."""
    degree, data = recipe.parallel.context_parallel, recipe.data
    if degree == 1:
        return
    if data.seq_len % (2 * degree):
        raise ValueError(
            f"parallel.context_parallel={degree} cuts each window into {2 * degree} equal chunks: data.seq_len "
            f"({data.seq_len}) must be a multiple of {2 * degree}"
        )
    if not kind.splits_windows:
        raise ValueError(
            f"parallel.context_parallel={degree}: the {kind.name} kind needs each window whole on a rank; context "
            "parallelism trains next-token runs (pretraining, SFT). Set parallel.context_parallel 1"
        )
