"""How much does a row hold and send? The memory per rank and the bytes sent per step of one sharding x
activation-checkpointing choice of a recipe (a planner row, `Estimate`); planner/plan.py compares the rows.

The terms, per rank, for P parameters, S ranks sharing one copy of the model (the world for FULL_SHARD, SHARD_GRAD_OP
and SHARD_OP, 1 for NO_SHARD, the ranks of a node for HYBRID_SHARD), a = 2 bytes (bf16) or 4 (fp32), t =
micro_batch_size x seq_len tokens, d / kv / f the model, key-value and feed-forward widths, V the vocabulary:

- training state: fp32 weights 4P/S + fp32 gradients 4P/S + AdamW moments 8P/S (the ZeRO formulas); the step frees
  the gradients before its forward, so without accumulation their shard exists only from backward's first reduction
  on: the forward, the logits and the first block's backward see the state without it (1B on 8 ranks, every row but
  NO_SHARD with full AC: 0.99-1.00 of the step on fake tensors, 1.03-1.18 with the shard counted there);
- buffers: the model's, whole on every rank and on the device with offload too (the rotary tables, fp32:
  2 x max_seq_len x head_dim, 0.13 GB for Llama 3.1's 131,072 positions);
- LoRA (lora.rank): the frozen weights are held in the compute dtype, a bytes each, with no gradient or optimizer
  state, and only the adapters' gradients are reduced; QLoRA (lora.quantize_base nf4) holds, gathers and sends the
  adapted projections in NF4, 0.52 bytes a weight (4 bits and an 8-bit scale per 64), and dequantizes one projection
  at a time to a bytes a weight for its matmul, torchao's eager dequantization holding 8 + 3a bytes a weight while it
  runs (adapters.nf4.dequantization_peak_bytes; the 8B's up projection, 14 bytes a weight: 0.82 GB, where a few
  tokens' step peaks: 4 blocks of 256 tokens under NO_SHARD, 0.81 of the step on fake tensors with a bytes a weight);
- gathered parameters: FSDP's unsharded compute copies, a bytes each: the current block and the
  parallel.prefetch_blocks prefetched ones plus the root (embedding, lm_head), or every block for SHARD_GRAD_OP,
  SHARD_OP and NO_SHARD, which keep them from forward to backward; at the first block's gather, before any
  activation, FSDP2 holds the root's all-gather output (kept until the next is copied out) and the block's beside
  their unsharded copies: 2a x (root + block), the peak where the output layer is large against the activations;
  each block frees its gathered weights after its backward, whatever it kept from forward, so from the last block's
  backward on only the root and that block are gathered (1B on 8 ranks, NO_SHARD with full AC, whose peak is the
  end of backward: 1.07 of the step, 1.18 with every block gathered there); while the loss runs, after the last
  block's forward and before the first block's backward gathers the next, FULL_SHARD and HYBRID_SHARD hold only the
  root and the last block, and FSDP2 keeps the last block's all-gather output until the root's forward returns, so
  after the loss's forward (qwen3_30b_a3b_lora.yaml at two blocks, SHARD_GRAD_OP without AC: 0.93 of the step on fake
  tensors without that output, 0.99 with it); and while the last block's gather is copied out, the previous block's
  output is held beside it (`wait_for_unshard` frees it on returning), before that block's activations exist (the
  same recipe at eight blocks of 512 tokens, FULL_SHARD without AC: 0.89 without, 0.98 with); a shard group of one
  gathers by copying from the shard, with no output to hold;
- activations saved for backward, per layer and token (q = d unless head_dim is set): (8d + 4q + 4kv + 6f) bytes
  in bf16 and (16d + 8q + 8kv + 12f) in fp32 without AC (what model.py's block saves: planner/activations.py), and
  with Qwen3's QK-norm 2(q + kv) more in bf16, 4(q + kv) in fp32;
  a*d with full AC, and a*(3d + 2q + 2kv + 2f) with selective AC (block input plus the matmul and attention outputs),
  with LoRA a*r more for each adapted projection (its adapter's A, rank r), and a*o (its B, output width o) where
  B widens no more than parallelize.WIDENING (8x); with adapters on a mixture's experts and no AC, each layer keeps
  its factors' copies too, whatever its tokens (activations.adapter_copies_per_block: 0.7 GB over Qwen3-30B-A3B's 48
  layers, what 1 x 512 tokens' activations missed against the fake step); and a sliding window shorter than the
  sequence, attended eagerly (a CPU, a GPU without compile), T x T x a once for every windowed layer
  (activations.attention_mask_bytes: Gemma 3 1B at 2 blocks of 16,384 tokens, 0.94 of the fake step without it);
- logits: t x V x 12 bytes at the start of backward: the fp32 log-softmax saved by the loss, the gradient that reaches
  it and the gradient it passes on (in forward, 8: the fp32 logits and their log-softmax, the compute-dtype logits
  freed once cast, but beside the last block's all-gather output); with train.loss_chunks = c, one slice's worth,
  ceil(t / c) x V x 12 (8 in forward), since each slice is made, used and freed in turn, in forward and again in
  backward. Beside it, when the output layer trains, its unsharded weight gradient (a x V x d), which every slice's
  backward adds into: the largest of a slice's 12 bytes with it, 8 with it twice (a slice's own weight gradient before
  it is added), and it three times (the two summed into a new one: small slices). Measured on fake tensors
  (Qwen3-0.6B, slices of 512-2,048 tokens, bf16 and fp32, full fine-tuning and LoRA): within 1.5%; slices of 16 tokens
  of 65,536 classes at width 256 in fp32: exact;
- block backward: one block's worth of activation gradients, and under AC one more for the block being recomputed,
  beside the output layer's weight gradient (a x V x d when it trains, kept for the root's reduction) and the
  previous block's gradients in their fp32 reduce-scatter input (4 x block parameters, trained ones), which FSDP2
  keeps until the next reduction; it comes after the logits are freed, so the peak counts the larger of the two (the
  8B's widths with a 32,000-token vocabulary, full AC, 64 ranks: 0.89 of the step on fake tensors without the two,
  1.03 with them);
- gradient buffers: at the end of backward, when the activations and logits are gone, the root's unsharded
  gradients awaiting reduction, a bytes per parameter plus an fp32 copy in bf16 (its reduce-scatter input), beside
  the last block's fp32 reduce-scatter input still in flight; FSDP2 frees the root's gathered weights before reducing
  its gradients, as every block's, so nothing gathered is left then (the 8B with full AC on 64 ranks: 1.15-1.17 of
  the step on fake tensors with the gathered root and a block's unsharded gradients counted, 1.02-1.04 without);
  before that, a tied output layer that trains has the embedding's backward sum its two weight gradients into a
  third (3a x V x d) beside the gathered root, before the root's gradient shard exists (the 125m recipe at 4 blocks
  of 256 tokens, full AC, 8 ranks: 0.91 of the step without that moment, 1.00 with it);
- accumulated gradients, with grad_accum_steps > 1 in the sharded modes: where gradients are accumulated unsharded
  (SHARD_OP always; FULL_SHARD, SHARD_GRAD_OP and HYBRID_SHARD with parallel.accumulate_unsharded), FSDP keeps every
  micro-step's in fp32 until the last one reduce-scatters them, 4P, while the gradient shard the state counts holds
  nothing (the step frees gradients first): 4P - 4P/S beyond the state (4P with offload, the shard being the host's);
  where each micro-step's are reduce-scattered into the shards, nothing beyond the state's (HSDP across nodes holds
  the micro-steps' sum of shards awaiting the all-reduce in the shard's place: 4P/S with offload);
- offload (parallel.cpu_offload, GPUs only): the training state moves to host memory (`host`), and the fp32 shards
  cross to the device before every all-gather and their fp32 gradients back at every reduction: (4G + 4rP)/S bytes
  per step each way taken together, G the parameters gathered per step (below), r the reductions a step (k where
  each micro-step's gradients are reduced, else 1) (`host<->device`); the device keeps the rest;
- optimizer step: what the step allocates, after backward has freed the activations and gradient buffers (so the
  peak counts the largest of the three): nothing for fused AdamW; Muon's exchange of whole matrices about 12 bytes
  per matrix weight / S (the rows sent and received, the matrices a rank owns, fp32) plus one matrix's iteration;
- runtime: what a process holds before training (CPU: ~0.35 GB of libraries and buffers, measured; CUDA: the
  context, ~0.5 GB, which max_memory_allocated does not count and this table does).

Communication, bytes a rank sends per optimizer step with k = grad_accum_steps (ring collectives send (W-1)/W of a
buffer per rank, W the ranks taking part): ZeRO-3 all-gathers the parameters in forward and, but for the last block
and the root (kept gathered between the two), again in backward on every micro-step, in the compute dtype, and
reduce-scatters fp32 gradients every micro-step: k(a(P + R) + 4P)(W-1)/W, R = (layers - 1) x block parameters; ZeRO-2
gathers once per micro-step: k(a + 4)P(W-1)/W; accumulated unsharded (parallel.accumulate_unsharded), either
reduce-scatters once a step: 4P(W-1)/W instead of k times that; ZeRO-1 (SHARD_OP) gathers once per step, keeping the
parameters over the micro-steps, and reduce-scatters once: (a + 4)P(W-1)/W whatever k; DDP all-reduces fp32 gradients
once: 8P(W-1)/W; HYBRID_SHARD is ZeRO-3 within a node plus an all-reduce of the node's gradient shard across nodes
once a step, the only bytes that cross the network, each rank's through its own NIC. A ring over the ranks of several
nodes leaves each node once; NCCL runs one ring a NIC (a NIC a GPU), so a rank's NIC carries 1/(GPUs a node) of what
the rank sends, the rest going over NVLink. These are the collectives tests/test_collectives.py counts, one by one.
Without accumulation, in one dtype ZeRO-3 sends about 1.5x DDP; with bf16 compute and fp32 reduction the two are about
equal.

Validated against peak memory measured on CPU (docs/benchmarks.md); treat GPU figures as a plan, not a promise:
allocator fragmentation typically adds 5-10%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdp_trainer.adapters import quantizes_base, read_only_meta_model
from fsdp_trainer.adapters.lora import LoRALinear
from fsdp_trainer.adapters.nf4 import BYTES_PER_VALUE as NF4_BYTES
from fsdp_trainer.adapters.nf4 import dequantization_peak_bytes
from fsdp_trainer.config import ModelConfig, Recipe, compute_dtype
from fsdp_trainer.distributed.expert_parallel import SHARDINGS as EP_SHARDINGS
from fsdp_trainer.distributed.parallelize import SHARDING, ShardingPlan, sharding_plan
from fsdp_trainer.distributed.runtime import precision_on
from fsdp_trainer.generation import sampling_bytes
from fsdp_trainer.model import Transformer, count_params
from fsdp_trainer.moe import moe_layers
from fsdp_trainer.optim import GRADIENT_BYTES, MASTER_WEIGHT_BYTES, optimizer_state_bytes, optimizer_step_bytes
from fsdp_trainer.planner.activations import (
    activation_bytes_per_token,
    adapter_copies_per_block,
    attention_mask_bytes,
    context_parallel_bytes,
    rank_tokens,
)
from fsdp_trainer.steps import training_kind

RUNTIME_GB = {"cpu": 0.35, "cuda": 0.5}  # the runtime term (module docstring)


@dataclass
class Estimate:
    sharding: str
    ac: str
    state_gb: float
    gathered_gb: float
    activations_gb: float
    logits_gb: float
    backward_gb: float
    grad_buffers_gb: float
    runtime_gb: float
    sent_gb: float  # per rank per optimizer step
    internode_gb: float  # of which between nodes
    accumulated_gb: float = 0.0  # fp32 gradients held over the micro-steps of a step beside the state's
    optimizer_step_gb: float = 0.0  # allocated for the optimizer step (Muon's exchange of whole matrices)
    offload: bool = False  # parallel.cpu_offload: the training state in host memory
    host_gb: float = 0.0  # of which held in host memory instead (offload on a GPU)
    host_traffic_gb: float = 0.0  # host<->device copies per optimizer step (offload on a GPU)
    reference_gb: float = 0.0  # a full fine-tuning preference run's frozen reference model, sharded
    quantized: int = 0  # weights held in NF4 (QLoRA), each dequantized for its matmuls
    frozen_forward: float = 0.0  # the kind's forwards without gradient (a reference's, a teacher's), in policies
    copy_out_gb: float = 0.0  # beyond `gathered`, the all-gather outputs held at the first block's gather
    buffers_gb: float = 0.0  # the model's buffers (its rotary tables): whole on every rank, on the device
    late_gradients_gb: float = 0.0  # of the state: the gradient shard no forward of a step sees (gradients_later)
    block_activations_gb: float = 0.0  # of the activations: one block's, the last to run backward
    gathered_late_gb: float = 0.0  # of the gathered: what is left once every block but the last has run backward
    gathered_loss_gb: float = 0.0  # of the gathered: what the loss runs beside (the root and the last block, or all)
    last_gather_gb: float = 0.0  # the last block's all-gather output, held until the root's forward returns
    last_copy_out_gb: float = 0.0  # the last two blocks' all-gather outputs, held at the last one's copy-out
    logits_forward_gb: float = 0.0  # one slice's logits in the loss's forward
    attention_mask_gb: float = 0.0  # of the activations: a sliding window's mask, until the first block's backward
    sampling_gb: float = 0.0  # an online kind's sampling before the step: the model whole, a KV cache, logits

    @property
    def total_gb(self) -> float:
        # The saved activations are all alive when backward starts, next to the logits' memory (freed once the output
        # layer's backward is done) and then next to one block's backward (recomputation, activation gradients); the
        # root's unsharded gradients are largest at the end, by which time the activations and every gathered weight
        # are freed (the root's too, before its reduction), and the optimizer step's own allocations come after that.
        # The last block's gather holds the previous block's all-gather output beside its own until its copy-out is
        # done; the loss's forward runs beside the last one's, its backward after FSDP2 has freed it.
        # Before any activation exists, the first block's gather holds the root's and the block's all-gather outputs
        # beside their unsharded copies (copy_out_gb): the peak of a large output layer over shallow or checkpointed
        # blocks. Until backward reduces the first gradients, their shards may not exist yet (late_gradients_gb); by
        # the last block's backward they all do, beside that block's activations alone, and every other block has
        # freed its gathered weights (FSDP reshards each after its backward, whatever it kept from forward).
        # An online kind samples before its first forward, with nothing else gathered and no gradient yet: the model
        # gathered whole, the last two blocks' all-gather outputs held as the last is copied out.
        held = self.state_gb + self.reference_gb + self.gathered_gb + self.accumulated_gb + self.buffers_gb
        early = held - self.late_gradients_gb
        ungathered = held - self.gathered_gb
        late = ungathered + self.gathered_late_gb
        at_loss = early - self.gathered_gb + self.gathered_loss_gb + self.activations_gb
        peak = max(
            at_loss - self.block_activations_gb + self.last_copy_out_gb,
            at_loss + self.last_gather_gb + self.logits_forward_gb,
            at_loss + self.logits_gb,
            early + self.activations_gb + self.backward_gb,
            late + self.block_activations_gb + self.attention_mask_gb + self.backward_gb,
            ungathered + self.grad_buffers_gb,
            late + self.optimizer_step_gb,
            early + self.copy_out_gb,
            early - self.gathered_gb + self.sampling_gb + self.last_copy_out_gb,
        )
        return peak + self.runtime_gb

    def fits(self, device_mem_gb: float, host_mem_gb: float = math.inf) -> bool:
        return self.total_gb <= device_mem_gb and self.host_gb <= host_mem_gb


def gathered_per_step(sharding: str, accum: int, n_params: int, regathered: int) -> int:
    """Parameters a rank all-gathers per optimizer step (elements of the gathered outputs): all of them in forward on
    every micro-step and, where they are freed after forward, the `regathered` ones again in backward (every block but
    the last: the root and the last block stay gathered between the two); ZeRO-1 keeps them over the step and gathers
    once, whatever the accumulation. tests/test_collectives.py counts the same collective by collective."""
    plan = SHARDING[sharding]
    per_micro_step = n_params + (regathered if plan.reshard_after_forward else 0)
    return per_micro_step if plan.gathered_for_the_step else per_micro_step * accum


def regathered_in_backward(cfg: ModelConfig) -> int:
    """Parameters FSDP gathers again in backward after freeing them in forward (ZeRO-3): every block but the last."""
    return (cfg.n_layers - 1) * count_params(cfg, one_block=True)


def comm_bytes_per_rank(
    sharding: str,
    n_params: int,
    compute_bytes: float,
    accum: int,
    nproc: int,
    nnodes: int,
    regathered: int,
    trainable: int | None = None,
    accumulate_unsharded: bool = False,
) -> tuple[float, float]:
    """(bytes one rank sends per optimizer step, of which between nodes): see the module docstring.

    Within a shard group of S ranks, parameters are all-gathered in the compute dtype (`compute_bytes` each; QLoRA:
    fewer, on average) on every micro-step (in forward, and `regathered` of them again in backward when freed after
    forward: gathered_per_step) and fp32 gradients reduce-scattered every micro-step or, accumulated unsharded, once;
    across R replicas, each rank all-reduces its fp32 gradient shard once. A ring collective sends (n-1)/n of its
    buffer. Only the `trainable` parameters (default: all; LoRA: the adapters) have gradients to reduce.
    """
    plan = sharding_plan(sharding, accumulate_unsharded)
    replicas, shard_group = plan.mesh_shape(nproc * nnodes, nproc)
    trainable = n_params if trainable is None else trainable
    sent = replicas_sent = 0.0
    if shard_group > 1:
        gathered = compute_bytes * gathered_per_step(sharding, accum, n_params, regathered)
        sent += (gathered + plan.reductions(accum) * GRADIENT_BYTES * trainable) * (shard_group - 1) / shard_group
    if replicas > 1:
        replicas_sent = 2 * GRADIENT_BYTES * (trainable / shard_group) * (replicas - 1) / replicas  # all-reduce
        sent += replicas_sent
    if nnodes == 1:
        return sent, 0.0
    # Replicas one per node: only their all-reduce crosses the network, each rank's shard through its own NIC. A ring
    # over all ranks crosses it once a node: NCCL runs a ring a NIC, each rank leaving the node on one of them, so a
    # rank's NIC carries 1/nproc of what it sends.
    return sent, replicas_sent if plan.replicas == "per_node" else sent / nproc


def expert_parallel_bytes(
    recipe: Recipe, sharding: str, a: int, ac: str, nproc: int, nnodes: int, tokens: int
) -> tuple[float, float, float]:
    """Under expert parallelism (parallel.expert_parallel N > 1: distributed/expert_parallel.py), against the same row
    without it: (the weights of a block a rank does not gather, so neither holds nor reduces unsharded, bytes a rank
    sends more a step, of which between nodes: the experts' shard groups take a rank of each node's groups). A rank
    gathers and reduces only its group's 1 / N of each layer's experts (and of their LoRA adapters), over the S / N
    ranks holding them instead of all S; and each mixture of experts layer moves a micro-batch's `tokens` x top_k
    copies (dim wide) to their experts and back by all-to-all, (N - 1) / N of them off the rank with even routing, in
    forward and again in backward (the gradients), and once more where AC recomputes the layer. The same state per
    rank: every expert is still held once over the world."""
    n, cfg, accum = recipe.parallel.expert_parallel, recipe.model, recipe.data.grad_accum_steps
    if n == 1 or cfg.moe is None or sharding not in EP_SHARDINGS:
        return 0.0, 0.0, 0.0
    layers, lora = len(moe_layers(cfg)), recipe.lora
    experts = layers * cfg.moe.experts * 3 * cfg.moe.ffn_dim * cfg.dim
    adapters = 0  # LoRA's on the experts, split with them: A and B of gate_up (dim -> 2 ffn) and of down (ffn -> dim)
    if lora.rank is not None and "experts" in lora.targets:
        adapters = layers * cfg.moe.experts * lora.rank * (2 * cfg.dim + 3 * cfg.moe.ffn_dim)
    trained = experts if lora.rank is None else adapters
    experts += adapters
    regathered = experts * (cfg.n_layers - 1) // cfg.n_layers
    unsharded = recipe.parallel.accumulate_unsharded
    whole = comm_bytes_per_rank(sharding, experts, a, accum, nproc, nnodes, regathered, trained, unsharded)
    split = comm_bytes_per_rank(sharding, experts // n, a, accum, nproc // n, nnodes, regathered // n,
                                trained // n, unsharded)  # fmt: skip
    copies = accum * all_to_all_elements(cfg, ac, tokens) * a * (n - 1) / n
    return experts / cfg.n_layers * (n - 1) / n, split[0] - whole[0] + copies, split[1] - whole[1]


def all_to_all_elements(cfg: ModelConfig, ac: str, tokens: int) -> int:
    """The elements a rank's micro-batch of `tokens` puts into expert parallelism's all-to-alls (summed over the ranks,
    exactly; per rank, with even routing): each MoE layer's token copies (top_k a token, dim wide) dispatched and
    combined in forward, their gradients the same way back, and once more where AC recomputes the layer."""
    return len(moe_layers(cfg)) * (4 + 2 * (ac != "none")) * tokens * cfg.moe.top_k * cfg.dim


def accumulated_gradient_bytes(
    plan: ShardingPlan, accum: int, trainable: int, world: int, per_node: int, offload: bool = False
) -> float:
    """Gradient bytes a rank holds over a step's micro-steps beyond the gradient shard the state counts (the
    `accumulated` term), with accumulation in a sharded mode. Waiting for the last micro-step's reduction: the whole
    model's unsharded fp32 gradients where they are accumulated unsharded, or, reduced every micro-step under HSDP
    across nodes, the node's sum of shards awaiting the all-reduce. The step frees gradients first, so until that
    reduction the shard the state counts holds nothing on the device (offloaded, it is the host's)."""
    replicas, shard_group = plan.mesh_shape(world, per_node)
    if accum == 1 or shard_group == 1:
        return 0.0
    if not plan.reduce_every_micro_step:
        waiting = trainable
    else:
        waiting = trainable / shard_group if replicas > 1 else 0.0
    return GRADIENT_BYTES * max(0.0, waiting - (0.0 if offload else trainable / shard_group))


def gradient_buffer_bytes(
    meta: Transformer, a: int, n_root: int, n_block: int, trained_share: float, shard_group: int
) -> float:
    """The end of backward: the root's unsharded gradients awaiting their reduction, in the compute dtype plus, in
    bf16, an fp32 copy (its reduce-scatter input), beside the last block's fp32 reduce-scatter input still in flight
    (of each, the `trained_share` that trains). With a tied output layer that trains, the embedding's backward before
    it holds more: the embedding's weight gradient and the output layer's, summed into a third (autograd adds a
    weight's two gradients out of place), beside the root's gathered weights, and before the root's gradient shard
    exists (the state counts it)."""
    in_flight = GRADIENT_BYTES * n_block * trained_share
    root = (a + (GRADIENT_BYTES if a < GRADIENT_BYTES else 0)) * n_root * trained_share
    tied = head_gradient_bytes(meta, a) if meta.output_layer.weight is meta.model.embed_tokens.weight else 0
    if tied:
        root = max(root, a * n_root + 3 * tied - GRADIENT_BYTES * n_root * trained_share / shard_group)
    return root + in_flight


def gradients_later(accum: int, trainable: int, shard_group: int, offload: bool) -> float:
    """Bytes of the gradient shard the state counts that exist only from a step's first reduction on: the step frees
    gradients before its forward (train.train_step), so without accumulation its forward, its logits and the first
    block's backward see none; with it, every micro-step after the first sees the shard (or what `accumulated` holds
    in its place). Offloaded, the shard is the host's."""
    return 0.0 if accum > 1 or offload else GRADIENT_BYTES * trainable / shard_group


def unit_bytes(meta: Transformer, n_block: int, n_root: int, n_layers: int, a: int, quantized: int) -> tuple[int, int]:
    """Bytes of one block's and of the root's gathered parameters: the compute dtype's `a` a weight, and NF4's for the
    `quantized` weights of QLoRA's projections (the blocks', and the output layer, the root's, when adapted)."""
    quantized_root = meta.output_layer.weight.numel() if quantized and isinstance(meta.output_layer, LoRALinear) else 0
    quantized_block = (quantized - quantized_root) // n_layers
    block = a * (n_block - quantized_block) + NF4_BYTES * quantized_block
    return block, a * (n_root - quantized_root) + NF4_BYTES * quantized_root


def buffer_bytes(meta: Transformer) -> int:
    """The model's buffers (its rotary tables), whole on every rank and on the device, offloaded or not."""
    return sum(b.numel() * b.element_size() for b in meta.buffers())


def head_gradient_bytes(meta: Transformer, a: int) -> int:
    """The output layer's unsharded weight gradient, when it trains: made by the loss's backward, it waits for the
    root's reduction at the end of backward."""
    return a * meta.output_layer.weight.numel() if meta.output_layer.weight.requires_grad else 0


def block_backward_bytes(meta: Transformer, tokens: int, full: int, recomputed: bool, a: int, trained: float) -> float:
    """A block's backward: the gradients of its activations (about one block's worth, `full` bytes a token) and,
    recomputed under AC, its activations again; beside them the output layer's weight gradient and the previous
    block's `trained` gradients in their fp32 reduce-scatter input, which FSDP2 keeps until the next reduction."""
    return tokens * full * (2 if recomputed else 1) + head_gradient_bytes(meta, a) + GRADIENT_BYTES * trained


def slice_logits(meta: Transformer, tokens: int, chunks: int) -> int:
    """Logits of one of the loss's `chunks` slices of `tokens` (train.loss_chunks): its tokens x the classes."""
    return math.ceil(tokens / chunks) * meta.output_layer.weight.shape[0]


def logits_bytes(meta: Transformer, tokens: int, chunks: int, a: int) -> int:
    """The output layer's backward: one slice's logits (12 bytes a token and class), and beside them, when the layer
    trains, its weight gradient that every slice's backward adds into: twice while a slice's own exists, and three
    times while the two are summed into a new one (the peak of small slices)."""
    logits_slice = slice_logits(meta, tokens, chunks)
    head_gradient = head_gradient_bytes(meta, a)
    return max(12 * logits_slice + head_gradient, 8 * logits_slice + 2 * head_gradient, 3 * head_gradient)


def held_all_gather_outputs(block_bytes: float, shard_group: int, n_layers: int) -> tuple[float, float]:
    """The all-gather outputs FSDP2 holds in forward beyond the gathered weights: (after the last block's gather, its
    output, kept until the root's forward returns; during that gather's copy-out, the previous block's too, which
    `wait_for_unshard` frees only on returning). A shard group of one gathers by copying from the shard: none."""
    if shard_group == 1:
        return 0.0, 0.0
    return block_bytes, 2 * block_bytes if n_layers > 1 else 0.0


def logits_forward_bytes(meta: Transformer, tokens: int, chunks: int) -> int:
    """The loss's forward on one slice: its fp32 logits and their log-softmax, 8 bytes a token and class (the
    compute-dtype logits are freed once cast; in fp32 the cast is the same tensor)."""
    return 8 * slice_logits(meta, tokens, chunks)


def kind_costs(
    recipe: Recipe, n_params: int, trainable: int, gathered_bytes: float, shard_group: int, a: int
) -> tuple[int, float, float, int]:
    """What the training kind adds to a row: (the parameters it runs forward without gradient a micro-step, the bytes
    a rank sends for them and its sampling a step, its frozen models' bytes a rank, its sampling's bytes).

    A preference run's reference: each forward without gradient before the policy's, every micro-step, gathers its
    weights again (the policy's own with adapters off, or a frozen copy's), whose frozen weights it holds in the compute
    dtype, sharded; their gathered blocks are freed before the policy's; what it keeps gathered through the policy's
    forward and backward (a teacher's output layer) holds the other shards too. An online kind gathers the model whole
    once for all of a step's sampling (in a share of the steps)."""
    kind, other_shards = training_kind(recipe), (shard_group - 1) / shard_group
    forward, sampling = kind.forward_params(recipe, n_params), kind.sampling(recipe)
    sent = gathered_bytes * (forward * recipe.data.grad_accum_steps + n_params * (sampling.share if sampling else 0))
    reference = a * kind.frozen_params(recipe, n_params, trainable < n_params) / shard_group
    reference += a * kind.held_gathered_params(recipe) * other_shards
    sampled = sampling_bytes(recipe.model, sampling, a) if sampling else 0
    return forward, sent * other_shards, reference, sampled


def estimate(
    recipe: Recipe, nproc: int, nnodes: int, sharding: str, ac: str, device: str, offload: bool = False
) -> Estimate:
    cfg, data = recipe.model, recipe.data
    unsharded, accum = recipe.parallel.accumulate_unsharded, data.grad_accum_steps
    run_plan = sharding_plan(sharding, unsharded)
    _, shard_group = run_plan.mesh_shape(nproc * nnodes, nproc)
    on_host = offload and device == "cuda"  # on a CPU, host and device are one memory: offload moves nothing
    a = compute_dtype(precision_on(recipe.parallel.mixed_precision, device)[0]).itemsize  # auto: as a run would
    n_block = count_params(cfg, one_block=True)
    n_root = count_params(cfg) - cfg.n_layers * n_block
    tokens, prefetch, cp = rank_tokens(recipe), recipe.parallel.prefetch_blocks, recipe.parallel.context_parallel
    meta = read_only_meta_model(cfg, recipe.lora)  # frozen weights (adapters): no gradient, no optimizer state
    n_params = sum(p.numel() for p in meta.parameters())
    trainable = sum(p.numel() for p in meta.parameters() if p.requires_grad)
    optimizer = optimizer_state_bytes(recipe.optim, meta)
    optimizer_step = optimizer_step_bytes(recipe.optim, meta, shard_group)
    # QLoRA: the adapted projections' frozen weights in NF4, held, gathered and sent in that form; each is
    # dequantized for its matmul, one at a time, inside a block's forward and backward (priced in its backward).
    projections = [m.weight.numel() for m in meta.modules() if isinstance(m, LoRALinear)]
    quantized = sum(projections) if quantizes_base(recipe.lora) else 0
    dequantized = dequantization_peak_bytes(a) * max(projections) if quantized else 0
    # Frozen weights (LoRA) are held in the compute dtype, as they are gathered: no fp32 master copy to keep.
    held = MASTER_WEIGHT_BYTES * trainable + a * (n_params - trainable - quantized) + NF4_BYTES * quantized
    state = (held + GRADIENT_BYTES * trainable + optimizer) / shard_group
    # Parameters freed after forward are gathered a block (and its prefetched ones) at a time; kept ones all stay.
    kept_blocks = min(1 + prefetch, cfg.n_layers) if run_plan.reshard_after_forward else cfg.n_layers
    block_bytes, root_bytes = unit_bytes(meta, n_block, n_root, cfg.n_layers, a, quantized)
    elsewhere, ep_sent, ep_internode = expert_parallel_bytes(recipe, sharding, a, ac, nproc, nnodes, tokens)
    block_bytes, n_block = block_bytes - a * elsewhere, n_block - elsewhere  # a block's weights this rank gathers
    gathered = kept_blocks * block_bytes + root_bytes
    first_gathers = root_bytes + block_bytes  # the root's, then the first block's
    if shard_group == 1 and not offload and trainable < n_params:
        # Frozen weights stay outside FSDP in a shard group of one (parallelize.apply_fsdp): only adapters are copied.
        gathered = a * (kept_blocks * n_block + n_root) * trainable / n_params
        first_gathers = a * (n_root + n_block) * trainable / n_params
    # At the first block's gather: both all-gather outputs beside both copies, no prefetched block (module docstring).
    copy_out = max(0, 2 * first_gathers - gathered)
    gathered_bytes = (a * (n_params - quantized) + NF4_BYTES * quantized) / n_params  # per parameter, on average
    gradient_buffers = gradient_buffer_bytes(meta, a, n_root, n_block, trainable / n_params, shard_group)
    saved, full = activation_bytes_per_token(cfg, a, ac, recipe.lora)
    cp_kept, cp_backward, cp_mask, cp_sent = context_parallel_bytes(recipe, a, ac, device)
    block_activations = tokens * saved + adapter_copies_per_block(cfg, a, ac, recipe.lora) + cp_kept
    mask = cp_mask if cp > 1 else attention_mask_bytes(recipe, a, device)  # one, for every windowed block
    activations = cfg.n_layers * block_activations + mask
    logits = logits_bytes(meta, tokens, recipe.train.loss_chunks, a)
    backward = block_backward_bytes(meta, tokens, full, ac != "none", a, n_block * trainable / n_params)
    backward += dequantized + cp_backward
    regathered = regathered_in_backward(cfg)
    sent, internode = comm_bytes_per_rank(
        sharding, n_params, gathered_bytes, accum, nproc, nnodes, regathered, trainable, unsharded
    )
    accumulated = accumulated_gradient_bytes(run_plan, accum, trainable, nproc * nnodes, nproc, on_host)
    forward, again, reference, sampled = kind_costs(recipe, n_params, trainable, gathered_bytes, shard_group, a)
    sent += again + accum * cp_sent + ep_sent  # a context- or expert-parallel group's: within a node
    internode += (again / nproc if nnodes > 1 and run_plan.replicas != "per_node" else 0) + ep_internode
    host = traffic = 0
    if on_host:
        # The fp32 shards cross to the device before each all-gather, their fp32 gradients back at each reduction.
        # The optimizer steps on the host too, with what it allocates.
        host, state, optimizer_step, reference = state + optimizer_step + reference, 0, 0, 0
        # Each all-gather copies its fp32 (frozen: compute-dtype) shards to the device first.
        copied = gathered_per_step(sharding, accum, n_params, regathered) * held / n_params
        traffic = (copied + run_plan.reductions(accum) * GRADIENT_BYTES * trainable) / shard_group
    gathered_late = min(gathered, first_gathers)
    gb = 1e9
    return Estimate(
        sharding, ac, state / gb, gathered / gb, activations / gb, logits / gb, backward / gb, gradient_buffers / gb,
        RUNTIME_GB[device], sent / gb, internode / gb, accumulated / gb, optimizer_step / gb, offload, host / gb,
        traffic / gb, reference / gb, quantized, forward / n_params, copy_out / gb, buffer_bytes(meta) / gb,
        gradients_later(accum, trainable, shard_group, on_host) / gb, block_activations / gb,
        gathered_late / gb, (gathered_late if run_plan.reshard_after_forward else gathered) / gb,
        *(outputs / gb for outputs in held_all_gather_outputs(block_bytes, shard_group, cfg.n_layers)),
        logits_forward_bytes(meta, tokens, recipe.train.loss_chunks) / gb, mask / gb, sampled / gb,
    )  # fmt: skip
