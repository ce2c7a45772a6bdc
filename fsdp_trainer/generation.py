"""Sampling from the model: the one home of its decoding loop, which tools/generate.py, tools/score.py, evaluation
(evaluation/passes.py) and the on-policy kinds (on-policy distillation, online RL) all use. model.py keeps the forward
with its KV cache; what is drawn, how, and when a sequence stops are here.

Every sampled row draws from a generator of its own, so its tokens do not depend on which other rows share its batch:
a seeded run samples the same on any number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdp_trainer.config import ModelConfig
from fsdp_trainer.model import KVCache, Transformer, count_params


def last_logits(hidden: torch.Tensor, output_layer: nn.Module) -> torch.Tensor:
    """A forward's objective (Transformer.forward's `loss`) that makes the logits of the last position alone (B, 1,
    vocab_size): what reading a prompt into a KV cache needs, not (B, T, vocab_size) of which all but one go."""
    return output_layer(hidden[:, -1:])


@dataclass(frozen=True)
class SamplingShape:
    """What a step of an online kind samples before it trains, for the planner: `prompts` read together (a
    micro-batch's) and `each` continuations of each, every row holding up to `positions` tokens in the KV cache, of
    which `new_tokens` are decoded a pass at a time; `batches` such batches a step, in a `share` of the steps."""

    prompts: int
    each: int
    positions: int
    new_tokens: int
    batches: int
    share: float = 1.0

    @property
    def rows(self) -> int:
        """The sequences decoded together."""
        return self.prompts * self.each


def kv_cache_bytes(cfg: ModelConfig, rows: int, positions: int, itemsize: int) -> int:
    """A KVCache's keys and values for `rows` sequences of `positions` tokens, every layer."""
    return rows * positions * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.resolved_head_dim * itemsize


def sampling_bytes(cfg: ModelConfig, shape: SamplingShape, itemsize: int) -> int:
    """What sampling holds beside the sharded training state: the model whole in the compute dtype (gathered once for
    all of a step's sampling), a batch's KV cache (its prompts' rows copied to their samples' rows, both at once for a
    moment: sample_groups), and a decode pass's fp32 logits of its rows with their softmax."""
    cache = kv_cache_bytes(cfg, shape.rows, shape.positions, itemsize)
    return count_params(cfg) * itemsize + cache + 2 * shape.rows * cfg.vocab_size * 4


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    stop_id: int | None = None,
) -> torch.Tensor:
    """Continue `prompt` (1-D token ids) by sampling; temperature 0 means greedy; stop after `stop_id`. The prompt is
    read once into a KVCache and each new token adds its own position; past max_seq_len positions (which RoPE's tables
    end at) each token re-reads the last max_seq_len tokens without one."""
    if model.cfg.num_labels is not None:
        raise ValueError("this is a reward model: it scores text (tools/score.py), it does not generate any")
    tokens, max_len = prompt.clone(), model.cfg.max_seq_len
    cache = KVCache(model.cfg, min(max_len, len(prompt) + max_new_tokens))
    new = tokens[-max_len:]
    for _ in range(max_new_tokens):
        if cache is not None and cache.length + len(new) > cache.max_len:
            cache, new = None, tokens[-max_len:]
        logits = model(new[None], cache=cache, loss=last_logits)[0, -1].float()  # (vocab_size,)
        next_id = sample(logits, temperature, top_k, generator)
        tokens = torch.cat([tokens, next_id.view(1)])
        new = next_id.view(1) if cache is not None else tokens[-max_len:]
        if stop_id is not None and next_id.item() == stop_id:
            break
    return tokens


@torch.no_grad()
def score(model: Transformer, sequences: list[torch.Tensor]) -> torch.Tensor:
    """A reward model's score of each sequence (1-D token ids, at most max_seq_len): its score head at the sequence's
    last token, as transformers' *ForSequenceClassification reads it (n,), fp32."""
    if model.cfg.num_labels is None:
        raise ValueError("this is a language model (model.num_labels null): it has no score head to score text with")
    return torch.stack([model(ids[None])[0, -1, 0].float() for ids in sequences])


def sample_batch(
    model: Transformer,
    prompts: list[torch.Tensor],
    max_new: list[int],
    temperature: float,
    stop_ids: torch.Tensor,
    generators: list[torch.Generator],
) -> list[list[int]]:
    """Continue every prompt (1-D token ids) by sampling, in one batch (sample_groups, one sample a prompt): row i
    ends after a token in `stop_ids` (kept) or `max_new[i]` tokens, and draws with its own generator, so its tokens
    do not depend on which other rows share the batch."""
    return sample_groups(model, prompts, 1, max_new, temperature, None, 1.0, stop_ids, generators)[0]


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
    top_p: float = 1.0,
):
    """A token id from `logits` (vocab_size,): draw for one row."""
    return draw(logits[None], temperature, top_k, [generator], top_p)[0]


def draw(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generators: list[torch.Generator | None],
    top_p: float = 1.0,
) -> torch.Tensor:
    """A token id for each row of `logits` (rows, vocab_size): the most likely at temperature 0, else drawn from the
    softmax of logits / temperature over the `top_k` most likely and, of those, the fewest whose probabilities reach
    `top_p`. Row i's draw is one uniform number of generators[i] (the inverse of its distribution's cumulative sum),
    so it does not depend on the other rows, and the rows are drawn in one batch."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(truncated(logits / temperature, top_k, top_p), dim=-1)
    cumulative = probs.cumsum(-1)
    uniform = torch.stack([torch.rand((), generator=g, device=logits.device) for g in generators])
    picked = torch.searchsorted(cumulative, (uniform * cumulative[:, -1])[:, None], right=True)[:, 0]
    return picked.clamp(max=logits.shape[-1] - 1)


def truncated(logits: torch.Tensor, top_k: int | None, top_p: float = 1.0) -> torch.Tensor:
    """Logits (..., vocab_size) with -inf outside the `top_k` most likely (None: all) and outside the fewest most
    likely tokens whose probabilities sum to `top_p` or more (nucleus sampling; transformers' TopPLogitsWarper: the
    most likely token always kept)."""
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(logits, dim=-1)
        dropped = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        dropped[..., -1] = False
        logits = logits.masked_fill(dropped.scatter(-1, order, dropped), float("-inf"))
    return logits


@torch.no_grad()
def sample_groups(
    model: Transformer,
    prompts: list[torch.Tensor],
    n: int,
    max_new: list[int],
    temperature: float,
    top_k: int | None,
    top_p: float,
    stop_ids: torch.Tensor,
    generators: list[torch.Generator],
) -> tuple[list[list[int]], list[list[float]]]:
    """`n` continuations of each prompt (1-D token ids), in one batch: the prompts left-padded and read once into a
    KVCache whose keys and values each prompt's n rows then share, then a pass per new token. Row i (sample i % n of
    prompt i // n) draws with generators[i] and ends after a token in `stop_ids` (kept) or max_new[i // n] tokens.
    Returns each row's tokens and their log-probabilities under the model at `temperature` (of the whole
    distribution, before top_k / top_p: what training computes of them), fp32; at temperature 0 (greedy) zeros."""
    device, longest = stop_ids.device, max(len(prompt) for prompt in prompts)
    pads = torch.tensor([longest - len(prompt) for prompt in prompts], device=device)
    step_in = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        step_in[row, longest - len(prompt) :] = prompt
    cache = KVCache(model.cfg, longest + max(max_new), pads)
    logits = model(step_in, cache=cache, loss=last_logits)[:, -1].float().repeat_interleave(n, 0)  # (rows, vocab)
    cache.repeat_rows(n)
    rows = len(prompts) * n
    new: list[list[int]] = [[] for _ in range(rows)]
    logps: list[list[float]] = [[] for _ in range(rows)]
    limits = [max_new[row // n] for row in range(rows)]
    done = [limit == 0 for limit in limits]
    while not all(done):
        drawn = draw(logits, temperature, top_k, generators, top_p)
        drawn_logps = (
            torch.zeros(rows)
            if temperature == 0
            else (logits / temperature).log_softmax(-1).gather(-1, drawn[:, None])[:, 0]
        )
        stopped = torch.isin(drawn, stop_ids).tolist()
        for row, (token, logp) in enumerate(zip(drawn.tolist(), drawn_logps.tolist(), strict=True)):
            if not done[row]:
                new[row].append(token)
                logps[row].append(logp)
                done[row] = stopped[row] or len(new[row]) == limits[row]
        if all(done):
            break
        logits = model(drawn[:, None], cache=cache)[:, -1].float()
    return new, logps
