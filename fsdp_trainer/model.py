"""The decoder-only Transformer of Llama 3, Qwen3 (dense and MoE: moe.py), Mistral and Gemma 3, in plain PyTorch.

Read top to bottom: RMSNorm -> rotary embedding -> attention -> feed-forward -> block -> model. Module and parameter
names are those of Hugging Face's LlamaForCausalLM / Qwen3ForCausalLM / ... (`model.layers.0.self_attn.q_proj.weight`,
...) and RoPE uses HF's rotate-half layout, so a checkpoint converts to HF by copying tensors, never permuting them.

Gemma 3 is Llama's block with five switches, each marked where it acts: norms that scale by 1 + weight, a norm after
each sublayer too, GELU (tanh) in the feed-forward, embeddings scaled by sqrt(dim), and attention scores scaled by
query_pre_attn_scalar; its local layers (a sliding window, a rotary base of their own) and global layers alternate.

Nothing here knows about processes or sharding: distributed/parallelize.py wraps a built model from the outside.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.overrides import TorchFunctionMode

from fsdp_trainer.config import ModelConfig, RopeScaling, local_layers
from fsdp_trainer.lean_autograd import gated, rms_norm
from fsdp_trainer.moe import MixtureOfExperts, moe_layers


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain, computed in fp32 whatever the input dtype (as HF does):
    weight * (x / RMS(x)).to(x.dtype). Gemma 3's (`offset`) scales by 1 + weight (its weights start at 0), and casts
    back after the scaling, not before. lean_autograd.rms_norm computes it, keeping only x for backward."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


def norm(cfg: ModelConfig, dim: int | None = None) -> RMSNorm:
    """The family's RMSNorm over `dim` (default: the residual stream's width)."""
    return RMSNorm(dim or cfg.dim, cfg.norm_eps, offset=cfg.family == "gemma3")


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (max_seq_len, head_dim), frequencies repeated for the two halves."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None and scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor  # every position divided by factor
    elif scaling is not None:
        inv_freq = llama3_scaled(inv_freq, scaling)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (T, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim): HF's rotate-half layout, not interleaved pairs
    return angles.cos(), angles.sin()


def llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency scaling: a rotation whose wavelength exceeds the pretraining context (in tokens) turns
    `factor` times slower, one much shorter keeps its speed, and those in between are interpolated, smoothly in
    original_max_position_embeddings / wavelength."""
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    smooth = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelength > context / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    medium = (wavelength >= context / scaling.high_freq_factor) & (wavelength <= context / scaling.low_freq_factor)
    return torch.where(medium, interpolated, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, n_heads, T, head_dim) by the angles in cos/sin: (T, head_dim), or (B, 1, T, head_dim) when each
    sequence has positions of its own (packed examples)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


Remember = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""A layer's KV cache: keys and values (B, kv_heads, T, head_dim) of new positions in, those of every position out."""


class TiledMask(NamedTuple):
    """Packed examples' boolean mask (B, 1, T, T) and each row's query tiles, (first query, end, first key) each: the
    queries first..end-1 see no key before `first key` (the start of the earliest example they are in) nor after
    end - 1, so attention runs tile by tile on those keys alone. A window of short examples then costs about
    T x (tile + an example) scores instead of T x T (8x less time at 1,920 tokens of 60-200 token examples on a CPU).
    Tiles are a row's own, so a window's numbers do not depend on the windows beside it (2 ranks equal 1 process with
    accumulation, a cached reference equals the frozen copy, bitwise as with the whole mask)."""

    mask: torch.Tensor
    tiles: tuple[tuple[tuple[int, int, int], ...], ...]


ATTENTION_TILE = 128
"""Queries a tile of a TiledMask: small enough that a tile's keys are few, large enough that a call's cost is its
math (64-256 measured alike at 1,920 tokens)."""


class ContextMask(NamedTuple):
    """Attention under context parallelism (a rank holds runs of each window's positions): `gather` makes every
    rank's keys and values of this rank's, and each run's queries (this rank's `first`..`end` - 1) attend to the
    gathered `key_start`..`key_end` - 1 under their mask, additive (1 or B, 1, queries, keys) or a BlockMask."""

    runs: tuple[tuple[int, int, int, int], ...]
    masks: tuple[torch.Tensor | BlockMask, ...]
    gather: Callable[[torch.Tensor], torch.Tensor]


class Context(Protocol):
    """This rank's share of each window under context parallelism (distributed/context_parallel.py's ContextShard)."""

    def attention_inputs(
        self, rope_cos, rope_sin, window: int | None, flex: bool, dtype
    ) -> tuple[Any, Any, ContextMask]:
        """(cos, sin, ContextMask) of this rank's positions, from the rotary tables and the layer's `window`."""


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads; Qwen3 and Gemma 3 add an RMSNorm on each query and key head.
    Given a `mask`, a query attends only to the keys it marks (packed examples: block-causal; a sliding window): a
    (B, 1, T, T) through scaled_dot_product_attention, additive (see additive) or boolean, or a flex_attention
    BlockMask, which skips the blocks the mask empties, or a TiledMask, computed tile by tile. Given `remember` (a
    KVCache's layer, when generating), the queries attend to the keys and values it returns: the earlier positions'
    followed by these."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.resolved_head_dim
        # Gemma 3 scales the scores by query_pre_attn_scalar; None is SDPA's own 1 / sqrt(head_dim).
        self.scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = norm(cfg, self.head_dim), norm(cfg, self.head_dim)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        remember: Remember | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3 and Gemma 3 normalise each head before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if remember is not None:
            k, v = remember(k, v)
        # enable_gqa lets each key/value head serve n_heads // n_kv_heads query heads without copying it.
        gqa = self.n_kv_heads != self.n_heads
        if isinstance(mask, ContextMask):  # this rank's share of the queries, every rank's keys (one gather)
            k, v = mask.gather(torch.stack([k, v])).unbind(0)
            parts = []
            for (a, b, c, e), m in zip(mask.runs, mask.masks, strict=True):
                qr, kr, vr = q[:, :, a:b], k[:, :, c:e], v[:, :, c:e]
                if isinstance(m, BlockMask):
                    parts.append(flex_attention(qr, kr, vr, block_mask=m, scale=self.scale, enable_gqa=gqa))
                else:
                    parts.append(F.scaled_dot_product_attention(qr, kr, vr, m, scale=self.scale, enable_gqa=gqa))
            y = torch.cat(parts, dim=2)
        elif isinstance(mask, BlockMask):
            y = flex_attention(q, k, v, block_mask=mask, scale=self.scale, enable_gqa=gqa)
        elif isinstance(mask, TiledMask) and not torch.compiler.is_compiling():  # compiled, its ints would recompile
            rows = []
            for r, tiles in enumerate(mask.tiles):
                qr, kr, vr, mr = q[r : r + 1], k[r : r + 1], v[r : r + 1], mask.mask[r : r + 1]
                parts = [
                    F.scaled_dot_product_attention(
                        qr[:, :, a:b], kr[:, :, c:b], vr[:, :, c:b], mr[..., a:b, c:b], scale=self.scale, enable_gqa=gqa
                    )
                    for a, b, c in tiles
                ]
                rows.append(torch.cat(parts, dim=2))
            y = torch.cat(rows)
        else:
            mask = mask.mask if isinstance(mask, TiledMask) else mask
            causal = mask is None
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=gqa
            )
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.o_proj(y)


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); Gemma 3's GeGLU has GELU (tanh approximation) in place of silu.
    lean_autograd.gated computes the product, keeping gate(x) and up(x) alone for backward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tanh_gelu = cfg.family == "gemma3"
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.gate_proj(x), self.up_proj(x), self.tanh_gelu))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). The unit FSDP shards and AC recomputes.
    Gemma 3 normalizes each sublayer's output too: x + norm(attn(norm(x))), then x + norm(mlp(norm(x))), where HF's
    post_attention_layernorm is the attention output's norm and two more surround the feed-forward."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = norm(cfg)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = norm(cfg)
        self.mlp = MixtureOfExperts(cfg) if layer in moe_layers(cfg) else FeedForward(cfg)  # Qwen3-MoE: moe.py
        self.sandwich = cfg.family == "gemma3"
        if self.sandwich:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(cfg), norm(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        remember: Remember | None = None,
    ) -> torch.Tensor:
        if self.sandwich:  # Gemma 3
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask, remember))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, remember)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Embedding, blocks and final norm: HF's `model.` prefix."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed by layer index keeps FQNs (`model.layers.3.`) stable when blocks get wrapped.
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = norm(cfg)


def block_causal(
    documents: torch.Tensor, flex: bool = False, window: int | None = None, shared: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | BlockMask | TiledMask]:
    """For windows packed with several examples: `documents` (B, T) numbers the example of each position (equal for
    the consecutive positions of one example). Returns each position's place in its own example (B, T), which the
    rotary angles use, and the attention mask: a position sees the earlier positions of its own example and nothing
    else, so each example gets the logits it would get alone; with a sliding `window` (Mistral), only the last
    `window` of them, itself included. A boolean (B, 1, T, T), or with `flex` the same as a flex_attention BlockMask
    (blocks of 128 x 128 positions, those it empties skipped); on a CPU, a TiledMask.
    With `shared` (B, T), the example each position continues (its own, or an earlier one: several continuations of
    one prompt packed as a tree, the prompt once): a position also sees that example whole, and its place counts on
    from that example's end, so each continuation gets the logits it would get after its own copy of the prompt."""
    B, T = documents.shape
    index = torch.arange(T, device=documents.device)
    positions = example_positions(documents)
    tree = shared is not None
    if tree:  # a continuation's place after its prompt's length; a window measured in places, not in the row's order
        # A row's examples are numbered from 0 up to T + 1 at most (a tree's packing: steps/examples.py).
        lengths = torch.zeros(B, T + 2, dtype=positions.dtype, device=documents.device)
        lengths.scatter_add_(1, documents, torch.ones_like(positions))
        positions = positions + torch.where(shared != documents, lengths.gather(1, shared), 0)
    if flex:

        def same_example_causal(b, h, q, k):
            visible = documents[b, q] == documents[b, k]
            if tree:
                visible = visible | (shared[b, q] == documents[b, k])
            visible = visible & (q >= k)
            if window:
                return visible & ((positions[b, q] - positions[b, k] if tree else q - k) < window)
            return visible

        return positions, create_block_mask(same_example_causal, B, None, T, T, device=documents.device)
    sees = documents[:, :, None] == documents[:, None, :]
    if not tree:
        mask = (sees & causal(T, window, documents.device))[:, None]
    else:
        mask = (sees | (shared[:, :, None] == documents[:, None, :])) & causal(T, None, documents.device)
        if window:
            mask &= positions[:, :, None] - positions[:, None, :] < window
        mask = mask[:, None]
    if documents.device.type != "cpu" or is_fake(documents) or T <= ATTENTION_TILE:
        return positions, mask  # a GPU's boundaries would cost a sync to read (it runs flex_attention compiled)
    firsts = index - positions  # each position's example's start
    if tree:  # a continuation's: its prompt's
        starts = torch.full((B, T + 2), T, dtype=index.dtype, device=documents.device)
        firsts = starts.scatter_reduce_(1, documents, index.expand(B, T), "amin").gather(1, shared)
    tiles = []
    for row_firsts in firsts.tolist():
        row = []
        for a in range(0, T, ATTENTION_TILE):
            first = max(row_firsts[a], a - window + 1) if window and not tree else row_firsts[a]
            row.append((a, min(a + ATTENTION_TILE, T), first))
        tiles.append(tuple(row))
    return positions, TiledMask(mask, tuple(tiles))


def example_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each position's place in its own example (B, T), for packed `documents` (see block_causal)."""
    index = torch.arange(documents.shape[1], device=documents.device)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def causal(T: int, window: int | None, device: torch.device, start: int = 0) -> torch.Tensor:
    """(T, start + T): query i, at position start + i, sees key j <= start + i, and with a sliding `window` only
    j > start + i - window (transformers' sliding window: the window counts the query itself)."""
    visible = torch.ones(T, start + T, dtype=torch.bool, device=device).tril_(start)  # key - query <= start
    return visible.triu_(start - window + 1) if window else visible  # made in place: no T x T of int64 distances


def sliding_causal(T: int, window: int, device: torch.device, flex: bool) -> torch.Tensor | BlockMask:
    """The mask of one unpacked sequence whose `window` is shorter than it, boolean (1, 1, T, T) or a BlockMask."""
    if flex:
        return create_block_mask(lambda b, h, q, k: (q >= k) & (q - k < window), None, None, T, T, device=device)
    return causal(T, window, device)[None, None]


class KVCache:
    """The keys and values of the positions a generation has read, per layer, so each new token attends to them
    without computing them again: (B, kv_heads, max_len, head_dim) each, in the dtype attention computes in, the first
    `length` positions filled. Prompts of different lengths read in one batch are left-padded: `pads` (B,) says by how
    many positions each row is, and attention_inputs hides them."""

    def __init__(self, cfg: ModelConfig, max_len: int, pads: torch.Tensor | None = None):
        self.max_len, self.length, self.pads = max_len, 0, pads
        self.keys: list[torch.Tensor | None] = [None] * cfg.n_layers
        self.values: list[torch.Tensor | None] = [None] * cfg.n_layers

    def layer(self, i: int) -> Remember:
        """Layer i's cache: stores the new positions' keys and values after the earlier ones, returns them all."""

        def remember(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if self.keys[i] is None:
                B, heads, _, head_dim = k.shape
                self.keys[i] = k.new_zeros(B, heads, self.max_len, head_dim)
                self.values[i] = v.new_zeros(B, heads, self.max_len, head_dim)
            end = self.length + k.shape[2]
            self.keys[i][:, :, self.length : end] = k
            self.values[i][:, :, self.length : end] = v
            return self.keys[i][:, :, :end], self.values[i][:, :, :end]

        return remember

    def repeat_rows(self, n: int) -> None:
        """Each row n times over, in place (rows r * n ... r * n + n - 1 are row r's): a prompt read once, shared by
        the n samples drawn from it."""
        self.keys = [None if k is None else k.repeat_interleave(n, 0) for k in self.keys]
        self.values = [None if v is None else v.repeat_interleave(n, 0) for v in self.values]
        self.pads = None if self.pads is None else self.pads.repeat_interleave(n)


class Transformer(nn.Module):
    """Llama 3 / Qwen3 / Mistral / Gemma 3 causal language model: token ids (B, T) -> logits (B, T, vocab_size). With
    cfg.num_labels, a reward model (HF's *ForSequenceClassification): the same decoder with a score head (`score`) in
    place of the output layer, (B, T, num_labels), of which a sequence's last position is its score."""

    def __init__(self, cfg: ModelConfig, flex_attention: bool = False):
        super().__init__()
        self.cfg, self.model = cfg, Decoder(cfg)
        if cfg.num_labels is None:
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            if cfg.tie_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.score = nn.Linear(cfg.dim, cfg.num_labels, bias=False)
        self.flex_attention = flex_attention
        """Masks (packed examples, windows) through flex_attention: fast only compiled (GPUs, blocks compiled)."""
        self.local_layers = local_layers(cfg)
        # Derived from the config, so not part of the state dict; init_weights() recomputes them after a meta build.
        for name, buffer in derived_buffers(cfg).items():
            self.register_buffer(name, buffer, persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        documents: torch.Tensor | None = None,
        loss: Callable[[torch.Tensor, nn.Module], torch.Tensor] | None = None,
        cache: KVCache | None = None,
        shared: torch.Tensor | None = None,
        context: Context | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, vocab_size); or, given a `loss` (an objective of loss.py), what it computes from the final
        hidden states (B, T, dim) and the output layer, which spares the full logits when it slices them.
        With `documents` (B, T), windows packed with several examples attend block-causally, each example from
        position 0, and with `shared` (B, T) several continuations of one prompt after a single copy of it (see
        block_causal). With a `cache`, `tokens` continue the positions it holds, and it keeps theirs; with a
        `context`, they are this rank's share of each window (context parallelism)."""
        x = self.model.embed_tokens(tokens)  # (B, T, dim)
        if self.cfg.family == "gemma3":  # scaled by sqrt(dim), the scale rounded to the embeddings' dtype (as HF)
            x = x * self.embed_scale.to(x.dtype)
        kinds = {i in self.local_layers for i in range(self.cfg.n_layers)}  # local (a sliding window), global, or both
        inputs = {k: attention_inputs(self, tokens, documents, cache, k, x.dtype, shared, context) for k in kinds}
        for i, block in enumerate(self.model.layers.values()):
            x = block(x, *inputs[i in self.local_layers], None if cache is None else cache.layer(i))
        if cache is not None:
            cache.length += tokens.shape[1]
        x = self.model.norm(x)
        if loss is None:
            return self.output_layer(x)  # (B, T, vocab_size), or a reward model's (B, T, num_labels)
        return loss(x, self.output_layer)

    @property
    def output_layer(self) -> nn.Module:
        """What the final hidden states go through: the output layer (lm_head), or a reward model's score head."""
        return self.lm_head if self.cfg.num_labels is None else self.score

    @torch.no_grad()
    def init_weights(
        self,
        seed: int = 0,
        fill: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Initialise every parameter and buffer in place; calling it twice gives the same model: every RMSNorm weight
        1, every other weight from initial_values (its own generator, so the same however the model is sharded), the
        rotary tables recomputed from the config. `fill(param, full_values)` writes a full-shape tensor into a
        parameter; parallelize.py passes one that keeps only this rank's shard. The default copies. The values are
        drawn on `device` (default: each parameter's own), since the same generator gives other numbers on a GPU than
        on a CPU."""
        fill = fill or (lambda param, values: param.copy_(values))
        cfg = self.cfg
        for name, param in self.named_parameters():
            # Wrappers (activation checkpointing, compile) insert `_`-prefixed path parts; drop them for the HF name.
            name = unwrapped_name(name)
            if name.endswith("norm.weight"):  # the gain 1: Gemma 3's norms scale by 1 + weight
                gain = torch.zeros if cfg.family == "gemma3" else torch.ones
                fill(param, gain(param.shape, dtype=param.dtype, device=param.device))
                continue
            fill(param, initial_values(cfg, name, param.shape, seed, device or param.device).to(param.dtype))
        for name, buffer in derived_buffers(cfg, self.rope_cos.device).items():
            getattr(self, name).copy_(buffer)


def derived_buffers(cfg: ModelConfig, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors that follow from its config, by buffer name: the rotary tables (rope_cos, rope_sin), and
    Gemma 3's local layers' own (rope_local_cos, rope_local_sin: their base, no scaling) and its embedding scale."""
    head_dim, length = cfg.resolved_head_dim, cfg.max_seq_len
    cos, sin = rope_tables(head_dim, length, cfg.rope_theta, cfg.rope_scaling, device)
    buffers = {"rope_cos": cos, "rope_sin": sin}
    if cfg.family == "gemma3":
        local = rope_tables(head_dim, length, cfg.rope_local_theta or cfg.rope_theta, None, device)
        buffers.update(rope_local_cos=local[0], rope_local_sin=local[1])
        buffers["embed_scale"] = torch.tensor(cfg.dim**0.5, device=device)
    return buffers


def attention_inputs(
    model: Transformer,
    tokens: torch.Tensor,
    documents: torch.Tensor | None,
    cache: KVCache | None,
    local: bool,
    dtype: torch.dtype,
    shared: torch.Tensor | None = None,
    context: Context | None = None,
):
    """(cos, sin, mask) for the global or the `local` blocks of `model`: each position's rotary angles and what it
    attends to (see Transformer.forward); a mask of every position, as the additive one (see additive) attention in
    `dtype` reads."""
    T, window = tokens.shape[1], model.cfg.sliding_window if local else None
    prefix = "rope_local" if local and model.cfg.family == "gemma3" else "rope"  # Gemma 3's local layers: their own
    rope_cos, rope_sin = getattr(model, f"{prefix}_cos"), getattr(model, f"{prefix}_sin")
    if context is not None:
        return context.attention_inputs(rope_cos, rope_sin, window, model.flex_attention, dtype)
    if cache is not None:
        start = cache.length
        mask = causal(T, window, tokens.device, start)[None, None]  # is_causal would align the queries left
        if cache.pads is None:
            return rope_cos[start : start + T], rope_sin[start : start + T], mask
        # Left-padded rows: a row's positions count from its first real token, and no query sees the padding but a
        # padding query sees itself (a query that sees nothing gets NaN from softmax, and its output is never read).
        # A row that has ended runs on beside the others, past the table's end for all it matters.
        queries = torch.arange(start, start + T, device=tokens.device)
        positions = (queries - cache.pads[:, None]).clamp(0, len(rope_cos) - 1)  # (B, T)
        keys = torch.arange(start + T, device=tokens.device)
        real = (keys >= cache.pads[:, None, None]) | (keys == queries[:, None])  # (B, T, start + T)
        return rope_cos[positions][:, None], rope_sin[positions][:, None], mask & real[:, None]
    if documents is None:
        mask = None  # plain causal attention, unless a sliding window is shorter than the sequence
        if window and window < T:
            mask = additive(sliding_causal(T, window, tokens.device, model.flex_attention), dtype)
        return rope_cos[:T], rope_sin[:T], mask
    positions, mask = block_causal(documents, model.flex_attention, window, shared)
    return rope_cos[positions][:, None], rope_sin[positions][:, None], additive(mask, dtype)  # (B, 1, T, head_dim)


def additive(mask: torch.Tensor | BlockMask | TiledMask, dtype: torch.dtype) -> torch.Tensor | BlockMask | TiledMask:
    """A boolean mask of every query and key (B, 1, T, T) as the scores' addend in `dtype`, 0 where it sees and -inf
    where it does not: what scaled_dot_product_attention makes of a boolean mask on each call, which every layer's
    backward would keep a copy of (T x T x layers); made once, the layers share it. Other masks as they are."""
    if not isinstance(mask, torch.Tensor):
        return mask
    sees, hidden = (torch.tensor(v, dtype=dtype, device=mask.device) for v in (0.0, float("-inf")))
    return torch.where(mask, sees, hidden)


def initial_values(cfg: ModelConfig, name: str, shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    """A weight's initial values (fp32), drawn on `device` from a generator seeded by (seed, its HF name), so the
    model is the same however it is sharded: truncated normal(0, init_std) at +-3 std (the embedding, the q/k/v, gate
    and up projections, lm_head or score), the projections that write into the residual (o_proj, down_proj) scaled by
    1 / sqrt(2 * n_layers)."""
    std = cfg.init_std
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        std = std / math.sqrt(2 * cfg.n_layers)
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.empty(shape, dtype=torch.float32, device=device)
    return nn.init.trunc_normal_(values, std=std, a=-3 * std, b=3 * std, generator=gen)


def unwrapped_name(name: str) -> str:
    """A parameter's name without the `_`-prefixed path parts that wrappers (activation checkpointing, compile)
    insert: its HF name."""
    return ".".join(part for part in name.split(".") if not part.startswith("_"))


class on_meta(TorchFunctionMode):
    """Modules built in it are on the meta device (shapes only), their initial draws skipped: a meta tensor has no
    values, and whatever is built on meta gets them once its shards exist (init_weights, a checkpoint). torch draws a
    Linear's kaiming values on meta through Python decompositions: three quarters of the time an 80-block model took
    to build (0.20 s; 0.044 s without), and the planner builds one for each of its rows' models."""

    def __enter__(self):
        self.device = torch.device("meta")
        self.device.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self.device.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DRAWS:  # nn.init's, which pass the tensor by name
            tensor = args[0] if args else kwargs["tensor"]
            if tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


_DRAWS = {nn.init.kaiming_uniform_, nn.init.uniform_, nn.init.normal_, nn.init.trunc_normal_}


def count_params(cfg: ModelConfig, one_block: bool = False) -> int:
    """Parameters of the model (tied weights counted once), or of one of its blocks, from the config alone."""
    key = (repr(cfg), one_block)
    if key not in _COUNTED:
        with on_meta():
            module = Block(cfg) if one_block else Transformer(cfg)
        _COUNTED[key] = sum(p.numel() for p in module.parameters())
    return _COUNTED[key]


# Counts by the config's repr (every field): a model is built on meta to be counted, 0.1 s at 80 blocks, and the planner
# counts the same few models for each of its hundreds of rows.
_COUNTED: dict[tuple[str, bool], int] = {}
