"""Block-causal attention for packed examples: what it costs against plain causal attention.

    python benchmarks/bench_block_causal.py --recipe recipes/debug.yaml --example_tokens 128 --repeats 5 \
        --data.seq_len 1024 --model.max_seq_len 1024 --data.micro_batch_size 4

One process, the recipe's model in its compute dtype: forward + backward of the loss on random windows, with
`documents` (windows cut into examples of about `example_tokens` tokens: block-causal attention, which a CPU computes
in query tiles (model.TiledMask), per-example positions) and without (is_causal), alternating which goes first,
`repeats` rounds of `steps` steps each after a warm-up. Also the attention alone (scaled_dot_product_attention of one
layer's shapes with the whole boolean mask, forward + backward), and its forward alone with
the block-causal mask as a compiled flex_attention BlockMask (what compiled GPU runs use; torch 2.13 has no
flex_attention backward on CPUs). Reports the median time of each and their ratio, as a markdown table.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from fsdp_trainer.config import compute_dtype, parse_args, recipe_parser
from fsdp_trainer.distributed.runtime import precision_on
from fsdp_trainer.loss import NextTokenLoss
from fsdp_trainer.model import TiledMask, Transformer, block_causal


def documents_of(batch: int, seq_len: int, example_tokens: int, generator: torch.Generator) -> torch.Tensor:
    """Example ids of windows cut into examples of uniform random length in [1, 2 * example_tokens]."""
    lengths = torch.randint(1, 2 * example_tokens + 1, (batch, seq_len), generator=generator)
    starts = torch.zeros(batch, seq_len, dtype=torch.bool)
    for row in range(batch):
        at = 0
        for length in lengths[row].tolist():
            if at >= seq_len:
                break
            starts[row, at] = True
            at += length
    return starts.cumsum(1)


def timed(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> None:
    parser = recipe_parser("benchmarks/bench_block_causal.py", __doc__.split("\n\n")[0])
    parser.add_argument("--example_tokens", type=int, default=128, help="mean tokens of a packed example")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    recipe, args = parse_args(parser, argv)
    cfg, data = recipe.model, recipe.data
    recipe.parallel.mixed_precision, _ = precision_on(recipe.parallel.mixed_precision, "cpu")  # it runs on the CPU
    dtype = compute_dtype(recipe.parallel.mixed_precision)
    torch.manual_seed(0)
    model = Transformer(cfg).to(dtype)
    model.init_weights(seed=0)
    g = torch.Generator().manual_seed(0)
    B, T = data.micro_batch_size, data.seq_len
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    documents = documents_of(B, T, args.example_tokens, g)

    def step(docs):
        model.zero_grad(set_to_none=True)
        model(tokens, docs, loss=NextTokenLoss(targets, recipe.train.loss_chunks)).backward()

    head_dim = cfg.resolved_head_dim
    q = torch.randn(B, cfg.n_heads, T, head_dim, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, cfg.n_kv_heads, T, head_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    _, mask = block_causal(documents)
    mask = mask.mask if isinstance(mask, TiledMask) else mask  # the attention rows: the whole boolean mask
    _, block_mask = block_causal(documents, flex=True)
    gqa = cfg.n_kv_heads != cfg.n_heads
    compiled_flex = torch.compile(flex_attention)

    def attention(with_mask):
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask if with_mask else None, is_causal=not with_mask, enable_gqa=gqa
        )
        out.sum().backward()

    q0, k0, v0 = q.detach(), k.detach(), v.detach()  # flex_attention refuses inputs that want a CPU backward

    @torch.no_grad()
    def attention_forward(kind):
        if kind == "flex":
            return compiled_flex(q0, k0, v0, block_mask=block_mask, enable_gqa=gqa)
        return F.scaled_dot_product_attention(
            q0, k0, v0, attn_mask=mask if kind == "mask" else None, is_causal=kind == "causal", enable_gqa=gqa
        )

    cases = {
        "model, causal": lambda: step(None),
        "model, block-causal": lambda: step(documents),
        "attention, causal": lambda: attention(False),
        "attention, block-causal": lambda: attention(True),
        "forward, causal": lambda: attention_forward("causal"),
        "forward, block-causal": lambda: attention_forward("mask"),
        "forward, flex": lambda: attention_forward("flex"),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()  # warm-up
    for repeat in range(args.repeats):
        for name in list(cases) if repeat % 2 == 0 else list(cases)[::-1]:
            times[name].append(timed(cases[name], args.steps))
    n_examples = int(documents[:, -1].sum()) + B
    print(
        f"{B} x {T} tokens, {n_examples} examples (mean {B * T / n_examples:.0f} tokens), {cfg.n_layers} layers, "
        f"dim {cfg.dim}, {recipe.parallel.mixed_precision}, {torch.get_num_threads()} threads"
    )
    print("| what | causal, ms | block-causal, ms | ratio (median of rounds) |")
    print("|---|---|---|---|")
    rows = {
        "model forward + backward": ("model, causal", "model, block-causal"),
        "attention forward + backward": ("attention, causal", "attention, block-causal"),
        "attention forward": ("forward, causal", "forward, block-causal"),
        "attention forward, flex_attention (compiled)": ("forward, causal", "forward, flex"),
    }
    for what, (plain_case, masked_case) in rows.items():
        plain, masked = times[plain_case], times[masked_case]
        ratio = statistics.median(m / p for m, p in zip(masked, plain, strict=True))
        print(
            f"| {what} | {statistics.median(plain) * 1e3:.1f} | {statistics.median(masked) * 1e3:.1f} | {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
