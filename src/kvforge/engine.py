"""Engine: prompt -> tokens -> plan (reuse) -> load -> prefill (under a press) -> decode -> record, with timings.

The one object the CLI, the evaluation and the server drive. Every generation runs :meth:`Engine._execute`; a reuse
strategy only changes the plan it executes (what is loaded, what is left to prefill, how much of it under the press).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kvforge.cache import CacheSnapshot, KVCache, mismatch_with_model
from kvforge.decode import SamplingParams, decode, eos_ids, trim_at_stop
from kvforge.errors import PRESS_WITH_REUSE, UserError
from kvforge.model import context_length, model_fingerprint
from kvforge.prefill import DEFAULT_CHUNK_SIZE, prefill, prefill_at
from kvforge.types import Generation

if TYPE_CHECKING:
    from kvforge.presses.base import Press
    from kvforge.reuse.base import PromptContext, ReusePlan, ReuseStrategy
    from kvforge.reuse.rag import ChunkReuse

logger = logging.getLogger(__name__)

Prompt = str | list[dict[str, str]] | list[int]

__all__ = ["PRESS_WITH_REUSE", "Engine", "SamplingParams", "TextStream"]



class Engine:
    """Generation on one model through a :class:`KVCache` that kvforge controls.

    Args:
        model, tokenizer: from :func:`kvforge.model.load_model` (or any HF causal LM + tokenizer).
        chunk_size: prefill chunk (bounds activation memory on long prompts); None = one shot.
        window, num_sink: optional sliding-window cache (first ``num_sink`` + last ``window`` tokens kept).
        reuse: a :class:`kvforge.reuse.ReuseStrategy`: ``generate``/``answer`` then run plan (load what is stored)
            -> prefill the rest -> decode -> record (store the new KV, after the answer so TTFT is not delayed).
            With a press, reuse stores and loads compressed documents (``answer(..., query_aware=False)``); any
            other press + reuse combination is a :class:`UserError` (:data:`kvforge.errors.PRESS_WITH_REUSE`).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        window: int | None = None,
        num_sink: int = 4,
        reuse: ReuseStrategy | None = None,
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
        self, ids: Sequence[int], cache: KVCache | None = None, press: Press | None = None
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

    def prefill_plan(self, plan: ReusePlan) -> tuple[KVCache, Tensor]:
        """Execute a reuse plan: prefill ``plan.prefill_ids`` on ``plan.cache`` (at ``plan.prefill_positions`` when
        the plan places them, as RAG chunk plans do); returns (cache, logits)."""
        if plan.prefill_positions is None:
            return self.prefill(plan.prefill_ids, plan.cache)
        cache = plan.cache if plan.cache is not None else self.new_cache()
        logits = prefill_at(
            self.model, plan.prefill_ids, plan.prefill_positions, cache, chunk_size=self.chunk_size
        )
        cache.token_ids = list(plan.token_ids)
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
        press: Press | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        """Tokenise (chat template unless ``raw``), then plan -> load -> prefill (under ``press``) -> decode -> record.

        A press compresses the whole prompt (query-aware); with a reuse strategy that is an error (see
        :data:`PRESS_WITH_REUSE`): compressed KV is reused through :meth:`answer` with ``query_aware=False``.
        """
        ids = self.encode_chat(prompt, raw=raw)
        text, context = None, None
        if self.reuse is not None and press is None:  # what the user wrote, and the template/history before it
            from kvforge.reuse.query import user_query

            text, context = user_query(self.tokenizer, prompt, ids, raw=raw)
        return self._execute(ids, max_new_tokens, sampling, stop, on_token, press, len(ids), text=text, context=context)

    def answer(
        self,
        context: str,
        question: str,
        system: str | None = None,
        answer_prefix: str = "",
        press: Press | None = None,
        query_aware: bool = True,
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] | None = None,
        quant: str | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        """Answer ``question`` about ``context`` (the document).

        Query-aware: the press sees context + question (observation window = end of the prompt). Query-agnostic:
        the press compresses the context alone, then the question is prefilled on top of the compressed cache; with
        the engine's reuse strategy the compressed document is stored (keyed by press, its parameters and ``quant``,
        the storage quantisation; None = the store's own) and a later question loads it instead of compressing again.
        """
        ctx_ids, q_ids = self.encode_qa(context, question, system=system, answer_prefix=answer_prefix)
        ids = ctx_ids + q_ids
        agnostic = press is not None and not query_aware and bool(q_ids)
        prompt_context = None
        if ctx_ids and q_ids and (self.reuse is not None or agnostic):
            from kvforge.reuse.base import PromptContext

            prompt_context = PromptContext(context, len(ctx_ids), press=press if agnostic else None, quant=quant)
        press_size = len(ctx_ids) if agnostic else len(ids)
        return self._execute(
            ids, max_new_tokens, sampling, stop, on_token, press, press_size, text=question, context=prompt_context
        )

    def answer_chunks(
        self,
        chunks: Sequence[str],
        question: str,
        rag: ChunkReuse | None = None,
        system: str | None = None,
        separator: str = "\n\n",
        answer_prefix: str = "",
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        """Answer ``question`` over document ``chunks`` reusing each chunk's stored KV (RAG).

        ``rag``: a :class:`kvforge.reuse.rag.ChunkReuse` (default: the engine's ``reuse``). The prompt is the
        chunks joined by ``separator`` after the shared prefix (system + user header), then the question; the plan
        assembles the stored chunks and the engine prefills what it lists (recomputed tokens, separators, question)
        at their positions, then decodes. TTFT includes the plan (chunk loads, CacheBlend/CacheClip selection).
        """
        from kvforge.reuse.rag import ChunkReuse

        rag = rag if rag is not None else self.reuse
        if not isinstance(rag, ChunkReuse):
            raise UserError("answering over chunks needs a RAG chunk reuse strategy (kvforge.reuse.rag.ChunkReuse)")
        try:
            prompt = rag.build_prompt(chunks, question, system=system, separator=separator,
                                      answer_prefix=answer_prefix)
        except ValueError as e:
            raise UserError(str(e)) from e
        ids = prompt.ids()
        return self._execute(ids, max_new_tokens, sampling, stop, on_token, None, 0, text=question, context=prompt,
                             reuse=rag)

    def answer_many(
        self,
        context: str,
        questions: Sequence[str],
        press: Press | None = None,
        system: str | None = None,
        answer_prefix: str = "",
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] | None = None,
    ) -> list[Generation]:
        """Answer several ``questions`` about one ``context``: the context is prefilled (and compressed by ``press``,
        query-agnostic) once, then each question is prefilled and decoded on it and undone before the next one.

        Each answer equals ``answer(context, q, press=press, query_aware=False)``; the first answer's TTFT includes
        the context's prefill, later ones only their question's. With a reuse strategy the main path does it: the
        (compressed) document is stored by the first answer and loaded by every later one, as :meth:`answer` does.
        """
        if not questions:
            return []
        if self.reuse is not None:
            return [
                self.answer(context, q, press=press, query_aware=False, system=system, answer_prefix=answer_prefix,
                            max_new_tokens=max_new_tokens, sampling=sampling, stop=stop)
                for q in questions
            ]  # fmt: skip
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

    # ------------------------------------------------------------------------------------------ main path
    def _execute(
        self,
        ids: list[int],
        max_new_tokens: int,
        sampling: SamplingParams | None,
        stop: Sequence[str] | None,
        on_token: Callable[[int], None] | None,
        press: Press | None,
        press_size: int,
        text: str | None,
        context: PromptContext | None,
        reuse: ReuseStrategy | None = None,
    ) -> Generation:
        """plan what is stored -> load it -> prefill what is missing (the first ``plan.press_size`` tokens under
        ``press``) -> decode -> record what is new. TTFT counts from the plan (store reads) to the first token;
        recording comes after the answer so it does not delay it. ``reuse``: a strategy for this call instead of the
        engine's (RAG chunks); a plan that places its tokens (``prefill_positions``) is executed by ``prefill_plan``."""
        self.check_length(len(ids), max_new_tokens)
        start = time.perf_counter()
        reuse = reuse if reuse is not None else self.reuse
        plan = self.plan(ids, press, press_size, text=text, context=context, reuse=reuse)  # what is stored already?
        plan_s = time.perf_counter() - start
        self.check_length(len(plan.token_ids), max_new_tokens)
        cache = plan.cache if plan.cache is not None else self.new_cache()  # load
        pressed, rest = plan.prefill_ids[: plan.press_size], plan.prefill_ids[plan.press_size :]
        logits: Tensor | None = None
        document = None
        if plan.prefill_positions is not None:  # RAG chunks: recompute the listed tokens at their positions
            cache, logits = self.prefill_plan(plan)
        else:
            if pressed:  # prefill and compress (the document, or the whole prompt when query-aware)
                cache, logits = self.prefill(pressed, cache, press=press)
            document = CacheSnapshot(cache) if pressed and rest and reuse is not None else None
            if rest:  # prefill the rest as it is (the question)
                cache, logits = self.prefill(rest, cache)
        assert logits is not None
        prefill_s = time.perf_counter() - start
        gen = self.decode(cache, logits, max_new_tokens, sampling, stop, on_token)  # decode
        gen.ttft_s += prefill_s
        gen.prompt_tokens = len(ids)
        gen.info.update(cache.info)
        gen.info["prefill_s"] = prefill_s
        gen.info["cache_entries"] = cache.num_entries()
        if reuse is not None:  # record: the new KV (a compressed document: its KV alone, without the question)
            record_start = time.perf_counter()
            if document is not None:
                document.restore()
            reuse.record(ids, cache, text=text, context=context)  # refuses caches not made of exactly ``ids``
            gen.reused_tokens = plan.reused_tokens
            gen.info["reuse"] = plan.summary() | {
                "plan_s": round(plan_s, 6), "record_s": round(time.perf_counter() - record_start, 6)
            }
        return gen

    def plan(
        self,
        ids: list[int],
        press: Press | None = None,
        press_size: int = 0,
        text: str | None = None,
        context: PromptContext | None = None,
        reuse: ReuseStrategy | None = None,
    ) -> ReusePlan:
        """The :class:`kvforge.reuse.ReusePlan` for ``ids``: the reuse strategy's, or prefill everything.

        ``press_size``: without reuse, how many leading tokens the press compresses. A press with a reuse strategy
        needs a query-agnostic document (``context.press``) and a strategy that stores compressed documents.
        ``reuse``: a strategy for this call instead of the engine's.
        """
        from kvforge.reuse.base import miss_plan

        reuse = reuse if reuse is not None else self.reuse
        if reuse is None:
            plan = miss_plan(ids)
            plan.press_size = press_size if press is not None else 0
            return plan
        if self.window is not None:
            raise UserError("KV reuse does not support a sliding-window cache (--window)")
        if press is not None and (context is None or context.press is None):
            raise UserError(PRESS_WITH_REUSE)
        if press is not None and not getattr(reuse, "stores_compressed", False):
            raise UserError(f"{type(reuse).__name__} does not store compressed documents: {PRESS_WITH_REUSE}")
        plan = reuse.plan(ids, text=text, context=context)
        if plan.cache is not None and (problem := mismatch_with_model(plan.cache, self.model)) is not None:
            logger.warning("stored KV does not fit this model (%s): treated as a miss", problem)
            plan = miss_plan(ids, reason=f"stored KV does not fit the model: {problem}")
            plan.press_size = context.num_tokens if press is not None else 0
        return plan


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
