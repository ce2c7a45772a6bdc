"""Our model behind lm-evaluation-harness's `LM` interface: the log-likelihood of a continuation (multiple choice),
of a whole text in windows (perplexity tasks), and generation until a stop sequence (with a KV cache), computed as
lm-eval's own Hugging Face model (`HFLM`) computes them, so a task scores the same through either.

Each process holds the model whole and takes its share of the requests (lm-eval splits them by `rank`); the results
are gathered on rank 0, through the process group the tool started (gloo on CPUs, NCCL on GPUs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from fsdp_trainer.data.chat import ChatEncoder
from fsdp_trainer.model import Transformer, generate
from fsdp_trainer.tokenizer import Tokenizer

Request = tuple[object, list[int], list[int]]
"""What lm-eval's TemplateLM hands _loglikelihood_tokens: (its cache key, the context's ids, the continuation's)."""


class ContinuationScores:
    """An objective for Transformer.forward (loss.py's kind): from the final hidden states, each continuation's summed
    log-probability and whether greedy decoding would have produced it, computing logits only where a continuation's
    tokens are predicted."""

    def __init__(self, rows: torch.Tensor, columns: torch.Tensor, targets: torch.Tensor, owner: torch.Tensor, n: int):
        self.rows, self.columns, self.targets, self.owner, self.n = rows, columns, targets, owner, n

    def __call__(self, hidden: torch.Tensor, head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        logps = torch.log_softmax(head(hidden[self.rows, self.columns]).float(), dim=-1)  # (predicted tokens, vocab)
        token_logps = logps.gather(1, self.targets[:, None])[:, 0]
        missed = (logps.argmax(-1) != self.targets).float()
        sums = torch.zeros(self.n, dtype=torch.float32, device=hidden.device)
        misses = torch.zeros(self.n, dtype=torch.float32, device=hidden.device)
        return sums.index_add_(0, self.owner, token_logps), misses.index_add_(0, self.owner, missed) == 0


class ModelLM(TemplateLM):
    """`model` (eval mode, whole on this process) and its tokenizer as lm-eval's LM; `batch_size` requests a forward."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, batch_size: int = 8, max_gen_toks: int = 256):
        super().__init__()
        self.model, self.tok, self.batch_size, self.max_gen_toks = model, tokenizer, batch_size, max_gen_toks
        self.max_length = model.cfg.max_seq_len
        self._device = next(model.parameters()).device
        if dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()

    # --- tokens --------------------------------------------------------------------------------------------------

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

    # --- scoring -------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False, **kwargs):
        """(each continuation's log-probability, whether it is the greedy one), the longest requests first in batches
        of `batch_size`, each cut on the left to max_length tokens as HFLM does."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            scores = self._score([requests[i][1] for i in batch], [requests[i][2] for i in batch])
            for i, score in zip(batch, scores, strict=True):
                results[i] = score
                self.cache_hook.add_partial("loglikelihood", requests[i][0], score)
        return results

    def _score(self, contexts: list[list[int]], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        windows = [(context + continuation)[-(self.max_length + 1) :][:-1] for context, continuation in zip(
            contexts, continuations, strict=True)]  # fmt: skip
        width = max(len(window) for window in windows)
        tokens = torch.zeros(len(windows), width, dtype=torch.long)
        rows, columns, targets, owner = [], [], [], []
        for i, (window, continuation) in enumerate(zip(windows, continuations, strict=True)):
            tokens[i, : len(window)] = torch.tensor(window)
            end = len(window)  # the logits at end - k predict the k-th last token of the continuation
            columns += range(end - len(continuation), end)
            rows += [i] * len(continuation)
            targets += continuation
            owner += [i] * len(continuation)
        objective = ContinuationScores(*(torch.tensor(x, device=self.device) for x in (rows, columns, targets, owner)),
                                       len(windows))  # fmt: skip
        sums, greedy = self.model(tokens.to(self.device), loss=objective)
        return list(zip(sums.tolist(), greedy.tolist(), strict=True))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-probability, in windows of max_length tokens that each predict their own tokens given the
        previous ones (lm-eval's rolling windows, as HFLM cuts them)."""
        out = []
        for (string,) in [request.args for request in requests]:
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            pieces = [(None, *lm_utils.make_disjoint_window(window)) for window in windows]
            total = sum(logp for logp, _ in self._loglikelihood_tokens(pieces))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued (greedy unless the task samples) until a stop sequence, the end-of-text token or
        max_gen_toks tokens, through a KV cache; the context cut on the left to leave room for the new tokens; the
        text before the first stop sequence returned, as HFLM returns it."""
        out = []
        for context, gen_kwargs in [request.args for request in requests]:
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
            max_new = kwargs.pop("max_gen_toks")
            ids = self.tok_encode(context)[-(self.max_length - max_new) :]
            prompt = torch.tensor(ids, dtype=torch.long, device=self.device)

            def stopped(new: torch.Tensor, until: list[str] = until) -> bool:
                return any(stop and stop in self.tok.decode(new.tolist()) for stop in until)

            temperature = kwargs.get("temperature", 0.0) if kwargs.get("do_sample") else 0.0
            tokens = generate(self.model, prompt, max_new, temperature, stop_id=self.eot_token_id, until=stopped)
            text = postprocess_generated_text(self.tok.decode(tokens[len(ids) :].tolist()), until, None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    # --- several processes ---------------------------------------------------------------------------------------

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
