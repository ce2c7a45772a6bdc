"""Our model behind lm-evaluation-harness's `LM` interface: the log-likelihood of a continuation (multiple choice),
of a whole text in windows (perplexity tasks), and generation until a stop sequence (with a KV cache), computed as
lm-eval's own Hugging Face model (`HFLM`) computes them, so a task scores the same through either.

Each process takes its share of the requests (lm-eval splits them by `rank`), and the results are gathered on rank 0.
The model is whole on each process (tools/evaluate.py), or sharded as it trains (`lockstep`, passes.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from fsdp_trainer.data.chat import ChatEncoder
from fsdp_trainer.evaluation.passes import Passes, continuation, score
from fsdp_trainer.model import Transformer
from fsdp_trainer.tokenizer import Tokenizer

Request = tuple[object, list[int], list[int]]
"""What lm-eval's TemplateLM hands _loglikelihood_tokens: (its cache key, the context's ids, the continuation's)."""


class RanksLM(TemplateLM):
    """lm-eval's hooks for several processes, over torch.distributed's default group (the tool's, or training's)."""

    def __init__(self) -> None:
        super().__init__()
        if dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, concatenated (as accelerate's gather): lm-eval counts each rank's requests."""
        parts = [torch.zeros_like(tensor.reshape(-1)) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.reshape(-1).contiguous())
        return torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        dist.barrier()


class TokenizerLM(RanksLM):
    """How lm-eval's requests become our tokenizer's ids, as HFLM makes them from the same tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        super().__init__()
        self.tok = tokenizer

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: BOS, or EOS where the tokenizer has no BOS (HFLM's choice)."""
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The tokenizer's ids of a text: with its BOS where the tokenizer adds one to a document, unless asked not to
        or the text already begins with it (a chat template's rendering)."""
        bos = self.tok.add_bos and self.tok.bos_id is not None
        if add_special_tokens is False or (bos and string.startswith(self.tok.token(self.tok.bos_id))):
            return self.tok.encode(string)
        return self.tok.encode_prompt(string)

    @property
    def tokenizer_name(self) -> str:
        return self.tok.path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tok, "chat_template", None)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the tokenizer's chat template; without a generation prompt, cut after the
        last message's content, so the model continues it (transformers' continue_final_message)."""
        text = ChatEncoder(self.tok).render(chat_history, add_generation_prompt)
        if not add_generation_prompt:
            last = chat_history[-1]["content"].strip()
            text = text[: text.rindex(last) + len(last)]
        return text


class ModelLM(TokenizerLM):
    """`model` (eval mode) and its tokenizer as lm-eval's LM; `batch_size` requests a forward. `lockstep`: the model
    is sharded over the ranks, which make their forward passes together."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        batch_size: int = 8,
        max_gen_toks: int = 256,
        lockstep: bool = False,
        device: torch.device | None = None,
    ):
        super().__init__(tokenizer)
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks
        self.max_length = model.cfg.max_seq_len
        self._device = device or next(model.parameters()).device
        self.passes = Passes(model, self._device, lockstep and self._world_size > 1)

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False, **kwargs):
        """(each continuation's log-probability, whether it is the greedy one), the longest requests first in batches
        of `batch_size`, each cut on the left to max_length tokens as HFLM does."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for batch in self.passes.each([order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]):
            contexts, continuations = [requests[i][1] for i in batch], [requests[i][2] for i in batch]
            for i, scored in zip(batch, score(self.passes, contexts, continuations), strict=True):
                results[i] = scored
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], scored)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability, in windows of max_length tokens that each predict their own tokens given the
        previous ones (lm-eval's rolling windows, as HFLM cuts them)."""
        pieces, owners, strings = [], [], [request.args[0] for request in requests]
        for i, string in enumerate(strings):
            ids = self.tok_encode(string)
            windows = list(lm_utils.get_rolling_token_windows(ids, self.prefix_token_id, self.max_length, 1))
            pieces += [(None, *lm_utils.make_disjoint_window(window)) for window in windows]
            owners += [i] * len(windows)
        totals = [0.0] * len(strings)
        for owner, (logp, _) in zip(owners, self._loglikelihood_tokens(pieces), strict=True):
            totals[owner] += logp
        for string, total in zip(strings, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued (greedy unless the task samples) until a stop sequence, the end-of-text token or
        max_gen_toks tokens, through a KV cache; the context cut on the left to leave room for the new tokens; the
        text before the first stop sequence returned, as HFLM returns it."""
        out, args = [], [request.args for request in requests]
        keep_step = lambda: continuation(self.passes, None, 0, 0.0, lambda token, new: True)  # noqa: E731
        for context, gen_kwargs in self.passes.each(args, idle=keep_step):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until, max_new = handle_stop_sequences(kwargs.pop("until", None), eos=None), kwargs.pop("max_gen_toks")
            ids = self.tok_encode(context)[-(self.max_length - max_new) :]
            temperature = kwargs.get("temperature", 0.0) if kwargs.get("do_sample") else 0.0

            def stop(token: int, new: list[int], until: list[str] = until) -> bool:
                return token == self.eot_token_id or any(s and s in self.tok.decode(new) for s in until)

            prompt = torch.tensor(ids, dtype=torch.long, device=self.device)
            text = postprocess_generated_text(self.tok.decode(continuation(self.passes, prompt, max_new, temperature,
                                                                           stop)), until, None)  # fmt: skip
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out
