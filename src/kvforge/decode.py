"""Greedy and sampled decoding from a :class:`~kvforge.cache.KVCache`, with EOS, stop strings and streaming."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvforge.cache import KVCache
from kvforge.errors import UserError
from kvforge.prefill import forward
from kvforge.sampling import MIN_TEMPERATURE, check_temperature, check_top_k, check_top_p


@dataclass
class SamplingParams:
    """How the next token is chosen. ``temperature`` 0 is greedy, else at least :data:`MIN_TEMPERATURE` (the rules
    of :mod:`kvforge.sampling`: any other value is a :class:`UserError`); a ``seed`` makes sampling reproducible."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        check_top_p(self.top_p)
        check_top_k(self.top_k)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


class PresenceFrequencyPenalty:
    """OpenAI's ``presence_penalty`` / ``frequency_penalty`` as a transformers ``LogitsProcessor``.

    ``logits[t] -= presence * (count[t] > 0) + frequency * count[t]``, counts over ``input_ids`` (vLLM and OpenAI
    count the generated tokens only: :class:`DecodeState` passes those). transformers ships no additive penalty (its
    ``RepetitionPenaltyLogitsProcessor`` is multiplicative), so this one implements the same ``__call__`` interface.
    """

    def __init__(self, presence: float = 0.0, frequency: float = 0.0) -> None:
        self.presence, self.frequency = presence, frequency

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if input_ids.shape[-1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(-1, input_ids, torch.ones_like(input_ids, dtype=scores.dtype))
        return scores - self.presence * (counts > 0).to(scores.dtype) - self.frequency * counts


@dataclass
class DecodeResult:
    token_ids: list[int]
    finish_reason: str  # "length" | "stop"
    decode_s: float
    first_token_s: float  # time to choose the first token from the prefill logits


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """Pick one token per row of ``logits`` ``(B, V)``; returns ``(B,)``."""
    if params.is_greedy:
        return logits.argmax(dim=-1)
    scores = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs > params.top_p  # keep the smallest prefix reaching top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


class DecodeState:
    """One sequence's token choices: sampling (own seeded generator), logits processors, EOS, stop strings, budget.

    :func:`decode` drives one; :mod:`kvforge.batch` drives many through one forward per step, so a sequence picks
    exactly the same tokens alone or batched. ``pick(logits)`` returns the token to feed next, or None once finished
    (``finish_reason`` set). ``logprobs`` > 0 records, per emitted token, its log-probability and the ``logprobs``
    most likely alternatives (after processors, before temperature, as OpenAI reports them).
    """

    def __init__(
        self,
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        *,
        eos_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        tokenizer: Any = None,
        on_token: Callable[[int], None] | None = None,
        processors: Sequence[Any] = (),
        prompt_ids: Sequence[int] = (),
        logprobs: int | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop and tokenizer is None:
            raise ValueError("stop strings need the tokenizer")
        self.max_new_tokens = max_new_tokens
        self.params = sampling or SamplingParams()
        self.generator: torch.Generator | None = None
        self.eos = set(eos_token_ids)
        self.stop = list(stop)
        self.tokenizer = tokenizer
        self.on_token = on_token
        self.processors = list(processors)
        self.prompt_ids = list(prompt_ids)
        self.num_logprobs = logprobs
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []  # (token, logprob, top alternatives)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None  # "length" | "stop" once finished
        self.num_picks = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def pick(self, logits: Tensor) -> int | None:
        """Choose the next token from ``logits`` ``(1, V)`` (or ``(1, S, V)``); None when the sequence ends here."""
        logits = logits[:, -1] if logits.dim() == 3 else logits
        if self.processors:
            history = torch.tensor([self.prompt_ids + self.tokens], dtype=torch.long, device=logits.device)
            for processor in self.processors:
                logits = processor(history, logits)
        params = self.params
        if self.generator is None and not params.is_greedy and params.seed is not None:
            self.generator = torch.Generator(device=logits.device).manual_seed(params.seed)
        token = int(sample(logits, params, self.generator)[0])
        self.num_picks += 1
        if token in self.eos:
            self.finish_reason = "stop"
            return None
        if self.num_logprobs is not None:
            self._record_logprobs(logits[0], token)
        self.tokens.append(token)
        if self.on_token is not None:
            self.on_token(token)
        if self.stop and _hits_stop(self.tokenizer, self.tokens, self.stop):
            self.finish_reason = "stop"
            return None
        if len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
            return None
        return token

    def _record_logprobs(self, logits: Tensor, token: int) -> None:
        logprobs = logits.float().log_softmax(dim=-1)
        top = logprobs.topk(self.num_logprobs).indices.tolist() if self.num_logprobs else []
        self.logprobs.append((token, float(logprobs[token]), [(int(t), float(logprobs[t])) for t in top]))


@torch.inference_mode()
def decode(model: Any, cache: KVCache, logits: Tensor, state: DecodeState | int) -> DecodeResult:
    """Decode one sequence from the prefill's last ``logits`` ``(1, V)``, one forward per token, until ``state`` ends
    (an int: greedy, that many new tokens at most). The rules are :class:`DecodeState`'s: an EOS id ends it (not
    included), a stop string too (the token completing it is included; the caller trims the text).
    """
    state = DecodeState(state) if isinstance(state, int) else state
    start = time.perf_counter()
    first_token_s = 0.0
    step_ids = torch.empty((1, 1), dtype=torch.long, device=logits.device)
    while True:
        token = state.pick(logits)
        if state.num_picks == 1:
            first_token_s = time.perf_counter() - start
        if token is None:
            break
        step_ids[0, 0] = token
        logits = forward(model, step_ids, cache)
    assert state.finish_reason is not None
    return DecodeResult(state.tokens, state.finish_reason, time.perf_counter() - start, first_token_s)


def _hits_stop(tokenizer: Any, tokens: list[int], stop: Sequence[str]) -> bool:
    tail = tokenizer.decode(tokens[-16:], skip_special_tokens=True)
    return any(s in tail for s in stop)


def trim_at_stop(text: str, stop: Sequence[str]) -> str:
    """Cut ``text`` before the first stop string it contains."""
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every EOS id the model's generation config or tokenizer declares (chat models end turns with their own)."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    for special in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(special) if hasattr(tokenizer, "convert_tokens_to_ids") else None
        if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
            ids.add(tid)
    return sorted(ids)


@torch.inference_mode()
def decode_uncached(
    model: Any, input_ids: list[int], max_new_tokens: int, eos_token_ids: Sequence[int] = ()
) -> tuple[list[int], Tensor]:
    """The tutorial's baseline: recompute the whole sequence at every step (no cache). Greedy.

    Returns the new tokens and the logits ``(T, V)`` that chose them.
    """
    ids = torch.tensor([input_ids], dtype=torch.long, device=model.device)
    tokens: list[int] = []
    all_logits = []
    eos = set(eos_token_ids)
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1]
        all_logits.append(logits[0])
        token = int(logits.argmax(-1)[0])
        if token in eos:
            break
        tokens.append(token)
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
    return tokens, torch.stack(all_logits)
