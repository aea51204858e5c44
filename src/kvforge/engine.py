"""Engine: prompt -> tokens -> (press) prefill -> decode, with timings. The one object CLI, eval and server drive."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from kvforge.cache import CacheSnapshot, KVCache, mismatch_with_model
from kvforge.decode import SamplingParams, decode, eos_ids, trim_at_stop
from kvforge.errors import UserError
from kvforge.model import context_length, model_fingerprint
from kvforge.prefill import DEFAULT_CHUNK_SIZE, prefill
from kvforge.types import Generation

logger = logging.getLogger(__name__)

Prompt = str | list[dict[str, str]] | list[int]

__all__ = ["Engine", "SamplingParams", "TextStream"]


class Engine:
    """Generation on one model through a :class:`KVCache` that kvforge controls.

    Args:
        model, tokenizer: from :func:`kvforge.model.load_model` (or any HF causal LM + tokenizer).
        chunk_size: prefill chunk (bounds activation memory on long prompts); None = one shot.
        window, num_sink: optional sliding-window cache (first ``num_sink`` + last ``window`` tokens kept).
        reuse: a :class:`kvforge.reuse.ReuseStrategy`: ``generate``/``answer`` then run plan (load what is stored)
            -> prefill the rest -> decode -> record (store the new KV, after the answer so TTFT is not delayed).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        window: int | None = None,
        num_sink: int = 4,
        reuse: Any = None,
    ) -> None:
        if chunk_size is not None and chunk_size < 1:
            raise UserError(f"chunk size must be >= 1, got {chunk_size}")
        if window is not None and window < 1:
            raise UserError(f"window must be >= 1, got {window}")
        self.model = model
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size
        self.window = window
        self.num_sink = num_sink if window is not None else 0
        self.reuse = reuse
        self.on_prefill_chunk: Callable[[int, int], None] | None = None  # progress: (tokens done, total)
        self.max_positions = context_length(model)
        self.eos_token_ids = eos_ids(model, tokenizer)

    @property
    def model_id(self) -> str:
        """Fingerprint of model + tokenizer (keys stored caches)."""
        return model_fingerprint(self.model, self.tokenizer)

    # ------------------------------------------------------------------------------------------ tokens
    @cached_property
    def vocab_size(self) -> int:
        """Rows of the input embedding: token ids must lie in ``[0, vocab_size)``."""
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_chat(self, prompt: Prompt, raw: bool = False) -> list[int]:
        """Token ids of ``prompt``: a string (a user message unless ``raw``), a message list, or ids."""
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            return ids
        if isinstance(prompt, str) and (raw or not self.has_chat_template):
            return list(self.tokenizer(prompt, add_special_tokens=True).input_ids)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not self.has_chat_template:
            text = "\n\n".join(m["content"] for m in messages)  # type: ignore[index]
            return list(self.tokenizer(text, add_special_tokens=True).input_ids)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def encode_qa(
        self, context: str, question: str, system: str | None = None, answer_prefix: str = ""
    ) -> tuple[list[int], list[int]]:
        """Split ONE prompt (context, then question, then the assistant header) into context ids and question ids.

        ``ctx_ids + q_ids`` is exactly the tokenisation of the whole prompt; the split falls at the first token that
        starts at or after the question (a token straddling the boundary goes to the question part).
        """
        sep = "\n\n"
        content = f"{context}{sep}{question}" if context else question
        if self.has_chat_template:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": content}
            ]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            add_special = False
        else:
            text = (f"{system}{sep}" if system else "") + content + "\n"
            add_special = True
        text += answer_prefix
        question_start = text.rfind(question) if question else len(text)
        if context and question:
            question_start = text.rfind(sep + question) + len(sep)
        enc = self.tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
        ids, offsets = list(enc.input_ids), enc.offset_mapping
        split = next(
            (i for i, (s, e) in enumerate(offsets) if e > question_start and not (s == e == 0 and i == 0)), len(ids)
        )
        return ids[:split], ids[split:]

    # ------------------------------------------------------------------------------------------ stages
    def new_cache(self) -> KVCache:
        return KVCache.for_model(self.model, window=self.window, num_sink=self.num_sink)

    def check_length(self, num_tokens: int, max_new_tokens: int = 0) -> None:
        if num_tokens + max_new_tokens > self.max_positions:
            raise UserError(
                f"prompt of {num_tokens} tokens + {max_new_tokens} new tokens exceeds the model's context of "
                f"{self.max_positions} tokens"
            )
        if num_tokens == 0:
            raise UserError("empty prompt")

    def prefill(
        self, ids: Sequence[int], cache: KVCache | None = None, press: Any = None
    ) -> tuple[KVCache, Tensor]:
        """Prefill ``ids`` on ``cache`` (new if None), compressing with ``press`` if given; returns (cache, logits)."""
        cache = cache if cache is not None else self.new_cache()
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.model.device)
        if press is None:
            logits = prefill(self.model, input_ids, cache, chunk_size=self.chunk_size, on_chunk=self.on_prefill_chunk)
        else:
            from kvforge.presses import compress_prefill

            logits = compress_prefill(
                self.model, input_ids, cache, press, chunk_size=self.chunk_size, tokenizer=self.tokenizer,
                on_chunk=self.on_prefill_chunk,
            )
        return cache, logits

    def decode(
        self,
        cache: KVCache,
        logits: Tensor,
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        """Decode from prefill ``logits``; returns a :class:`Generation` (ttft_s = time to pick the first token)."""
        result = decode(
            self.model,
            cache,
            logits,
            max_new_tokens,
            sampling=sampling,
            eos_token_ids=self.eos_token_ids,
            stop=list(stop or ()),
            tokenizer=self.tokenizer,
            on_token=on_token,
        )
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        if stop:
            text = trim_at_stop(text, stop)
        return Generation(
            text=text,
            token_ids=result.token_ids,
            prompt_tokens=0,
            ttft_s=result.first_token_s,
            decode_s=result.decode_s,
            finish_reason=result.finish_reason,
            cache_bytes=cache.nbytes(),
        )

    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] | None = None,
        raw: bool = False,
        press: Any = None,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        """Tokenise (chat template unless ``raw``), prefill (under ``press``), decode."""
        ids = self.encode_chat(prompt, raw=raw)
        if self.reuse is not None and press is None:
            text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids, skip_special_tokens=True)
            return self._run_reused(ids, max_new_tokens, sampling, stop, on_token, text=text, context=None)
        return self._run([ids], max_new_tokens, sampling, stop, [press], on_token)

    def answer(
        self,
        context: str,
        question: str,
        system: str | None = None,
        answer_prefix: str = "",
        press: Any = None,
        query_aware: bool = True,
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] | None = None,
    ) -> Generation:
        """Answer ``question`` about ``context``.

        Query-aware: the press sees context + question (observation window = end of the prompt). Query-agnostic:
        the press compresses the context alone, then the question is prefilled on top of the compressed cache.
        """
        ctx_ids, q_ids = self.encode_qa(context, question, system=system, answer_prefix=answer_prefix)
        if self.reuse is not None and press is None and ctx_ids and q_ids:
            from kvforge.reuse import PromptContext

            return self._run_reused(ctx_ids + q_ids, max_new_tokens, sampling, stop, None, text=question,
                                    context=PromptContext(context, len(ctx_ids)))
        if query_aware or not q_ids:
            return self._run([ctx_ids + q_ids], max_new_tokens, sampling, stop, [press], None)
        return self._run([ctx_ids, q_ids], max_new_tokens, sampling, stop, [press, None], None)

    def answer_many(
        self,
        context: str,
        questions: Sequence[str],
        press: Any = None,
        system: str | None = None,
        answer_prefix: str = "",
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] | None = None,
    ) -> list[Generation]:
        """Answer several ``questions`` about one ``context``: the context is prefilled (and compressed by ``press``,
        query-agnostic) once, then each question is prefilled and decoded on it and undone before the next one.

        Each answer equals ``answer(context, q, press=press, query_aware=False)``; the first answer's TTFT includes
        the context's prefill, later ones only their question's.
        """
        if not questions:
            return []
        ctx_ids, _ = self.encode_qa(context, questions[0], system=system, answer_prefix=answer_prefix)
        start = time.perf_counter()
        cache, _ = self.prefill(ctx_ids, press=press)
        context_s = time.perf_counter() - start
        snapshot = CacheSnapshot(cache)
        results = []
        for i, question in enumerate(questions):
            ids, q_ids = self.encode_qa(context, question, system=system, answer_prefix=answer_prefix)
            if ids != ctx_ids or not q_ids:
                raise UserError("answer_many needs a question after the context (the chat template split differs)")
            self.check_length(len(ctx_ids) + len(q_ids), max_new_tokens)
            start = time.perf_counter()
            _, logits = self.prefill(q_ids, cache)
            prefill_s = time.perf_counter() - start + (context_s if i == 0 else 0.0)
            gen = self.decode(cache, logits, max_new_tokens, sampling, stop)
            gen.ttft_s += prefill_s
            gen.prompt_tokens = len(ctx_ids) + len(q_ids)
            gen.info.update(cache.info)
            gen.info["prefill_s"] = prefill_s
            gen.info["cache_entries"] = cache.num_entries()
            results.append(gen)
            snapshot.restore()
        return results

    def plan_reuse(self, ids: list[int], text: str | None = None, context: Any = None, reuse: Any = None) -> Any:
        """The plan of ``reuse`` (default: the engine's strategy) for ``ids``; stored KV that does not fit the model is
        a miss with one warning. A scheduler batching requests calls this, prefills ``plan.prefill_ids`` on
        ``plan.cache`` itself, decodes, then records through the strategy, as :meth:`generate` does in one go."""
        strategy = reuse if reuse is not None else self.reuse
        plan = strategy.plan(ids, text=text, context=context)
        if plan.cache is not None and (problem := mismatch_with_model(plan.cache, self.model)) is not None:
            logger.warning("stored KV does not fit this model (%s): treated as a miss", problem)
            from kvforge.reuse import miss_plan

            plan = miss_plan(ids, reason=f"stored KV does not fit the model: {problem}")
        return plan

    def _run(
        self,
        parts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingParams | None,
        stop: Sequence[str] | None,
        presses: list[Any],
        on_token: Callable[[int], None] | None,
    ) -> Generation:
        """Prefill ``parts`` one after the other (each under its press), then decode; times TTFT from the start."""
        total = sum(len(p) for p in parts)
        self.check_length(total, max_new_tokens)
        start = time.perf_counter()
        cache: KVCache | None = None
        logits: Tensor | None = None
        for part, press in zip(parts, presses, strict=True):
            cache, logits = self.prefill(part, cache, press=press)
        assert cache is not None and logits is not None
        prefill_s = time.perf_counter() - start
        gen = self.decode(cache, logits, max_new_tokens, sampling, stop, on_token)
        gen.ttft_s += prefill_s
        gen.prompt_tokens = total
        gen.info.update(cache.info)
        gen.info["prefill_s"] = prefill_s
        gen.info["cache_entries"] = cache.num_entries()
        return gen

    def _run_reused(
        self,
        ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams | None,
        stop: Sequence[str] | None,
        on_token: Callable[[int], None] | None,
        text: str | None,
        context: Any,
    ) -> Generation:
        """plan (reuse stored KV) -> prefill the rest -> decode -> record; TTFT includes the plan (store reads)."""
        if self.window is not None:
            raise UserError("KV reuse does not support a sliding-window cache (--window)")
        self.check_length(len(ids), max_new_tokens)
        start = time.perf_counter()
        plan = self.plan_reuse(ids, text=text, context=context)
        plan_s = time.perf_counter() - start
        self.check_length(len(plan.token_ids), max_new_tokens)
        cache, logits = self.prefill(plan.prefill_ids, plan.cache)
        prefill_s = time.perf_counter() - start
        gen = self.decode(cache, logits, max_new_tokens, sampling, stop, on_token)
        gen.ttft_s += prefill_s
        record_start = time.perf_counter()
        self.reuse.record(ids, cache, text=text, context=context)  # refuses caches not made of exactly ``ids``
        gen.prompt_tokens = len(ids)
        gen.reused_tokens = plan.reused_tokens
        gen.info.update(cache.info)
        gen.info["reuse"] = plan.summary() | {
            "plan_s": round(plan_s, 6), "record_s": round(time.perf_counter() - record_start, 6)
        }
        gen.info["prefill_s"] = prefill_s
        gen.info["cache_entries"] = cache.num_entries()
        return gen


class TextStream:
    """Turns streamed token ids into text deltas (handles multi-token characters and leading spaces)."""

    def __init__(self, tokenizer: Any, write: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.write = write
        self.tokens: list[int] = []
        self.printed = 0

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # wait for the rest of a multi-byte character
        self.write(text[self.printed :])
        self.printed = len(text)
