"""The recipe's typed sections: a dataclass per section, whose attribute docstrings are `--help` and
docs/recipe_reference.md. Every check of a key fails in its section's __post_init__ (or Recipe's, for keys of
several sections), naming the key, before any process group exists."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
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


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class RopeScaling:
    """Llama 3.1 / 3.2 rotary scaling (HF rope_type `llama3`): rotary wavelengths longer than the pretraining context
    are stretched by `factor`, short ones kept, and those in between interpolated."""

    factor: float = 8.0
    """How much the long wavelengths are stretched (Llama 3.1: 8, Llama 3.2: 32)."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_position_embeddings / low_freq_factor are stretched by the whole factor."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_position_embeddings / high_freq_factor are left as they are."""
    original_max_position_embeddings: int = 8192
    """The context length the model was pretrained with before scaling."""

    def __post_init__(self) -> None:
        _require(self.factor >= 1, f"model.rope_scaling.factor={self.factor} must be >= 1")
        _require(
            0 < self.low_freq_factor < self.high_freq_factor,
            f"model.rope_scaling needs 0 < low_freq_factor ({self.low_freq_factor}) < high_freq_factor "
            f"({self.high_freq_factor})",
        )
        _require(
            self.original_max_position_embeddings > 0,
            f"model.rope_scaling.original_max_position_embeddings={self.original_max_position_embeddings} must be "
            "positive",
        )


@dataclass
class ModelConfig:
    """Shape of the decoder-only Transformer (Llama 3 / Qwen3 vocabulary)."""

    family: Literal["llama", "qwen3", "mistral"] = "llama"
    """Architecture: `llama` (Llama 3), `qwen3` (Llama plus RMSNorm on each head's queries and keys) or `mistral`
    (Llama's block, with `sliding_window`)."""
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
    """mistral: a query attends to at most this many positions, itself included (HF's sliding_window); null: all."""
    num_labels: int | None = None
    """null: a language model, whose output layer (lm_head) predicts the next token. 1: a reward model (HF's
    *ForSequenceClassification, num_labels 1): a score head (`score`) in place of the output layer, read at each
    sequence's last token; it trains on preference pairs (Bradley-Terry, TRL's RewardTrainer), from a language model's
    weights (a fresh head) or a reward model's."""

    def __post_init__(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            _require(getattr(self, key) > 0, f"model.{key}={getattr(self, key)} must be positive")
        _require(
            self.n_heads % self.n_kv_heads == 0,
            f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}",
        )
        if self.head_dim is None:
            _require(
                self.dim % self.n_heads == 0,
                f"model.n_heads={self.n_heads} must divide model.dim={self.dim} (or set model.head_dim)",
            )
        else:
            _require(self.head_dim > 0, f"model.head_dim={self.head_dim} must be positive")
        _require(self.resolved_head_dim % 2 == 0, f"model.head_dim={self.resolved_head_dim} must be even for RoPE")
        _require(
            self.sliding_window is None or (self.family == "mistral" and self.sliding_window > 0),
            f"model.sliding_window={self.sliding_window}: a positive window, for the mistral family only",
        )
        _require(
            self.num_labels in (None, 1),
            f"model.num_labels={self.num_labels}: 1 (a reward model's scalar score) or null (a language model)",
        )

    def check_vocab(self, what: str, n_ids: int) -> None:
        """Refuse token ids the model could not embed: `what` (a token file, a tokenizer) holds ids up to n_ids."""
        _require(
            n_ids <= self.vocab_size,
            f"{what} has {n_ids} ids, more than model.vocab_size={self.vocab_size}: the model could not embed them",
        )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @property
    def output_size(self) -> int:
        """What the last layer gives per position: the vocabulary's logits, or a score head's labels."""
        return self.vocab_size if self.num_labels is None else self.num_labels

    @property
    def tied_output(self) -> bool:
        """Whether the output layer is the embedding (tie_embeddings, for a language model: a score head never is)."""
        return self.tie_embeddings and self.num_labels is None


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

    def __post_init__(self) -> None:
        _require(self.ac_every >= 1, f"parallel.ac_every={self.ac_every} must be >= 1")
        _require(self.prefetch_blocks >= 1, f"parallel.prefetch_blocks={self.prefetch_blocks} must be >= 1")
        _require(self.timeout_s > 0, f"parallel.timeout_s={self.timeout_s} must be positive")


@dataclass
class MixtureSource:
    """One source of a training mixture."""

    path: str
    """A token file or shard directory written by tools/prepare_data.py with data.tokenizer_path."""
    weight: float = 1.0
    """Its share of the training samples, relative to the other sources' weights."""

    def __post_init__(self) -> None:
        _require(self.weight > 0, f"data.mixture: the weight of {self.path} is {self.weight}; it must be positive")


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
    """Forward/backward passes per optimizer step; gradients are synchronised on the last one only."""
    mixture: list[MixtureSource] | None = None
    """Train on several token files or shard directories, each drawn with its weight, instead of train_path alone:
    `[{path: data/web, weight: 0.7}, {path: data/code, weight: 0.3}]`. Each source has its own shuffled epochs;
    metrics.jsonl reports the tokens drawn and epochs completed of each."""

    def __post_init__(self) -> None:
        for key in ("seq_len", "micro_batch_size", "grad_accum_steps"):
            _require(getattr(self, key) > 0, f"data.{key}={getattr(self, key)} must be positive")
        _require(self.mixture is None or len(self.mixture) > 0, "data.mixture is empty; name its sources or use null")


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
        _require(self.lr > 0, f"optim.lr={self.lr} must be positive")
        _require(0 <= self.min_lr <= self.lr, f"optim.min_lr={self.min_lr} must lie in [0, optim.lr={self.lr}]")
        _require(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        _require(self.grad_clip >= 0, f"optim.grad_clip={self.grad_clip} must be >= 0")
        _require(self.loss_scale > 0, f"optim.loss_scale={self.loss_scale} must be positive")
        _require(self.muon_lr > 0, f"optim.muon_lr={self.muon_lr} must be positive")
        _require(0 <= self.muon_momentum < 1, f"optim.muon_momentum={self.muon_momentum} must lie in [0, 1)")
        _require(all(0 <= b < 1 for b in self.betas), f"optim.betas={list(self.betas)} must lie in [0, 1)")


LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS = (*LORA_PROJECTIONS, "lm_head", "embed_tokens")


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA): train small matrices beside the frozen model's projections instead of every weight."""

    rank: int | None = None
    """Rank of each adapter; null trains every weight (full fine-tuning)."""
    alpha: float = 16.0
    """Scale: an adapter's output is multiplied by alpha / rank (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on an adapter's input (PEFT's lora_dropout)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_PROJECTIONS))
    """The layers that get adapters (PEFT's target_modules): any of every block's q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj, and lm_head (the output layer) and embed_tokens (the embedding), those two not
    when they are tied."""
    quantize_base: Literal["nf4"] | None = None
    """QLoRA: store the frozen weights of the adapted projections in 4-bit NormalFloat (`nf4`, through torchao:
    about 0.52 bytes a weight instead of 2 in bf16), sharded in that form and dequantized one projection at a time
    in forward and backward; null keeps them in the compute dtype. Checkpoints and exports are unchanged: they hold
    the adapters, and an export merges them into the base's original weights, as PEFT does."""
    adapter: str | None = None
    """A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) to start the adapters from
    instead of their init, to train it further; its r, lora_alpha and target_modules must match the keys above."""

    def __post_init__(self) -> None:
        _require(self.rank is None or self.rank >= 1, f"lora.rank={self.rank} must be >= 1, or null")
        _require(0.0 <= self.dropout < 1.0, f"lora.dropout={self.dropout} must be in [0, 1)")
        unknown = sorted(set(self.targets) - set(LORA_TARGETS))
        _require(not unknown, f"lora.targets has {unknown}; choose among {', '.join(LORA_TARGETS)}")
        _require(bool(self.targets), "lora.targets is empty; name at least one of " + ", ".join(LORA_TARGETS))
        _require(
            self.adapter is None or self.rank is not None,
            f"lora.adapter={self.adapter} needs lora.rank (the adapter's r)",
        )
        _require(
            self.quantize_base is None or self.rank is not None,
            f"lora.quantize_base={self.quantize_base} needs lora.rank: it quantizes the frozen weights of a LoRA run",
        )


@dataclass
class PreferenceConfig:
    """Preference tuning on pairs of answers, prepared with prepare_data.py --format preference: the model learns to
    rank each pair's chosen answer above its rejected one; or (kto) on single answers labelled good or bad, prepared
    with --format unpaired. DPO, its variants and KTO measure it against a reference model, the model the run starts
    from (with LoRA, the same weights with the adapters off; otherwise a frozen, sharded copy of it in the compute
    dtype, with no gradients and no optimizer state); SimPO and ORPO need none."""

    loss: Literal["sigmoid", "ipo", "robust", "simpo", "orpo", "kto"] | None = None
    """null: not a preference run. sigmoid: DPO (Rafailov et al. 2023), with label_smoothing conservative DPO; ipo: IPO
    (Azar et al. 2023), log-ratios averaged over each answer's tokens; robust: rDPO (Chowdhury et al. 2024), for
    labels flipped with probability label_smoothing (TRL's DPOTrainer's losses of the same names). simpo: SimPO (Meng
    et al. 2024; TRL's CPOTrainer loss_type simpo), length-normalized, a target margin, no reference. orpo: ORPO (Hong
    et al. 2024; TRL's ORPOTrainer), the chosen answers' NLL plus beta x the log odds ratio, no reference. kto: KTO
    (Ethayarajh et al. 2024; TRL's KTOTrainer) on unpaired answers, each against a KL reference point estimated from
    the batch's prompts paired with other examples' answers."""
    beta: float = 0.1
    """How far from the reference the policy may move: the implicit reward is beta x (policy - reference
    log-probability) of an answer (IPO: the regularization, 1 / (2 beta) the target margin). simpo: the reward scale
    (the paper's 2.0-2.5); orpo: lambda, the weight of the odds-ratio term."""
    label_smoothing: float = 0.0
    """sigmoid, robust and simpo: the probability that a pair's labels are flipped, in [0, 0.5)."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin gamma (TRL's simpo_gamma)."""
    nll_weight: float = 0.0
    """The weight of the chosen answers' negative log-likelihood (a mean over their tokens) added to the loss: DPO +
    NLL (RPO; TRL's DPO loss_type [sigmoid, sft] with loss_weights [1, w]), or CPO's cpo_alpha with simpo. ORPO's NLL
    term always weighs 1 (beta weighs its other)."""
    desirable_weight: float = 1.0
    """kto: the weight of the desirable answers' losses (TRL's desirable_weight; the paper advises weights that make
    desirable_weight x their number over undesirable_weight x theirs between 1 and 4/3)."""
    undesirable_weight: float = 1.0
    """kto: the weight of the undesirable answers' losses (TRL's undesirable_weight)."""
    reference: Literal["model", "cache"] = "model"
    """sigmoid, ipo, robust: where the reference's log-probabilities come from. model: its forward each micro-step.
    cache: one sharded forward pass of it over every pair of the train and validation files before training, stored
    in train.out_dir/reference_cache with the fingerprints of the reference's weights and of the files; then no
    reference is held, gathered or run (a resume reads the cache, and refuses one made for other data)."""

    def __post_init__(self) -> None:
        _require(self.beta > 0, f"preference.beta={self.beta} must be > 0")
        for key in ("desirable_weight", "undesirable_weight"):
            _require(getattr(self, key) > 0, f"preference.{key}={getattr(self, key)} must be > 0")
            _require(getattr(self, key) == 1 or self.loss == "kto", f"preference.{key} applies to kto; set it to 1")
        _require(
            0.0 <= self.label_smoothing < 0.5,
            f"preference.label_smoothing={self.label_smoothing} must be in [0, 0.5)",
        )
        _require(
            self.label_smoothing == 0 or self.loss not in ("ipo", "orpo", "kto"),
            f"preference.label_smoothing applies to the sigmoid, robust and simpo losses, not {self.loss}; set it to 0",
        )
        _require(self.nll_weight >= 0, f"preference.nll_weight={self.nll_weight} must be >= 0")
        _require(
            self.nll_weight == 0 or self.loss != "orpo",
            "preference.nll_weight: ORPO's NLL term always weighs 1 (preference.beta weighs the odds-ratio term); "
            "set it to 0",
        )
        _require(self.nll_weight == 0 or self.loss != "kto", "preference.nll_weight applies to pairs, not kto")
        _require(
            self.reference == "model" or self.loss in ("sigmoid", "ipo", "robust"),
            f"preference.reference=cache applies to the sigmoid, ipo and robust losses, not {self.loss}",
        )


@dataclass
class RewardConfig:
    """A reward model (model.num_labels 1) on preference pairs, prepared with prepare_data.py --format preference:
    each conversation's reward is the score head at its last token, and a pair's loss is Bradley-Terry's,
    -log sigmoid(chosen - rejected), as TRL's RewardTrainer computes it."""

    center_rewards_coefficient: float = 0.0
    """Adds this x (chosen + rejected)^2 to each pair's loss, which keeps the rewards centred on zero (TRL's
    center_rewards_coefficient; Eisenstein et al. 2023 use 0.01); 0: none."""

    def __post_init__(self) -> None:
        _require(
            self.center_rewards_coefficient >= 0,
            f"reward.center_rewards_coefficient={self.center_rewards_coefficient} must be >= 0",
        )


@dataclass
class DistillConfig:
    """Knowledge distillation: the model learns the next-token distributions of a frozen teacher, which is sharded as
    the model is and runs forward only. Off unless a teacher is named."""

    teacher: str | None = None
    """The teacher's weights: a checkpoint, or a run directory (its latest), of any world size; an HF model after
    tools/import_hf.py. Its tokenizer and vocabulary must be the model's; its size and family may differ."""
    loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """The divergence per target, of the distributions at `temperature`: forward_kl KL(teacher || model) (TRL's
    generalized JSD at beta 0), reverse_kl KL(model || teacher) (beta 1), jsd the generalized Jensen-Shannon divergence
    at `beta` (GKD)."""
    beta: float = 0.5
    """jsd: the teacher's weight in the mixture the two are compared with (TRL / GKD's beta)."""
    temperature: float = 1.0
    """Both models' logits are divided by it before the divergence (not before the cross-entropy)."""
    alpha: float = 1.0
    """The divergence's weight in the loss; the cross-entropy on the targets weighs 1 - alpha. Both are means over
    the same targets (a chat run's supervised tokens), logged as kd_loss and ce_loss."""
    lmbda: float = 0.0
    """On-policy distillation (GKD's lmbda, Agarwal et al. 2024): the probability that a step trains on the model's
    own answers instead of the data's: each example's last answer is replaced by one the model samples from its
    prompt, and the teacher scores it. Chat data only (the prompts are the untrained tokens before an answer); the
    step is drawn from (train.seed, step), so a resumed run samples the same steps. On those steps the cross-entropy
    (alpha < 1) is on the sampled tokens: GKD has alpha 1."""
    max_new_tokens: int = 128
    """On-policy steps: the longest answer sampled (fewer where the example's window ends first); an answer ends
    sooner at the chat template's end-of-turn token or the tokenizer's EOS, which it keeps."""
    sample_temperature: float = 1.0
    """On-policy steps: the temperature the answers are sampled at, from the whole vocabulary (1: the model's own
    distribution; TRL's GKD defaults to 0.9; 0: greedy)."""

    def __post_init__(self) -> None:
        _require(0 < self.beta < 1 or self.loss != "jsd", f"distill.beta={self.beta}: jsd needs 0 < beta < 1")
        _require(self.temperature > 0, f"distill.temperature={self.temperature} must be > 0")
        _require(0 <= self.alpha <= 1, f"distill.alpha={self.alpha} must be in [0, 1]")
        _require(0 <= self.lmbda <= 1, f"distill.lmbda={self.lmbda} must be in [0, 1]")
        _require(self.max_new_tokens >= 1, f"distill.max_new_tokens={self.max_new_tokens} must be >= 1")
        _require(self.sample_temperature >= 0, f"distill.sample_temperature={self.sample_temperature} must be >= 0")


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
    eval_steps: int = 10
    """Batches per evaluation (each the size of one global micro-batch)."""
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
        _require(self.steps >= 0, f"train.steps={self.steps} must be >= 0")
        _require(self.log_every >= 1, f"train.log_every={self.log_every} must be >= 1")
        _require(self.eval_every >= 0, f"train.eval_every={self.eval_every} must be >= 0")
        _require(self.eval_steps >= 1, f"train.eval_steps={self.eval_steps} must be >= 1")
        _require(self.loss_chunks >= 1, f"train.loss_chunks={self.loss_chunks} must be >= 1")
        _require(self.progress_every_s >= 0, f"train.progress_every_s={self.progress_every_s} must be >= 0")


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
    """A directory of task YAML files of your own (README: Evaluation)."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"eval.every={self.every} must be >= 0")
        _require(self.limit is None or self.limit > 0, f"eval.limit={self.limit} must be > 0")
        _require(self.batch_size >= 1, f"eval.batch_size={self.batch_size} must be >= 1")
        _require(self.max_gen_toks >= 1, f"eval.max_gen_toks={self.max_gen_toks} must be >= 1")


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (torch.distributed.checkpoint) under train.out_dir/checkpoints/."""

    every: int = 0
    """Save every this many steps and after the last step (0 = never)."""
    keep_last: int = 3
    """Published checkpoints to keep; older ones are deleted (0 = keep all)."""
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
        _require(self.every >= 0, f"checkpoint.every={self.every} must be >= 0")
        _require(self.keep_last >= 0, f"checkpoint.keep_last={self.keep_last} must be >= 0")


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


@dataclass
class Recipe:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        _require(
            not (self.checkpoint.export_hf and self.lora.rank is not None),
            "checkpoint.export_hf writes the model without adapters; with lora.rank set, export with "
            "tools/consolidate.py RUN OUT (merged) or --lora adapter (PEFT)",
        )
        _require(
            self.lora.quantize_base is None or not self.parallel.cpu_offload,
            "lora.quantize_base nf4 does not run with parallel.cpu_offload yet; set one of them off",
        )
        tied = sorted({"lm_head", "embed_tokens"} & set(self.lora.targets)) if self.model.tied_output else []
        _require(
            self.lora.rank is None or not tied,
            f"lora.targets has {', '.join(tied)}, but model.tie_embeddings ties the output layer to the embedding: an "
            f"adapter on one could not be merged into the weight they share; leave {' and '.join(tied)} out",
        )
        _require(
            self.model.num_labels is None or (self.preference.loss is None and self.distill.teacher is None),
            "model.num_labels 1 trains a reward model (on preference pairs, as TRL's RewardTrainer); preference.loss "
            "and distill.teacher train a language model: set them null, or model.num_labels null",
        )
        _require(
            self.model.num_labels is None or not self.eval.tasks,
            "eval.tasks score a language model, and a reward model (model.num_labels) has no output layer: set "
            "eval.tasks []",
        )
        _require(
            self.model.num_labels is None or "lm_head" not in self.lora.targets,
            "lora.targets has lm_head, and a reward model (model.num_labels) has none: its score head trains whole; "
            "leave lm_head out",
        )
        _require(
            self.data.seq_len <= self.model.max_seq_len,
            f"data.seq_len={self.data.seq_len} must be <= model.max_seq_len={self.model.max_seq_len}",
        )
        _require(
            self.parallel.ac_every == 1 or self.parallel.activation_checkpointing != "none",
            f"parallel.ac_every={self.parallel.ac_every} needs parallel.activation_checkpointing full or selective",
        )


# `from __future__ import annotations` makes field types strings; resolve them once here.
SECTIONS = {f.name: globals()[f.type] for f in fields(Recipe)}
