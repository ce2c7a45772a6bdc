"""Sample text from a trained model: a checkpoint (or run directory) of ours, or a consolidated HF directory.

python tools/generate.py runs/debug --prompt "ROMEO." --max_new_tokens 200 --temperature 0.8 --top_k 50
python tools/generate.py runs/sft_qwen3_0.6b --chat --prompt "Who goes there?"    # a reply, through the chat template
"""

from __future__ import annotations

import torch
from jsonargparse import ArgumentParser

from fsdp_trainer.checkpoint.holds import reading
from fsdp_trainer.config import one_line_errors
from fsdp_trainer.convert import load_model
from fsdp_trainer.data.chat import ChatEncoder
from fsdp_trainer.generation import generate


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="tools/generate.py", description=__doc__.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("path", help="run directory, checkpoint directory, or HF model directory")
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=int | None, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chat",
        type=bool,
        nargs="?",
        const=True,  # a bare flag means true
        default=False,
        help="the prompt is a user's turn: render it with the tokenizer's chat template and print the reply only",
    )
    with one_line_errors():
        args = parser.parse_args(argv)
        with reading(args.path, "tools/generate.py") as path:
            model, tokenizer = load_model(path)
        messages = [{"role": "user", "content": args.prompt}]
        ids = ChatEncoder(tokenizer).prompt(messages) if args.chat else tokenizer.encode_prompt(args.prompt)
        prompt = torch.tensor(ids, dtype=torch.long)
        if prompt.numel() == 0:
            raise ValueError("--prompt encodes to no tokens; give some text")
        generator = torch.Generator().manual_seed(args.seed)
        out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, generator, tokenizer.eos_id)
    print(tokenizer.decode(out[len(prompt) :].tolist() if args.chat else out.tolist()))


if __name__ == "__main__":
    main()
