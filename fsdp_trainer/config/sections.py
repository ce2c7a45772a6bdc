"""The recipe's typed sections every run has (tuning.py holds those of fine-tuning methods, recipe.py the whole): a
dataclass per section, whose attribute docstrings are `--help` and docs/recipe_reference.md. Every check of a key
fails in its section's __post_init__ (or Recipe's, for keys of several sections), naming the key, before any process
group exists."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Precision = Literal["bf16", "fp16", "fp32"]
COMPUTE_DTYPES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""The one table of compute dtypes: parallel.mixed_precision (once resolved) and the HF export's --dtype name them;
each maps to the torch dtype's name (HF's `torch_dtype`). compute_dtype() gives the dtype, whose `.itemsize` is the
bytes per element the planner counts. Names, not dtypes, so that reading a recipe does not import torch (data
preparation never does)."""
AUTO = "auto"
"""parallel.mixed_precision's default: the precision the device computes natively, resolved at start-up
(distributed/runtime.py: resolve_precision) and recorded resolved in config.yaml, metrics and checkpoints."""


# torch is imported here, not in a TYPE_CHECKING block: jsonargparse executes those while it reads the sections.
def compute_dtype(name: str) -> torch.dtype:  # noqa: F821
    import torch

    if name == AUTO:  # a programming error, not a user's: the device decides, once it is known
        raise ValueError("parallel.mixed_precision=auto must be resolved first (distributed.runtime.resolve_precision)")
    return getattr(torch, COMPUTE_DTYPES[name])


def require(ok: bool, message: str) -> None:
    """A check of a recipe key: ValueError(message), the one line a user reads, unless `ok`."""
    if not ok:
        raise ValueError(message)


@dataclass
class RopeScaling:
    """Rotary scaling. llama3 (Llama 3.1 / 3.2): rotary wavelengths longer than the pretraining context are stretched
    by `factor`, short ones kept, and those in between interpolated. linear (Gemma 3 from 4B, on its global layers):
    every position divided by `factor`."""

    rope_type: Literal["llama3", "linear"] = "llama3"
    """HF's rope_type: llama3, or linear (which reads only `factor`)."""
    factor: float = 8.0
    """How much the long wavelengths are stretched (Llama 3.1: 8, Llama 3.2: 32)."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_position_embeddings / low_freq_factor are stretched by the whole factor."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_position_embeddings / high_freq_factor are left as they are."""
    original_max_position_embeddings: int = 8192
    """The context length the model was pretrained with before scaling."""

    def __post_init__(self) -> None:
        require(self.factor >= 1, f"model.rope_scaling.factor={self.factor} must be >= 1")
        require(
            0 < self.low_freq_factor < self.high_freq_factor,
            f"model.rope_scaling needs 0 < low_freq_factor ({self.low_freq_factor}) < high_freq_factor "
            f"({self.high_freq_factor})",
        )
        require(
            self.original_max_position_embeddings > 0,
            f"model.rope_scaling.original_max_position_embeddings={self.original_max_position_embeddings} must be "
            "positive",
        )


@dataclass
class MoEConfig:
    """A mixture of experts in place of the feed-forward (Qwen3-MoE): a router picks `top_k` of `experts` SwiGLU
    experts for each token and weighs their outputs by its probabilities."""

    experts: int = 128
    """Experts per MoE layer (HF's num_experts)."""
    top_k: int = 8
    """Experts each token goes through (HF's num_experts_per_tok)."""
    ffn_dim: int = 768
    """Hidden width of each expert (HF's moe_intermediate_size)."""
    norm_topk_prob: bool = True
    """Renormalize a token's top_k probabilities to sum to 1 (HF's norm_topk_prob; Qwen3-MoE: true)."""
    sparse_step: int = 1
    """Every sparse_step-th layer is a mixture of experts (HF's decoder_sparse_step), the others dense (ffn_dim)."""
    dense_layers: list[int] = field(default_factory=list)
    """Layers kept dense whatever sparse_step says (HF's mlp_only_layers)."""
    aux_loss_coef: float = 0.001
    """The weight of the router's load-balancing loss in the loss (HF's router_aux_loss_coef); logged as aux_loss."""

    def __post_init__(self) -> None:
        for key in ("experts", "top_k", "ffn_dim", "sparse_step"):
            require(getattr(self, key) > 0, f"model.moe.{key}={getattr(self, key)} must be positive")
        require(self.top_k <= self.experts, f"model.moe.top_k={self.top_k} must be <= model.moe.experts")
        require(self.aux_loss_coef >= 0, f"model.moe.aux_loss_coef={self.aux_loss_coef} must be >= 0")


@dataclass
class ModelConfig:
    """Shape of the decoder-only Transformer (Llama 3 / Qwen3 vocabulary)."""

    family: Literal["llama", "qwen3", "qwen3_moe", "mistral", "gemma3"] = "llama"
    """Architecture: `llama` (Llama 3), `qwen3` (Llama plus RMSNorm on each head's queries and keys), `qwen3_moe`
    (Qwen3 with a mixture of experts, `moe`), `mistral`
    (Llama's block, with `sliding_window`) or `gemma3` (Gemma 3's text model: qk-norm, norms around both sublayers,
    GELU, scaled embeddings, local layers with a sliding window between global ones)."""
    dim: int = 256
    """Width of the residual stream (HF hidden_size)."""
    n_layers: int = 4
    """Number of Transformer blocks."""
    n_heads: int = 8
    """Number of query heads."""
    n_kv_heads: int = 4
    """Number of key/value heads (grouped-query attention); must divide n_heads."""
    head_dim: int | None = None
    """Width of one attention head; null means dim // n_heads (Qwen3 sets it explicitly)."""
    ffn_dim: int = 768
    """Hidden width of the SwiGLU feed-forward (HF intermediate_size)."""
    vocab_size: int = 4096
    """Number of token ids; must cover the tokenizer's vocabulary."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1 / 3.2 rotary scaling (`factor`, `low_freq_factor`, `high_freq_factor`,
    `original_max_position_embeddings`); null means none (Llama 3, Qwen3)."""
    max_seq_len: int = 2048
    """Longest sequence the rotary tables are built for."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection."""
    init_std: float = 0.02
    """Standard deviation of the normal init of embeddings and projections (see Transformer.init_weights)."""
    sliding_window: int | None = None
    """mistral, gemma3's local layers: a query attends to at most this many positions, itself included (HF's
    sliding_window); null: all."""
    sliding_window_pattern: int | None = None
    """gemma3: layer i is global (full attention, rope_theta and rope_scaling) when i + 1 is a multiple of it, local
    otherwise (sliding_window, rope_local_theta): HF's sliding_window_pattern, 6 in every Gemma 3."""
    rope_local_theta: float | None = None
    """gemma3: the rotary base of the local layers (HF's rope_local_base_freq, 10000); null: rope_theta."""
    query_pre_attn_scalar: int | None = None
    """Attention scores are scaled by 1 / sqrt(this) (Gemma 3's query_pre_attn_scalar); null: head_dim."""
    moe: MoEConfig | None = None
    """qwen3_moe: the mixture of experts (`experts`, `top_k`, `ffn_dim`, ...); null: every feed-forward dense."""
    num_labels: int | None = None
    """null: a language model, whose output layer (lm_head) predicts the next token. 1: a reward model (HF's
    *ForSequenceClassification, num_labels 1): a score head (`score`) in place of the output layer, read at each
    sequence's last token; it trains on preference pairs (Bradley-Terry, TRL's RewardTrainer), from a language model's
    weights (a fresh head) or a reward model's."""

    def __post_init__(self) -> None:
        check_model(self)

    def check_vocab(self, what: str, n_ids: int) -> None:
        """Refuse token ids the model could not embed: `what` (a token file, a tokenizer) holds ids up to n_ids."""
        require(
            n_ids <= self.vocab_size,
            f"{what} has {n_ids} ids, more than model.vocab_size={self.vocab_size}: the model could not embed them",
        )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "qwen3_moe", "gemma3")

    @property
    def output_size(self) -> int:
        """What the last layer gives per position: the vocabulary's logits, or a score head's labels."""
        return self.vocab_size if self.num_labels is None else self.num_labels

    @property
    def tied_output(self) -> bool:
        """Whether the output layer is the embedding (tie_embeddings, for a language model: a score head never is)."""
        return self.tie_embeddings and self.num_labels is None


def check_model(cfg: ModelConfig) -> None:
    """The model section's keys make a model: ValueError naming the key otherwise."""
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
        require(getattr(cfg, key) > 0, f"model.{key}={getattr(cfg, key)} must be positive")
    require(
        cfg.n_heads % cfg.n_kv_heads == 0,
        f"model.n_kv_heads={cfg.n_kv_heads} must divide model.n_heads={cfg.n_heads}",
    )
    if cfg.head_dim is None:
        require(
            cfg.dim % cfg.n_heads == 0,
            f"model.n_heads={cfg.n_heads} must divide model.dim={cfg.dim} (or set model.head_dim)",
        )
    else:
        require(cfg.head_dim > 0, f"model.head_dim={cfg.head_dim} must be positive")
    require(cfg.resolved_head_dim % 2 == 0, f"model.head_dim={cfg.resolved_head_dim} must be even for RoPE")
    require(
        cfg.sliding_window is None or (cfg.family in ("mistral", "gemma3") and cfg.sliding_window > 0),
        f"model.sliding_window={cfg.sliding_window}: a positive window, for the mistral and gemma3 families only",
    )
    require(
        (cfg.moe is not None) == (cfg.family == "qwen3_moe"),
        f"model.moe: the qwen3_moe family has one and no other family does (model.family={cfg.family})",
    )
    gemma3 = ("sliding_window_pattern", "rope_local_theta")
    for key in gemma3:
        require(getattr(cfg, key) is None or cfg.family == "gemma3", f"model.{key} applies to gemma3 only; set null")
        require(getattr(cfg, key) is None or getattr(cfg, key) > 0, f"model.{key}={getattr(cfg, key)} must be > 0")
    require(
        cfg.family != "gemma3" or (cfg.sliding_window is None) == (cfg.sliding_window_pattern is None),
        "model.sliding_window and model.sliding_window_pattern: gemma3 sets both (local layers) or neither",
    )
    require(
        cfg.num_labels in (None, 1),
        f"model.num_labels={cfg.num_labels}: 1 (a reward model's scalar score) or null (a language model)",
    )


def local_layers(cfg: ModelConfig) -> frozenset[int]:
    """The layers that attend through a sliding window: all of a Mistral model with one, and Gemma 3's local layers
    (all but every sliding_window_pattern-th)."""
    if cfg.sliding_window is None:
        return frozenset()
    pattern = cfg.sliding_window_pattern or 1
    return frozenset(i for i in range(cfg.n_layers) if pattern == 1 or (i + 1) % pattern)


@dataclass
class ParallelConfig:
    """How the model is spread over the processes torchrun started."""

    sharding: Literal["FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OP", "NO_SHARD", "HYBRID_SHARD"] = "FULL_SHARD"
    """FSDP sharding: ZeRO-3, ZeRO-2 (params stay gathered between forward and backward), ZeRO-1 (params stay
    gathered over all micro-steps of a step, gradients reduce-scattered once; only master weights and optimizer state
    sharded), DDP (replicated), or ZeRO-3 within a node and replicas across nodes."""
    mixed_precision: Literal["auto", "bf16", "fp16", "fp32"] = AUTO
    """Compute dtype. auto: what the device computes natively, chosen at start-up and logged: bf16 on GPUs with
    compute capability >= 8.0 (A100, H100, ...), fp16 on older ones (V100, T4), bf16 on CPUs with bf16 units
    (AVX512-BF16, AMX, ARM BF16), else fp32 (on an AVX2 CPU bf16 is emulated, 15-80x slower than fp32). bf16 and fp16
    keep fp32 master weights, optimizer state and gradient reductions; fp16 also scales the loss dynamically
    (optim.loss_scale) so small gradients do not underflow."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: never, whole blocks, or everything but matmuls and attention."""
    ac_every: int = 1
    """With activation checkpointing, apply it to every k-th block only (1 = every block)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: auto picks nccl on CUDA and gloo on CPU."""
    compile: bool = False
    """torch.compile each Transformer block (after activation checkpointing, before FSDP)."""
    prefetch_blocks: int = 1
    """Blocks whose parameter all-gather FSDP issues ahead of compute, in forward and in backward. 1 is FSDP2's own
    (the next block); more overlaps communication further ahead, for one more gathered block of memory each."""
    expandable_segments: bool = False
    """CUDA's caching allocator grows segments in place instead of allocating new ones: less fragmentation when
    shapes vary (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True). Nothing to do on CPU."""
    cpu_offload: bool = False
    """FSDP2's CPUOffloadPolicy: the sharded fp32 weights, their gradients and the optimizer state live in host memory
    (pinned), each block's shard is copied to the GPU for its all-gather and its gradient shard back, and the optimizer
    steps on the host with all the cores a rank has. Fits a model whose state the GPUs cannot hold, for host<->device
    traffic every step. On a CPU-only machine it runs, unpinned, and saves nothing: host and device are one memory."""
    timeout_s: float = 600.0
    """Seconds a collective may wait for a peer before the run fails (instead of hanging on a dead rank)."""
    accumulate_unsharded: bool = False
    """With data.grad_accum_steps > 1 under FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD, accumulate the whole model's
    unsharded fp32 gradients over a step's micro-steps and reduce them once, at the last (FSDP2's
    set_requires_gradient_sync(False) before it): one reduce-scatter a step instead of one a micro-step, for 4 bytes a
    trained parameter more on every rank. Off, each micro-step's gradients are reduce-scattered into the shards and
    stay sharded, as ZeRO-2/3 hold them. SHARD_OP (ZeRO-1) and NO_SHARD (DDP) always accumulate whole gradients: they
    hold them whole anyway."""

    context_parallel: int = 1
    """Context parallelism: each window's positions split over this many ranks (a multiple of it launched), for
    windows longer than one device's activations hold. The ranks of a group read the same windows and hold 2 of its
    2 x context_parallel chunks each (one from the start, one from the end: even causal work); each block's keys and
    values are gathered within the group. FSDP shards over every rank, these included: no parameter memory added.
    data.seq_len a multiple of 2 x context_parallel; next-token runs (pretraining, SFT)."""

    expert_parallel: int = 1
    """Expert parallelism, for a mixture of experts: each layer's experts split over groups of this many ranks (a
    multiple of it launched; moe.experts a multiple of it), each token copy sent to its expert's rank and back by
    all-to-all; each rank's experts sharded by FSDP over the ranks holding the same ones, the rest of the model over
    all; LoRA's adapters on the experts split with them. Checkpoints keep the layout without it. FULL_SHARD,
    SHARD_GRAD_OP or SHARD_OP; no offload or context parallelism with it yet."""

    def __post_init__(self) -> None:
        require(self.ac_every >= 1, f"parallel.ac_every={self.ac_every} must be >= 1")
        require(self.expert_parallel >= 1, f"parallel.expert_parallel={self.expert_parallel} must be >= 1")
        require(self.context_parallel >= 1, f"parallel.context_parallel={self.context_parallel} must be >= 1")
        require(self.prefetch_blocks >= 1, f"parallel.prefetch_blocks={self.prefetch_blocks} must be >= 1")
        require(self.timeout_s > 0, f"parallel.timeout_s={self.timeout_s} must be positive")


@dataclass
class MixtureSource:
    """One source of a training mixture."""

    path: str
    """A token file or shard directory written by tools/prepare_data.py with data.tokenizer_path."""
    weight: float = 1.0
    """Its share of the training samples, relative to the other sources' weights."""

    def __post_init__(self) -> None:
        require(self.weight > 0, f"data.mixture: the weight of {self.path} is {self.weight}; it must be positive")


@dataclass
class DataConfig:
    """Token files and batch shape. The global batch is micro_batch_size x grad_accum_steps x data-parallel ranks."""

    train_path: str = "data/shakespeare/train.bin"
    """Training token file written by tools/prepare_data.py (a `.meta.json` must sit beside it)."""
    val_path: str | None = "data/shakespeare/val.bin"
    """Validation token file; null disables evaluation."""
    tokenizer_path: str | None = "data/shakespeare/tokenizer.model"
    """The tokenizer the token files are made with: a sentencepiece `.model`, an HF `tokenizer.json`, or a directory
    holding either (an HF checkpoint, an imported model); tools/prepare_data.py trains a sentencepiece one here only
    when nothing exists yet. null: the tokenizer saved with the checkpoint the run starts from (checkpoint.resume: an
    imported model, a run), which config.yaml then records."""
    seq_len: int = 256
    """Tokens per training sequence."""
    micro_batch_size: int = 8
    """Sequences per rank per forward/backward."""
    grad_accum_steps: int = 1
    """Forward/backward passes per optimizer step; gradients are reduced across ranks on each one or on the last
    only (parallel.accumulate_unsharded)."""
    mixture: list[MixtureSource] | None = None
    """Train on several token files or shard directories, each drawn with its weight, instead of train_path alone:
    `[{path: data/web, weight: 0.7}, {path: data/code, weight: 0.3}]`. Each source has its own shuffled epochs;
    metrics.jsonl reports the tokens drawn and epochs completed of each."""

    def __post_init__(self) -> None:
        for key in ("seq_len", "micro_batch_size", "grad_accum_steps"):
            require(getattr(self, key) > 0, f"data.{key}={getattr(self, key)} must be positive")
        require(self.mixture is None or len(self.mixture) > 0, "data.mixture is empty; name its sources or use null")


@dataclass
class OptimConfig:
    """AdamW, or Muon for the blocks' matrices beside AdamW for the rest; linear warmup and cosine decay."""

    name: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW for every parameter. muon: Muon (momentum, then Newton-Schulz orthogonalization of each matrix)
    for the 2-D weights of the blocks, AdamW (with lr, weight_decay, betas) for embeddings, the output layer and
    norms."""
    lr: float = 3e-4
    """Peak learning rate (of AdamW), reached after warmup_steps."""
    min_lr: float = 3e-5
    """Learning rate at the last step of the cosine decay."""
    warmup_steps: int = 100
    """Steps of linear warmup from 0 to lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norms)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW beta1, beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    muon_lr: float = 0.02
    """Muon only: peak learning rate of the blocks' matrices; it follows the same warmup and decay as lr."""
    muon_momentum: float = 0.95
    """Muon only: momentum of the gradient before orthogonalization."""
    muon_nesterov: bool = True
    """Muon only: orthogonalize the Nesterov look-ahead (gradient + momentum x buffer) instead of the buffer."""
    muon_weight_decay: float = 0.0
    """Muon only: decoupled weight decay of the blocks' matrices."""
    loss_scale: float = 65536.0
    """fp16 only: the initial loss scale of torch.amp.GradScaler. A step whose scaled gradients overflow is skipped
    and the scale halved; after 2000 steps without one it doubles. Skips are counted in metrics.jsonl
    (`overflow_steps`, with `loss_scale`) and are routine, not train.on_nonfinite's business."""

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        require(self.lr > 0, f"optim.lr={self.lr} must be positive")
        require(0 <= self.min_lr <= self.lr, f"optim.min_lr={self.min_lr} must lie in [0, optim.lr={self.lr}]")
        require(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        require(self.grad_clip >= 0, f"optim.grad_clip={self.grad_clip} must be >= 0")
        require(self.loss_scale > 0, f"optim.loss_scale={self.loss_scale} must be positive")
        require(self.muon_lr > 0, f"optim.muon_lr={self.muon_lr} must be positive")
        require(0 <= self.muon_momentum < 1, f"optim.muon_momentum={self.muon_momentum} must lie in [0, 1)")
        require(all(0 <= b < 1 for b in self.betas), f"optim.betas={list(self.betas)} must lie in [0, 1)")


@dataclass
class TrainConfig:
    """Length of the run, logging and evaluation."""

    steps: int = 200
    """Optimizer steps to train for."""
    seed: int = 0
    """Seed of the weight init and the data order."""
    out_dir: str = "runs/debug"
    """Where config.yaml, metrics.jsonl and checkpoints/ go."""
    log_every: int = 10
    """Log (and sync the loss to the host) every this many steps."""
    eval_every: int = 100
    """Evaluate on data.val_path every this many steps (0 = never); also after the last step."""
    eval_on_start: bool = False
    """Evaluate once before the first step as well (logged as step 0, benchmark tasks too), so that a curve shows where
    the run started; a resumed run does not evaluate again."""
    eval_steps: int = 10
    """Batches per evaluation (each the size of one global micro-batch); no more than the validation file holds
    whole, so that no window is scored twice (a warning says so)."""
    loss_chunks: int = 1
    """Compute the output layer and the loss in this many slices of the tokens, each slice's logits freed at once and
    recomputed in backward, so the full (tokens x vocab) fp32 logits never exist (1 = in one piece). Same loss and
    gradients; less memory for large vocabularies, for a little more compute."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient norm is NaN/inf never updates the weights. `stop`: fail at the next log step (or
    save), naming the step, with nothing after the last good checkpoint saved. `skip`: drop the step, count it in
    metrics.jsonl (`skipped_steps`) and go on."""
    progress_bar: bool = True
    """On a terminal, show a progress bar with ETA on rank 0 (log lines still go to metrics.jsonl); off a terminal
    (CI, Slurm, a pipe) only the log lines are printed, and the progress lines of progress_every_s."""
    progress_every_s: float = 60.0
    """Off a terminal, print a progress line (step, seconds per step, ETA; from the host's clock, no sync) when this
    many seconds pass without a log line, so a slow run shows it is alive between log steps (0 = never)."""

    def __post_init__(self) -> None:
        require(self.steps >= 0, f"train.steps={self.steps} must be >= 0")
        require(self.log_every >= 1, f"train.log_every={self.log_every} must be >= 1")
        require(self.eval_every >= 0, f"train.eval_every={self.eval_every} must be >= 0")
        require(self.eval_steps >= 1, f"train.eval_steps={self.eval_steps} must be >= 1")
        require(self.loss_chunks >= 1, f"train.loss_chunks={self.loss_chunks} must be >= 1")
        require(self.progress_every_s >= 0, f"train.progress_every_s={self.progress_every_s} must be >= 0")


@dataclass
class EvalConfig:
    """Benchmark tasks scored during training with lm-evaluation-harness (`pip install -e ".[eval]"`), on the sharded
    model as it trains; their scores go to metrics.jsonl, TensorBoard and W&B as eval/TASK/METRIC. tools/evaluate.py
    scores a checkpoint the same way afterwards."""

    tasks: list[str] = field(default_factory=list)
    """lm-eval task names (its registry, a YAML in include_path, or shakespeare_next_line); empty: none."""
    every: int = 0
    """Score the tasks every this many steps, and after the last step (0: after the last step only)."""
    num_fewshot: int | None = None
    """Examples before each item (null: each task's own number)."""
    limit: float | None = None
    """Items of each task scored (a fraction of them when below 1; null: all), the same items every time."""
    batch_size: int = 8
    """Requests per forward pass."""
    max_gen_toks: int = 256
    """The most tokens a generative task's answer may take, where the task sets no number."""
    apply_chat_template: bool = False
    """Render each request with the tokenizer's chat template (a chat model's run)."""
    include_path: str | None = None
    """A directory of task YAML files of your own (docs/evaluation.md)."""

    def __post_init__(self) -> None:
        require(self.every >= 0, f"eval.every={self.every} must be >= 0")
        require(self.limit is None or self.limit > 0, f"eval.limit={self.limit} must be > 0")
        require(self.batch_size >= 1, f"eval.batch_size={self.batch_size} must be >= 1")
        require(self.max_gen_toks >= 1, f"eval.max_gen_toks={self.max_gen_toks} must be >= 1")


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (torch.distributed.checkpoint) under train.out_dir/checkpoints/."""

    every: int = 0
    """Save every this many steps and after the last step (0 = never)."""
    keep_last: int = 3
    """Published checkpoints to keep; older ones are deleted (0 = keep all), except those another run holds
    (tools/verify_checkpoint.py RUN lists them)."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    resume: str = "auto"
    """`auto`: continue from checkpoints/latest if it exists; `none`: start fresh; or a checkpoint directory."""
    export_hf: bool = False
    """After the last step, write the model as an HF directory to train.out_dir/hf: each rank writes its shards and
    DCP's HuggingFaceStorageWriter consolidates them, so no process holds the whole model (consolidate.py does the same
    from any checkpoint later, in one process). Not with LoRA adapters: consolidate.py merges them."""
    on_save_error: Literal["stop", "continue"] = "stop"
    """A save that fails on any rank (disk full, quota, I/O error) is removed and `latest` keeps the last complete one;
    then `stop`: exit 1, resume once there is room; `continue`: train on and save at the next due step (the run's last
    save stops it either way)."""

    def __post_init__(self) -> None:
        require(self.every >= 0, f"checkpoint.every={self.every} must be >= 0")
        require(self.keep_last >= 0, f"checkpoint.keep_last={self.keep_last} must be >= 0")


@dataclass
class WandbConfig:
    """Weights & Biases, from rank 0 (`pip install -e ".[wandb]"`): off unless a project is named."""

    project: str | None = None
    """W&B project to log to; null logs nothing to W&B."""
    entity: str | None = None
    """W&B team or user (null: your default entity)."""
    name: str | None = None
    """Run name shown in W&B (null: the name of train.out_dir)."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """online: stream to the server; offline: write under OUT_DIR/wandb for `wandb sync`; disabled: log nothing."""
    tags: list[str] = field(default_factory=list)
    """Tags of the run."""
    rewind: bool = False
    """A resumed run rewinds its W&B run to the checkpoint's step (resume_from), so the steps an interrupted attempt
    logged after it are replaced, not kept. Needs W&B's run rewind, in private preview: ask W&B support to enable it.
    Off: the run resumes (resume=allow) and those steps keep their first values, each logged once."""
