"""Peak host memory of one eager forward and backward of a model with sliding-window layers on a CPU: what every
windowed layer's attention keeps of its mask for backward (model.additive), measured as the process's peak RSS over
the built model. Run it at two commits to compare; the loss is printed so the two are seen to compute the same thing.

    python benchmarks/bench_window_mask.py [--seq_len 4096] [--layers 12] [--window 128]
"""

from __future__ import annotations

import argparse
import gc
import resource

import torch

from fsdp_trainer.config import ModelConfig
from fsdp_trainer.loss import NextTokenLoss
from fsdp_trainer.model import Transformer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq_len", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--window", type=int, default=128)
    args = parser.parse_args(argv)
    # Gemma 3's pattern (five local layers to one global) at a small width, fp32: the masks, not the weights, show.
    cfg = ModelConfig(family="gemma3", dim=256, n_layers=args.layers, n_heads=4, n_kv_heads=1, head_dim=64,
                      ffn_dim=1024, vocab_size=4096, max_seq_len=args.seq_len, sliding_window=args.window,
                      sliding_window_pattern=6)  # fmt: skip
    model = Transformer(cfg)
    model.init_weights(seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loss = model(tokens, loss=NextTokenLoss(tokens, 4))
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    local = len(model.local_layers)
    print(f"{args.layers} layers ({local} windowed), {args.seq_len} tokens, window {args.window}: "
          f"peak RSS {(peak - before) / 1024:.0f} MB over the model, loss {loss.item():.6f}")  # fmt: skip


if __name__ == "__main__":
    main()
