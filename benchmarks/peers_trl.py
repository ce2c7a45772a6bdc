"""The peers' side of bench_peers.py: one job of TRL (SFTTrainer or DPOTrainer, with PEFT for LoRA) on the HF
Trainer's own DDP under torchrun, as a fine-tuner runs it today. Reads the job from a JSON file; writes the trained
model (LoRA merged) and its numbers.

    torchrun --standalone --nproc_per_node 2 benchmarks/peers_trl.py JOB.json
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist


def main(job_path: str) -> None:
    job = json.loads(open(job_path).read())
    import datasets
    import transformers
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    torch.manual_seed(job["seed"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(job["model"])
    model = transformers.AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    records = [json.loads(line) for line in open(job["train"])]
    dataset = datasets.Dataset.from_list(records)
    common = dict(
        output_dir=job["out"], per_device_train_batch_size=job["batch"], gradient_accumulation_steps=1,
        max_steps=job["steps"], learning_rate=job["lr"], lr_scheduler_type="cosine", warmup_steps=job["warmup"],
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=job["seed"],
        use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, bf16=False, fp16=False,
        dataset_num_proc=None, max_length=job["max_length"],
    )  # fmt: skip
    peft_config = None
    if job.get("lora_rank"):
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=job["lora_rank"], lora_alpha=2 * job["lora_rank"], lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )  # fmt: skip
    if job["kind"] == "dpo":
        config = DPOConfig(**common, beta=job["beta"], loss_type="sigmoid")
        trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             peft_config=peft_config)  # fmt: skip
    elif job.get("packing"):
        # TRL's packing: best-fit decreasing into rows of max_length, one row a rank a step, padding-free with position
        # ids restarting at each example. One pass over the packed rows, however many they are.
        common.update(per_device_train_batch_size=1, max_steps=-1, num_train_epochs=1, warmup_steps=0.1)
        config = SFTConfig(**common, packing=True, packing_strategy="bfd", assistant_only_loss=True)
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             peft_config=peft_config)  # fmt: skip
    else:
        config = SFTConfig(**common, packing=False, assistant_only_loss=True)
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             peft_config=peft_config)  # fmt: skip
    trained = trained_tokens(trainer.train_dataset, job["kind"])
    output, wall, peak = timed_train(trainer)
    if int(os.environ.get("RANK", "0")) == 0:
        final = trainer.model
        if peft_config is not None:
            final = final.merge_and_unload()
        final.save_pretrained(job["out"] + "/final")
        tokenizer.save_pretrained(job["out"] + "/final")
        result = {"train_runtime_s": output.metrics["train_runtime"], "wall_s": wall, "peak_rss_gb": peak,
                  "trained_tokens": trained, "steps": output.global_step, "examples": len(records)}  # fmt: skip
        json.dump(result, open(job["out"] + "/result.json", "w"))


def timed_train(trainer) -> tuple:
    """(trainer.train()'s output, its wall seconds, the largest peak RSS of the ranks in GB)."""
    start = time.perf_counter()
    output = trainer.train()
    wall = time.perf_counter() - start
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9])
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    return output, wall, rss.item()


def trained_tokens(dataset, kind: str) -> int:
    """The tokens TRL trains on in one pass over `dataset` (as it tokenized it): completion tokens (SFT), both answers'
    tokens (DPO)."""
    if kind == "dpo":
        return sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in dataset)
    if "labels" in dataset.column_names:  # the assistant mask folded in: what the shifted loss counts
        return sum(sum(label != -100 for label in r["labels"][1:]) for r in dataset)
    # A packed row's examples each open with a prompt token, so no example's first token is counted as a target.
    return sum(sum(r["assistant_masks"][1:]) for r in dataset)


if __name__ == "__main__":
    main(sys.argv[1])
