"""The recipe's sections of fine-tuning methods: low-rank adapters, preference tuning (DPO's family, KTO), reward
models and distillation. As in sections.py, each key's attribute docstring is its `--help`, and each check fails in
its section's __post_init__ naming the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fsdp_trainer.config.sections import require

LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS = (*LORA_PROJECTIONS, "lm_head", "embed_tokens", "experts")


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
    when they are tied; `experts`: a mixture of experts' stacked gate_up_proj and down_proj, an adapter per expert
    (PEFT's target_parameters)."""
    quantize_base: Literal["nf4"] | None = None
    """QLoRA: store the frozen weights of the adapted projections in 4-bit NormalFloat (`nf4`, through torchao:
    about 0.52 bytes a weight instead of 2 in bf16), sharded in that form and dequantized one projection at a time
    in forward and backward; null keeps them in the compute dtype. Checkpoints and exports are unchanged: they hold
    the adapters, and an export merges them into the base's original weights, as PEFT does."""
    adapter: str | None = None
    """A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) to start the adapters from
    instead of their init, to train it further; its r, lora_alpha and target_modules must match the keys above."""

    def __post_init__(self) -> None:
        require(self.rank is None or self.rank >= 1, f"lora.rank={self.rank} must be >= 1, or null")
        require(0.0 <= self.dropout < 1.0, f"lora.dropout={self.dropout} must be in [0, 1)")
        unknown = sorted(set(self.targets) - set(LORA_TARGETS))
        require(not unknown, f"lora.targets has {unknown}; choose among {', '.join(LORA_TARGETS)}")
        require(bool(self.targets), "lora.targets is empty; name at least one of " + ", ".join(LORA_TARGETS))
        require(
            self.adapter is None or self.rank is not None,
            f"lora.adapter={self.adapter} needs lora.rank (the adapter's r)",
        )
        require(
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
        require(self.beta > 0, f"preference.beta={self.beta} must be > 0")
        for key in ("desirable_weight", "undesirable_weight"):
            require(getattr(self, key) > 0, f"preference.{key}={getattr(self, key)} must be > 0")
            require(getattr(self, key) == 1 or self.loss == "kto", f"preference.{key} applies to kto; set it to 1")
        require(
            0.0 <= self.label_smoothing < 0.5,
            f"preference.label_smoothing={self.label_smoothing} must be in [0, 0.5)",
        )
        require(
            self.label_smoothing == 0 or self.loss not in ("ipo", "orpo", "kto"),
            f"preference.label_smoothing applies to the sigmoid, robust and simpo losses, not {self.loss}; set it to 0",
        )
        require(self.nll_weight >= 0, f"preference.nll_weight={self.nll_weight} must be >= 0")
        require(
            self.nll_weight == 0 or self.loss != "orpo",
            "preference.nll_weight: ORPO's NLL term always weighs 1 (preference.beta weighs the odds-ratio term); "
            "set it to 0",
        )
        require(self.nll_weight == 0 or self.loss != "kto", "preference.nll_weight applies to pairs, not kto")
        require(
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
        require(
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
        require(0 < self.beta < 1 or self.loss != "jsd", f"distill.beta={self.beta}: jsd needs 0 < beta < 1")
        require(self.temperature > 0, f"distill.temperature={self.temperature} must be > 0")
        require(0 <= self.alpha <= 1, f"distill.alpha={self.alpha} must be in [0, 1]")
        require(0 <= self.lmbda <= 1, f"distill.lmbda={self.lmbda} must be in [0, 1]")
        require(self.max_new_tokens >= 1, f"distill.max_new_tokens={self.max_new_tokens} must be >= 1")
        require(self.sample_temperature >= 0, f"distill.sample_temperature={self.sample_temperature} must be >= 0")


@dataclass
class RewardFunction:
    """A reward of online RL: a function with TRL's reward signature, named by import path (rewards.py)."""

    function: str
    """`module:function`, e.g. fsdp_trainer.rewards:exact_answer, or a function of your own module (importable where
    training runs): f(prompts, completions, completion_ids, **columns) -> a float or None per completion."""
    weight: float = 1.0
    """Its weight in the sum of the rewards (TRL's reward_weights)."""
    args: dict = field(default_factory=dict)
    """Keyword arguments bound to it (a factory's settings: overlong_penalty's max_length and buffer)."""


@dataclass
class GRPOConfig:
    """Online RL with verifiable rewards (GRPO, Shao et al. 2024, and its family), as TRL's GRPOTrainer defines it:
    each step the model being trained samples num_generations completions of each prompt (prepared with
    prepare_data.py --format prompts; a micro-batch holds data.micro_batch_size prompts), the reward functions
    score them, each completion's advantage is its reward against its group's, and the loss is PPO's clipped
    surrogate of the completions' tokens (loss.PolicyLoss). Off unless reward functions are named."""

    rewards: list[RewardFunction] = field(default_factory=list)
    """The reward functions, summed with their weights; none (and no reward_model): not an online-RL run."""
    reward_model: str | None = None
    """A reward model of ours (a checkpoint or run directory of a reward recipe, model.num_labels 1) scoring each
    completion as one more reward, `reward_model`: held frozen and sharded beside the policy, reading the prompt and
    the completion's text rendered with its own tokenizer and chat template (tools/score.py's score)."""
    reward_model_weight: float = 1.0
    """Its weight in the sum of the rewards."""
    num_generations: int = 8
    """Completions sampled per prompt (G), whose rewards are each other's baseline."""
    max_completion_length: int = 256
    """The longest completion sampled (fewer where the prompt leaves less of data.seq_len); a completion ends sooner
    at the chat template's end-of-turn token or the tokenizer's EOS, which it keeps."""
    temperature: float = 1.0
    """The temperature completions are sampled at, and the log-probabilities of the loss are taken at (TRL's)."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the fewest most likely tokens whose probabilities reach top_p (1: all)."""
    top_k: int = 0
    """Draw from the top_k most likely tokens (0: all)."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo"] = "dapo"
    """How the token losses are averaged (TRL's loss_type): grpo over each completion's tokens, then over the
    completions (length-biased); bnpo over a micro-batch's tokens; dr_grpo over completions x max_completion_length
    (Dr. GRPO, Liu et al. 2025); dapo over the global batch's tokens (DAPO, Yu et al. 2025; TRL's default); cispo:
    the clipped importance-sampling weight times the log-probability (MiniMax-M1), averaged as dapo."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: a ratio per token (GRPO); sequence: a completion's mean log-ratio, one ratio for all its tokens (GSPO,
    Zheng et al. 2025)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """An advantage is a reward minus its group's mean, divided by the std of the group (group), of the whole global
    batch (batch), or not divided (none: Dr. GRPO)."""
    epsilon: float = 0.2
    """The clip's lower bound: ratios below 1 - epsilon give no gradient where the advantage is negative."""
    epsilon_high: float | None = None
    """The clip's upper bound, 1 + epsilon_high (DAPO's clip-higher: 0.28); null: epsilon. cispo: the weight's cap
    (ScaleRL's 5.0)."""
    beta: float = 0.0
    """The weight of the KL to the reference (the model the run started from; TRL's default 0: no reference is held).
    With LoRA the reference is the same weights with the adapters off."""
    use_bias_correction_kl: bool = True
    """beta > 0: the KL term is weighted by the ratio, so its gradient is unbiased off-policy (TRL's default)."""
    mask_truncated_completions: bool = False
    """A completion cut at max_completion_length (no end-of-turn token) trains on nothing (DAPO); it still counts in
    its group's rewards and in the loss's averages."""
    share_prompts: bool = True
    """Train each prompt once for its completions: a group packed as a tree, each completion after the prompt and
    seeing it (model.block_causal's `shared`), not after a copy of it each: the same log-probs, fewer tokens."""
    steps_per_generation: int = 1
    """Optimizer steps each sampling feeds: a step that samples reads the prompts of this many steps at once and each
    of those steps trains on its share of the completions (TRL's steps_per_generation divided by its
    gradient_accumulation_steps); above 1, every step after the first is off-policy and its ratios are taken against
    the log-probs the policy gave the completions when they were sampled."""
    num_iterations: int = 1
    """Passes over each sampling's completions (the GRPO paper's mu): its steps_per_generation steps are trained
    num_iterations times over, the ratios against the log-probs at sampling."""
    dynamic_sampling: bool = False
    """Drop the groups whose rewards are all equal (advantages 0: they teach nothing) and sample the prompts of further
    global batches until the groups whose rewards differ fill the sampling; the surplus is dropped (DAPO's dynamic
    sampling, Yu et al. 2025)."""
    dynamic_sampling_batches: int = 8
    """dynamic_sampling: the most extra global batches a sampling reads; then alike groups fill what is left."""
    sampler_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "none"
    """Weigh each token's loss by exp(the trainer's log-prob - the sampler's), per token or per completion (summed),
    clipped to [sampler_correction_min, sampler_correction_max] (truncate) or zeroed outside it (mask): TRL's
    vllm_importance_sampling_mode. In fp32 the ratio is 1 to float noise; in bf16 the KV-cache decode and the
    whole-window forward round differently (up to ~0.2 a token): token_truncate corrects it, for one forward without
    gradient of the completions at sampling."""
    sampler_correction_min: float | None = None
    """The ratios' lower bound (null: none)."""
    sampler_correction_max: float | None = 3.0
    """The ratios' upper bound (TRL's 3.0; null: none)."""

    def __post_init__(self) -> None:
        check_grpo(self)


def check_grpo(cfg: GRPOConfig) -> None:
    """The grpo section's keys, each in the line a user reads (config.sections.require)."""
    require(cfg.num_generations >= 2, f"grpo.num_generations={cfg.num_generations}: a group needs at least 2")
    n = cfg.max_completion_length
    require(n >= 1, f"grpo.max_completion_length={n} must be >= 1")
    require(cfg.temperature > 0, f"grpo.temperature={cfg.temperature} must be > 0 (sampling, not greedy)")
    require(0 < cfg.top_p <= 1, f"grpo.top_p={cfg.top_p} must be in (0, 1]")
    require(cfg.top_k >= 0, f"grpo.top_k={cfg.top_k} must be >= 0 (0: no top-k)")
    require(cfg.epsilon > 0, f"grpo.epsilon={cfg.epsilon} must be > 0")
    require(cfg.beta >= 0, f"grpo.beta={cfg.beta} must be >= 0")
    for name in ("steps_per_generation", "num_iterations", "dynamic_sampling_batches"):
        require(getattr(cfg, name) >= 1, f"grpo.{name}={getattr(cfg, name)} must be >= 1")
    for k, reward in enumerate(cfg.rewards):
        require(
            reward.function.count(":") == 1 and all(reward.function.split(":")),
            f"grpo.rewards[{k}].function={reward.function!r} is not an import path: write it as module:function",
        )
