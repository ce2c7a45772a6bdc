"""TRL's side of bench_grpo.py: one GRPOTrainer job on the HF Trainer's own DDP under torchrun, sampling with
transformers' generate, as a fine-tuner runs online RL today without vLLM. Reads the job from a JSON file; writes its
numbers and its per-step rewards.

    torchrun --standalone --nproc_per_node 2 benchmarks/grpo_trl.py JOB.json
"""

from __future__ import annotations

import json
import os
import sys

import torch
from peers_trl import timed_train


def main(job_path: str) -> None:
    job = json.loads(open(job_path).read())
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from fsdp_trainer import rewards

    torch.manual_seed(job["seed"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(job["model"])
    records = [json.loads(line) for line in open(job["prompts"])]
    config = GRPOConfig(
        output_dir=job["out"], per_device_train_batch_size=job["prompts_per_rank"] * job["generations"],
        num_generations=job["generations"], max_completion_length=job["max_completion_length"],
        temperature=job["temperature"], loss_type=job["loss_type"], epsilon=0.2, epsilon_high=job["epsilon_high"],
        beta=0.0, scale_rewards="group", learning_rate=job["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.95, max_steps=job["steps"],
        gradient_accumulation_steps=1, logging_steps=1, save_strategy="no", report_to=[], seed=job["seed"],
        use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, bf16=False, fp16=False, disable_tqdm=True,
        model_init_kwargs={"dtype": torch.float32},
    )  # fmt: skip
    functions = [getattr(rewards, name) for name in job["rewards"]]
    trainer = GRPOTrainer(
        model=job["model"], reward_funcs=functions, args=config, train_dataset=datasets.Dataset.from_list(records),
        processing_class=tokenizer,
    )  # fmt: skip
    output, wall, peak = timed_train(trainer)
    if int(os.environ.get("RANK", "0")) == 0:
        logged = [r for r in trainer.state.log_history if "reward" in r]
        result = {
            "train_runtime_s": output.metrics["train_runtime"], "wall_s": wall, "peak_rss_gb": peak,
            "steps": output.global_step, "rewards": [r["reward"] for r in logged],
            "mean_lengths": [r["completions/mean_length"] for r in logged],
            "exact": [r.get("rewards/exact_answer/mean") for r in logged],
        }  # fmt: skip
        json.dump(result, open(os.path.join(job["out"], "result.json"), "w"))


if __name__ == "__main__":
    main(sys.argv[1])
