"""Published training throughput on GPUs, the rows the planner's step-time model (planner/speed.py) is calibrated and
checked on: each a run someone else measured, its model, batch, sharding, GPUs and tokens/s per GPU, with its source.

    python benchmarks/fit_speed.py            # the model's error on every row; --fit refits its constants

Sources (read 2026-11-27):
- llm-foundry: mosaicml/llm-foundry, scripts/train/benchmarking/README.md, tables "H100 80GB BF16" and "A100 80GB with
  1600 Gbps node-node interconnect (RoCE)": MPT models (GELU MLP 4d wide, no GQA, learned positions, vocabulary 50,368,
  Triton flash attention), FSDP FULL_SHARD (PyTorch FSDP1), amp_bf16, "Activation Checkpointing" True = full, eager.
  The model sizes' widths and depths are the repository's yamls (mpt-*.yaml); their parameter counts match the table's.
- llm-foundry's micro-batch sweep: the same repository's scripts/train/benchmarking/larger_mb_1.md (commit beb8dee6),
  the same stack as its README's tables (amp_bf16, MP mode DEFAULT, FULL_SHARD, eager), MPT-7B and MPT-13B at 2,048
  tokens on 8 A100 80GB with micro-batches of 1 to 6 and MPT-3B with one on 8 A100 40GB (HBM2 at 1,555 GB/s, the
  40GB SXM datasheet's); its rows with activations offloaded to the host are left out. None of its rows is in the
  README's tables, so none fixed a constant: they check how the model prices a micro-batch's size.
- llm-foundry's README table "A100 40GB with 1600 Gbps node-node interconnect (RoCE)": 78 runs in pure bf16 (MP mode
  PURE), a stack our config cannot state, so not among RUNS; `fit_speed.py --pure_bf16` adds them for a look.
- torchtitan: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Llama 3.1 8B, FSDP2, selective AC,
  local batch 2 x 8192; H100s with 96 GB HBM2e at 2.4 TB/s and 500 W, a peak "between SXM and NVL": priced at the
  SXM's peak with their bandwidth) and docs/performance.md (Llama 3 8B / 70B and Llama 2 13B / 70B on 64 A100 80GB,
  FSDP2). Their selective AC is the op policy, which recomputes every other matmul (OP_SAC).
- torchtune: pytorch/torchtune README, "Optimization flags": Llama 3.2 3B on one A100, batch 2 x 4096, packed, bf16:
  the packed row, + compile, + activation checkpointing (full), and LoRA and QLoRA of rank 64 on q, v, o and the MLP
  (its 3B_lora_single_device recipe) with all of them (the rows with chunked cross-entropy, fused optimizer steps,
  activation offloading or 8-bit AdamW are left out: the model does not price them).
- OLMo-core: allenai/OLMo-core README, its newest throughput table ("measured on a cluster with NVIDIA H100 GPUs",
  tokens/s per device, 4,096 context, BF16, compiled, no AC): the 1B (55,000), the 7B (10,000), the 13B (4,600) and a
  Llama 3 8B on its own tokenizer (9,500), with the micro-batch and global batch of their scripts
  (src/scripts/train/OLMo-1B.py, OLMo2-7B.py, OLMo2-13B.py, Llama3-8B.py: 4, 2, 1 and 2 sequences a micro-batch;
  1,024, 1,024, 2,048 and 1,024 a step) on one node of 8 GPUs (the node count is not published). The 1B is OLMo-core's
  `olmo_1B` (its `llama2_1B` shape: 18 layers, SwiGLU 5,632 wide), not the released OLMo-2 1B's 16 x 8,192: the
  README's first table gives it 45-46K tokens/s at "39-40%" MFU, which that shape gives by OLMo-core's own FLOP
  count and the 16-layer one does not (42.7%). Its figure moved between versions of the README (45-46K, then 44,000,
  then 55,000 in the two newest), the 7B's and 13B's by 3% (9.7-10K and 4.4-4.6K first): the newest is taken. The
  32B row is left out: its script (AC, micro-batch) changed too often to pin to the table's date.
- A mixture of experts: torchtitan's Qwen3-30B-A3B on one node of 8 B200s as a user reported it in mlc-ai/pith-train
  issue 79 (2026-07-22), beside that project's own numbers: FSDP over the 8 GPUs, no expert parallelism, BF16, 8 x
  8,192 tokens a rank a step, selective (op) AC, blocks and loss compiled, eight loss chunks; three stable steps at
  19.41K, 19.53K and 19.52K tokens/s per GPU (their mean taken). One user's run, not a maintainer's table: the only
  published FSDP-only run of a mixture of experts found whose shape our config can state (DeepSeek-V3's MLA it cannot).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_trainer.config.sections import MoEConfig

# MPT sizes (d_model, n_layers, n_heads) from llm-foundry's scripts/train/yamls/pretrain/mpt-*.yaml.
MPT = {
    "125m": (768, 12, 12),
    "350m": (1024, 24, 16),
    "760m": (1536, 24, 12),
    "1b": (2048, 24, 16),
    "3b": (2560, 32, 20),
    "7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "30b": (7168, 48, 64),
    "70b": (8192, 80, 64),
}
MPT_VOCAB = 50368

# Llama and OLMo shapes: (dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size).
LLAMA = {
    "llama3_8b": (4096, 32, 32, 8, 14336, 128256),
    "llama3_70b": (8192, 80, 64, 8, 28672, 128256),
    "llama2_13b": (5120, 40, 40, 40, 13824, 32000),
    "llama2_70b": (8192, 80, 64, 8, 28672, 32000),
    "llama3_2_3b": (3072, 28, 24, 8, 8192, 128256),
    "olmo_1b": (2048, 18, 16, 16, 5632, 100352),
    "olmo2_7b": (4096, 32, 32, 32, 11008, 100352),
    "olmo2_13b": (5120, 40, 40, 40, 13824, 100352),
    "llama3_8b_dolma2": (4096, 32, 32, 8, 14336, 100352),  # OLMo-core's Llama 3 8B on its 100,352-token vocabulary
}


TIED = {"llama3_2_3b"}  # the output layer is the embedding

# Mixtures of experts: their model section, from the HF config (Qwen/Qwen3-30B-A3B's config.json).
MOE = {
    "qwen3_30b_a3b": dict(family="qwen3_moe", dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                          ffn_dim=6144, vocab_size=151936, moe=MoEConfig(experts=128, top_k=8, ffn_dim=768)),
}  # fmt: skip


@dataclass(frozen=True)
class Run:
    source: str
    gpu: str
    model: str
    seq_len: int
    gpus: int
    micro_batch: int
    grad_accum: int
    ac: str  # none | selective | full
    tokens_per_s_per_gpu: float
    compile: bool = False
    lora_rank: int | None = None  # adapters on q, v, o and the MLP (torchtune's recipes)
    nf4: bool = False  # QLoRA: the adapted projections in NF4
    recomputed: float | None = None
    """The share of a block's forward matmuls backward recomputes, where the run's AC is not ours (None: ours)."""
    hbm_gb_s: float | None = None  # the GPU's memory bandwidth, where it is not the datasheet's (a variant)
    memory_gb: float | None = None  # the GPU's memory, where it is not the datasheet's (a variant)

    @property
    def name(self) -> str:
        shape = f"{self.gpu} x{self.gpus}, {self.micro_batch} x {self.seq_len}, AC {self.ac}"
        kind = "" if self.lora_rank is None else f", {'QLoRA' if self.nf4 else 'LoRA'} rank {self.lora_rank}"
        return f"{self.source} {self.model} {shape}{', compiled' if self.compile else ''}{kind}"


def _foundry(
    gpu: str, rows: str, source: str = "llm-foundry", hbm_gb_s: float | None = None, memory_gb: float | None = None
) -> list[Run]:
    """Rows as the table prints them: model, seq len, GPUs, micro-batch, accumulation, AC (T/F), tokens/s/GPU."""
    runs = []
    for line in rows.strip().splitlines():
        model, seq, gpus, micro, accum, ac, tps = line.split()
        ac = "full" if ac == "T" else "none"
        runs.append(Run(source, gpu, model, int(seq), int(gpus), int(micro), int(accum), ac, float(tps),
                        hbm_gb_s=hbm_gb_s, memory_gb=memory_gb))  # fmt: skip
    return runs


LLM_FOUNDRY_H100 = _foundry(
    "H100",
    """
70b 2048 64 8 4 T 1039
70b 2048 32 2 16 T 882
30b 8192 8 1 21 T 1384
30b 4096 8 1 21 T 1802
30b 2048 32 14 3 T 2308
30b 2048 16 10 3 T 2263
30b 2048 8 3 21 T 2002
30b 1024 8 6 21 T 2084
13b 32768 8 1 3 T 1976
13b 16384 8 3 3 T 2985
13b 4096 8 10 3 T 4717
13b 2048 64 2 1 F 4800
13b 2048 32 2 1 F 4811
13b 2048 16 2 1 F 4767
13b 2048 8 2 1 F 4792
13b 1024 8 40 3 T 5502
7b 65536 8 1 2 T 1956
7b 32768 8 2 2 T 3318
7b 8192 8 8 2 T 6935
7b 4096 8 16 2 T 8611
7b 2048 8 6 1 F 10643
7b 1024 8 64 2 T 10203
3b 65536 8 1 2 T 3262
3b 32768 8 3 6 T 5873
3b 16384 8 1 6 F 11152
3b 8192 8 3 6 F 16578
3b 4096 8 5 6 F 20964
3b 2048 64 6 3 F 22525
3b 2048 32 6 3 F 23021
3b 2048 16 10 3 F 24142
3b 1024 8 20 6 F 27046
3b 512 8 40 6 F 27965
1b 65536 8 1 2 T 5506
1b 32768 8 1 4 F 12025
1b 16384 8 2 4 F 19649
1b 8192 8 3 4 F 29157
1b 4096 8 7 4 F 38535
1b 2048 64 20 1 F 44402
1b 2048 32 20 1 F 45130
1b 2048 16 20 1 F 46037
1b 2048 8 14 1 F 45455
1b 1024 8 18 4 F 48910
1b 512 8 56 4 F 52275
760m 32768 8 1 2 F 16291
760m 16384 8 3 2 F 27815
760m 8192 8 6 2 F 41825
760m 4096 8 12 2 F 55459
760m 2048 32 24 1 F 67971
760m 2048 16 24 1 F 68551
760m 2048 8 24 2 F 63147
760m 1024 8 48 2 F 78581
760m 512 8 96 2 F 83749
""",
)

LLM_FOUNDRY_A100 = _foundry(
    "A100",
    """
30b 8192 8 1 21 T 574
30b 4096 8 1 21 T 814
30b 2048 8 3 21 T 916
30b 1024 8 6 21 T 946
30b 512 8 12 21 T 967
13b 32768 8 1 3 T 1016
13b 16384 8 3 3 T 1431
13b 8192 8 5 3 T 1795
13b 4096 8 10 3 T 2060
13b 2048 8 2 3 F 2262
13b 1024 8 40 3 T 2330
7b 65536 8 1 2 T 1013
7b 32768 8 2 2 T 1672
7b 16384 8 4 2 T 2453
7b 8192 8 8 2 T 3206
7b 4096 8 16 2 T 3684
7b 2048 8 6 2 F 4641
7b 1024 8 64 2 T 4357
3b 65536 8 1 2 T 1767
3b 32768 8 3 6 T 3029
3b 16384 8 1 6 F 5529
3b 8192 8 3 6 F 7695
3b 4096 8 5 6 F 9457
3b 2048 8 10 2 F 10811
3b 1024 8 20 6 F 11580
3b 512 8 40 6 F 12127
1b 65536 8 1 2 T 3044
1b 32768 8 1 4 F 6275
1b 16384 8 2 4 F 9956
1b 8192 8 3 4 F 13814
1b 4096 8 7 4 F 17807
1b 2048 8 14 4 F 20513
1b 1024 8 18 4 F 22112
1b 512 8 56 4 F 23148
760m 65536 8 1 2 T 4143
760m 32768 8 1 2 F 8802
760m 16384 8 3 2 F 14274
760m 8192 8 6 2 F 20933
760m 4096 8 12 2 F 27351
760m 2048 8 24 2 F 32434
760m 1024 8 48 2 F 29765
760m 512 8 96 2 F 29446
350m 65536 8 1 2 F 7524
350m 32768 8 2 2 F 13652
350m 16384 8 4 2 F 23559
350m 8192 8 8 2 F 36569
350m 4096 8 16 2 F 49555
350m 2048 8 32 2 F 58782
350m 1024 8 64 2 F 64813
350m 512 8 128 2 F 69330
125m 65536 8 1 2 F 20368
125m 32768 8 2 2 F 36407
125m 16384 8 4 2 F 60040
125m 8192 8 8 2 F 90392
125m 4096 8 16 2 F 118396
125m 2048 8 40 2 F 142830
125m 1024 8 64 2 F 156468
125m 512 8 128 2 F 165681
""",
)

A100_40GB = {"hbm_gb_s": 1555, "memory_gb": 40}  # the 40GB SXM card: HBM2 at 1,555 GB/s

# The same README's "A100 40GB" table: another stack, not among RUNS. Its precision is `bf16` with MP mode PURE (the
# model, its gathered weights and its gradient reductions in bf16, no autocast), which our config cannot state: bf16
# here keeps fp32 master weights and reduces in fp32. `fit_speed.py --pure_bf16` prices it for a look; HBM2 at 1,555
# GB/s (the 40GB SXM datasheet's).
LLM_FOUNDRY_A100_40GB_PURE = _foundry(
    "A100",
    """
70b 2048 128 4 1 T 376
70b 2048 64 2 1 T 276
30b 2048 128 6 1 T 865
30b 2048 32 4 1 T 857
13b 8192 8 1 16 T 1407
13b 4096 8 2 16 T 1603
13b 2048 128 16 1 T 1972
13b 2048 64 16 1 T 1976
13b 2048 32 14 1 T 1998
13b 2048 16 10 1 T 1993
13b 2048 8 4 16 T 1668
13b 1024 8 8 16 T 1727
13b 512 8 16 16 T 1763
7b 16384 8 1 4 T 2249
7b 8192 8 3 4 T 2887
7b 4096 8 6 4 T 3366
7b 2048 128 18 1 T 3623
7b 2048 64 18 1 T 3665
7b 2048 32 18 1 T 3725
7b 2048 16 16 1 T 3645
7b 2048 8 12 4 T 3679
7b 1024 8 24 4 T 3854
7b 512 8 48 4 T 3895
3b 32768 8 1 4 T 2955
3b 16384 8 2 8 T 4465
3b 8192 8 1 8 F 7149
3b 4096 8 2 8 F 8777
3b 2048 128 6 1 F 9538
3b 2048 64 6 1 F 9736
3b 2048 32 6 1 F 9914
3b 2048 16 5 1 F 9750
3b 2048 8 5 8 F 10065
3b 1024 8 10 8 F 10731
3b 512 8 20 8 F 11324
1b 32768 8 1 4 T 5095
1b 16384 8 1 8 F 9715
1b 8192 8 2 8 F 13474
1b 4096 8 4 8 F 16856
1b 2048 128 10 1 F 18647
1b 2048 64 10 1 F 19001
1b 2048 32 10 1 F 15555
1b 2048 16 8 1 F 19085
1b 2048 8 8 8 F 19271
1b 1024 8 16 8 F 20959
1b 512 8 32 8 F 21782
760m 32768 8 1 4 T 7183
760m 16384 8 1 4 F 13914
760m 8192 8 3 4 F 20106
760m 4096 8 6 4 F 25863
760m 2048 128 12 1 F 28940
760m 2048 64 12 1 F 29344
760m 2048 32 12 1 F 29648
760m 2048 16 12 1 F 29607
760m 2048 8 12 4 F 30173
760m 1024 8 24 4 F 33422
760m 512 8 48 4 F 34938
350m 32768 8 1 4 F 13416
350m 16384 8 2 4 F 22896
350m 8192 8 4 4 F 34933
350m 4096 8 8 4 F 46833
350m 2048 128 18 1 F 51934
350m 2048 64 18 1 F 52689
350m 2048 32 18 1 F 53811
350m 2048 16 18 1 F 55413
350m 2048 8 16 4 F 55995
350m 1024 8 32 4 F 62523
350m 512 8 64 4 F 66284
125m 32768 8 1 4 F 32651
125m 16384 8 2 3 F 55484
125m 8192 8 5 3 F 86858
125m 4096 8 13 3 F 115162
125m 2048 128 26 1 F 123936
125m 2048 64 26 1 F 125234
125m 2048 32 26 1 F 127122
125m 2048 16 26 1 F 130535
125m 2048 8 26 3 F 136334
125m 1024 8 52 3 F 148289
125m 512 8 104 3 F 156735
""",
    source="llm-foundry A100 40GB, pure bf16",
    **A100_40GB,
)

# larger_mb_1.md's rows: (model, micro-batch, accumulation, tokens/s per GPU, the card where not an 80GB A100), on 8
# GPUs at 2,048 tokens.
LLM_FOUNDRY_MICRO_BATCH = [
    Run("llm-foundry micro-batches", "A100", model, 2048, 8, micro, accum, "none", tps, **card)
    for model, micro, accum, tps, card in (
        ("13b", 2, 2, 2228, {}),
        ("13b", 1, 2, 1867, {}),
        ("7b", 6, 2, 4715, {}),
        ("7b", 4, 2, 4513, {}),
        ("7b", 2, 2, 4044, {}),
        ("7b", 1, 2, 3366, {}),
        ("3b", 1, 2, 7076, A100_40GB),
    )
]

# torchtitan's selective op AC saves the output of every other matmul and recomputes the rest ("Saves output of all
# compute ops, except every second mm", its activation-checkpointing policy of 2024): half a forward's matmuls again.
OP_SAC = 0.5
# GB/s and GB: "Each H100 GPU is equipped with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth"
GRAND_TETON_HBM, GRAND_TETON_GB = 2400, 96


def _grand_teton(gpus: int, tokens_per_s: float, compile: bool = False) -> Run:
    """torchtitan's Llama 3.1 8B on its H100s: local batch 2 x 8192, op-level selective AC."""
    return Run("torchtitan", "H100", "llama3_8b", 8192, gpus, 2, 1, "selective", tokens_per_s, compile=compile,
               recomputed=OP_SAC, hbm_gb_s=GRAND_TETON_HBM, memory_gb=GRAND_TETON_GB)  # fmt: skip


TORCHTITAN = [
    _grand_teton(8, 5762),
    _grand_teton(8, 6667, compile=True),
    _grand_teton(128, 5605),
    _grand_teton(128, 6514, compile=True),
    Run("torchtitan", "A100", "llama3_8b", 8192, 64, 1, 1, "selective", 2973, recomputed=OP_SAC),
    Run("torchtitan", "A100", "llama3_70b", 8192, 64, 1, 1, "full", 331),
    Run("torchtitan", "A100", "llama2_13b", 4096, 64, 2, 1, "none", 2162),
    Run("torchtitan", "A100", "llama2_13b", 4096, 64, 2, 1, "selective", 1904, recomputed=OP_SAC),
    Run("torchtitan", "A100", "llama2_70b", 4096, 64, 2, 1, "full", 353),
]

OLMO_CORE = [  # micro-batches and global batches of their scripts, on one node of 8
    Run("OLMo-core", "H100", "olmo_1b", 4096, 8, 4, 32, "none", 55000, compile=True),
    Run("OLMo-core", "H100", "olmo2_7b", 4096, 8, 2, 64, "none", 10000, compile=True),
    Run("OLMo-core", "H100", "olmo2_13b", 4096, 8, 1, 256, "none", 4600, compile=True),
    Run("OLMo-core", "H100", "llama3_8b_dolma2", 4096, 8, 2, 64, "none", 9500, compile=True),
]

TORCHTUNE = [  # Llama 3.2 3B on one A100, batch 2 x 4096 packed: the README's "Optimization flags" rows
    Run("torchtune", "A100", "llama3_2_3b", 4096, 1, 2, 1, "none", 7075),
    Run("torchtune", "A100", "llama3_2_3b", 4096, 1, 2, 1, "none", 8998, compile=True),
    Run("torchtune", "A100", "llama3_2_3b", 4096, 1, 2, 1, "full", 7210, compile=True),
    Run("torchtune", "A100", "llama3_2_3b", 4096, 1, 2, 1, "full", 8210, compile=True, lora_rank=64),
    Run("torchtune", "A100", "llama3_2_3b", 4096, 1, 2, 1, "full", 8035, compile=True, lora_rank=64, nf4=True),
]

# torchtitan's op AC on a mixture of experts saves every other mm and attention; the experts' grouped matmuls are
# not in its save list, so backward recomputes all of them: of Qwen3-30B-A3B's forward matmuls in a block (attention
# 18.87M weights, router 0.26M, the 8 experts a token goes through 37.75M), (37.75 + 19.13 / 2) / 56.88.
MOE_OP_SAC = 0.832

TORCHTITAN_MOE = [  # a user's run in mlc-ai/pith-train#79: FSDP over 8 B200s, no expert parallelism, 8 x 8192 a rank
    Run("torchtitan (a user's)", "B200", "qwen3_30b_a3b", 8192, 8, 8, 1, "selective", 19487, compile=True,
        recomputed=MOE_OP_SAC),
]  # fmt: skip

RUNS = (LLM_FOUNDRY_H100 + LLM_FOUNDRY_A100 + LLM_FOUNDRY_MICRO_BATCH + TORCHTITAN + OLMO_CORE + TORCHTUNE
        + TORCHTITAN_MOE)  # fmt: skip


def sections(run: Run) -> dict[str, dict]:
    """The recipe sections that describe `run` (over any base recipe): its model (an MPT's GELU MLP, two d x 4d
    matmuls, as a SwiGLU of the same matmul FLOPs, three d x 8d/3; its heads all key-value heads), batch, precision,
    AC, compile and adapters."""
    keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
    if run.model in MPT:
        d, layers, heads = MPT[run.model]
        model = dict(zip(keys, (d, layers, heads, heads, round(8 * d / 3), MPT_VOCAB), strict=True))
    elif run.model in MOE:
        model = dict(MOE[run.model])
    else:
        model = dict(zip(keys, LLAMA[run.model], strict=True))
    model.update(max_seq_len=run.seq_len, tie_embeddings=run.model in TIED, rope_scaling=None)
    lora = {"rank": None, "quantize_base": None}
    if run.lora_rank is not None:
        targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        lora = {"rank": run.lora_rank, "alpha": 2.0 * run.lora_rank, "targets": targets,
                "quantize_base": "nf4" if run.nf4 else None}  # fmt: skip
    return {
        "model": model,
        "data": {"seq_len": run.seq_len, "micro_batch_size": run.micro_batch, "grad_accum_steps": run.grad_accum},
        "parallel": {"mixed_precision": "bf16", "compile": run.compile, "activation_checkpointing": run.ac},
        "lora": lora,
    }
