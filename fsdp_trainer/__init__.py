"""fsdp_trainer: train Llama / Qwen3-style language models with PyTorch FSDP2, from 2 CPU processes to many GPUs."""

__version__ = "0.1.0"
