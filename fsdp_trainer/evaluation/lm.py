"""Our model behind lm-evaluation-harness's `LM` interface: the log-likelihood of a continuation (multiple choice),
of a whole text in windows (perplexity tasks), and generation until a stop sequence (with a KV cache), computed as
lm-eval's own Hugging Face model (`HFLM`) computes them, so a task scores the same through either.

Each process takes its share of the requests (lm-eval splits them by `rank`), and the results are gathered on rank 0.
The model is either whole on each process (tools/evaluate.py), or sharded as it trains (`lockstep`): then every
forward pass gathers weights from every rank, so all ranks make the same number of them, those with no work left
running a one-token pass whose answer they drop, and agree after each pass whether any rank has more to do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from fsdp_trainer.checkpoint.restore import load_weights
from fsdp_trainer.checkpoint.weights import read_saved_model
from fsdp_trainer.config import ParallelConfig
from fsdp_trainer.data.chat import ChatEncoder
from fsdp_trainer.distributed.parallelize import materialize, parallelize
from fsdp_trainer.distributed.runtime import DistEnv
from fsdp_trainer.model import KVCache, Transformer, sample
from fsdp_trainer.tokenizer import Tokenizer, load_tokenizer

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
        super().__init__()
        self.model, self.tok, self.batch_size, self.max_gen_toks = model, tokenizer, batch_size, max_gen_toks
        self.max_length = model.cfg.max_seq_len
        self._device = device or next(model.parameters()).device
        if dist.is_initialized():
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self.lockstep = lockstep and self._world_size > 1

    def _more(self, mine: bool) -> bool:
        """Whether this rank (or, in lockstep, any rank) has another forward pass to make."""
        if not self.lockstep:
            return mine
        flag = torch.tensor([float(mine)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _idle_pass(self) -> None:
        """A forward pass with nothing to compute, for a rank whose work is done while others' is not."""
        self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device))

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
        batches = [order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)]
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        done = 0
        while self._more(done < len(batches)):
            if done == len(batches):
                self._idle_pass()
                continue
            batch, done = batches[done], done + 1
            scores = self._score([requests[i][1] for i in batch], [requests[i][2] for i in batch])
            for i, score in zip(batch, scores, strict=True):
                results[i] = score
                if requests[i][0] is not None:
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
        pieces, owners = [], []
        strings = [request.args[0] for request in requests]
        for i, string in enumerate(strings):
            windows = list(
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            )
            pieces += [(None, *lm_utils.make_disjoint_window(window)) for window in windows]
            owners += [i] * len(windows)
        totals = [0.0] * len(strings)
        for owner, (logp, _) in zip(owners, self._loglikelihood_tokens(pieces), strict=True):
            totals[owner] += logp
        for string, total in zip(strings, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued (greedy unless the task samples) until a stop sequence, the end-of-text token or
        max_gen_toks tokens, through a KV cache; the context cut on the left to leave room for the new tokens; the
        text before the first stop sequence returned, as HFLM returns it."""
        args, out = [request.args for request in requests], []
        while self._more(len(out) < len(args)):
            if len(out) == len(args):  # another rank still generates: keep step with it
                self._continue(None, 0, 0.0, [])
                continue
            context, gen_kwargs = args[len(out)]
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
            max_new = kwargs.pop("max_gen_toks")
            ids = self.tok_encode(context)[-(self.max_length - max_new) :]
            temperature = kwargs.get("temperature", 0.0) if kwargs.get("do_sample") else 0.0
            new = self._continue(torch.tensor(ids, dtype=torch.long, device=self.device), max_new, temperature, until)
            text = postprocess_generated_text(self.tok.decode(new), until, None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def _continue(self, prompt: torch.Tensor | None, max_new: int, temperature: float, until: list[str]) -> list[int]:
        """The tokens that continue `prompt` (None: none, keeping step with the ranks that generate), a forward pass
        each, the prompt's read once into a KV cache."""
        new: list[int] = []
        cache = None if prompt is None else KVCache(self.model.cfg, len(prompt) + max_new)
        step_in = prompt
        while self._more(prompt is not None and len(new) < max_new):
            if prompt is None or len(new) == max_new:
                self._idle_pass()
                continue
            logits = self.model(step_in[None], cache=cache)[0, -1].float()
            token = int(sample(logits, temperature, None, None))
            new.append(token)
            step_in = torch.tensor([token], device=self.device)
            text = self.tok.decode(new)
            if token == self.eot_token_id or any(stop and stop in text for stop in until):
                max_new = len(new)  # done
        return new

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


def load_sharded(path: str, env: DistEnv) -> tuple[Transformer, Tokenizer]:
    """A checkpoint's model (any world size; a LoRA run's adapters merged) sharded over this run's ranks by FSDP2 in
    fp32, frozen, and its tokenizer: for a model that does not fit one device whole (ModelLM with `lockstep`)."""
    saved = read_saved_model(path)
    if saved.tokenizer is None:
        raise FileNotFoundError(f"{saved.path} carries no tokenizer, and its recipe's data.tokenizer_path is gone")
    with torch.device("meta"):
        model = Transformer(saved.model)
    model.requires_grad_(False)
    parallelize(model, ParallelConfig(mixed_precision="fp32"), env.mesh)
    materialize(model, env.device, seed=0)
    load_weights(saved.path, model)
    return model.eval(), load_tokenizer(saved.tokenizer)
