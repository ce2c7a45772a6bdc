"""Sampling from the model: the one home of its decoding loop, which tools/generate.py, tools/score.py, evaluation
(evaluation/passes.py) and the on-policy kinds (on-policy distillation, online RL) all use. model.py keeps the forward
with its KV cache; what is drawn, how, and when a sequence stops are here.

Every sampled row draws from a generator of its own, so its tokens do not depend on which other rows share its batch:
a seeded run samples the same on any number of ranks.
"""

from __future__ import annotations

import torch

from fsdp_trainer.model import KVCache, Transformer


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
        logits = model(new[None], cache=cache)[0, -1].float()  # (vocab_size,)
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
    """A token id from `logits` (vocab_size,): the most likely at temperature 0, else drawn from the softmax of
    logits / temperature over the `top_k` most likely and, of those, the fewest whose probabilities reach `top_p`."""
    if temperature == 0:
        return logits.argmax()
    logits = truncated(logits / temperature, top_k, top_p)
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[0]


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
    logits = model(step_in, cache=cache)[:, -1].float().repeat_interleave(n, 0)  # (rows, vocab_size)
    cache.repeat_rows(n)
    rows = len(prompts) * n
    new: list[list[int]] = [[] for _ in range(rows)]
    logps: list[list[float]] = [[] for _ in range(rows)]
    limits = [max_new[row // n] for row in range(rows)]
    done = [limit == 0 for limit in limits]
    while not all(done):
        drawn = torch.stack(
            [sample(row, temperature, top_k, gen, top_p) for row, gen in zip(logits, generators, strict=True)]
        )
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
