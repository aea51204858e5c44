"""Engine: the one loop. ``add(request)`` plans and loads, ``step()`` advances every request, ``run`` = add + step.

Every request (CLI, evaluation, RAG, server, benchmark) is a :class:`~kvforge.request.Request`:

- ``add`` tokenises it (once: :meth:`Engine.encode`, done already when the caller tokenised off the model thread),
  asks the reuse strategy for a plan (what is stored, loaded into a cache) and lists the prompt units left to run;
- ``step`` runs one unit that must run alone (a press prefill, a RAG recompute), then ONE forward holding the next
  token of every decoding request and this step's prompt chunks (:mod:`kvforge.schedule`, :mod:`kvforge.batch`);
- a request that ends is finished once: what is new is recorded by its strategy and its ``Generation`` built.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from functools import cached_property
from typing import TYPE_CHECKING, Any

from torch import Tensor

from kvforge import threads
from kvforge.batch import forward_packed
from kvforge.cache import CacheSnapshot, KVCache, mismatch_with_model
from kvforge.calibrate import prepare_basis
from kvforge.decode import DecodeState, SamplingParams, decode, eos_ids, trim_at_stop
from kvforge.errors import PRESS_WITH_REUSE, Aborted, UserError, check_combination
from kvforge.model import context_length, model_fingerprint
from kvforge.prefill import DEFAULT_CHUNK_SIZE, forward, prefill, prefill_at
from kvforge.presses.decoding import attach as attach_policy
from kvforge.request import Chunks, Document, Encoded, Request, encode, encode_chat, encode_qa
from kvforge.reuse.base import (
    Check,
    GivenCache,
    PromptContext,
    ReusePlan,
    ReuseStrategy,
    StoresCompressedDocuments,
    miss_plan,
)
from kvforge.reuse.document import DocumentReuse
from kvforge.reuse.rag import ChunkReuse
from kvforge.schedule import schedule_chunks, step_budget
from kvforge.sequence import Sequence, Unit
from kvforge.store.memory import MemoryStore
from kvforge.store.transform import parse_transform
from kvforge.types import Generation

if TYPE_CHECKING:
    from kvforge.presses.base import Press
    from kvforge.presses.decoding import DecodingPress

logger = logging.getLogger(__name__)

Prompt = str | list[dict[str, str]] | list[int]

__all__ = ["PRESS_WITH_REUSE", "Engine", "Request", "SamplingParams", "TextStream"]


class Engine:
    """Generation on one model through :class:`KVCache` s that kvforge controls, many requests at a time.

    Args:
        model, tokenizer: from :func:`kvforge.model.load_model` (or any HF causal LM + tokenizer).
        chunk_size: prefill chunk (bounds activation memory on long prompts); None = one shot.
        window, num_sink: optional sliding-window cache (first ``num_sink`` + last ``window`` tokens kept).
        reuse: the default :class:`~kvforge.reuse.ReuseStrategy` of requests (``Request.reuse=True``).
        prefill_budget: prompt tokens a step prefills beside decoding requests (None: ``chunk_size``); a step with
            nothing decoding prefills ``chunk_size`` tokens, as a lone prefill does.
        decoding_press: a :class:`kvforge.presses.DecodingPress`: every cache keeps at most its budget (+ interval)
            entries per layer and KV head while it decodes, and while a prompt is prefilled without a press (a prompt
            press sees the whole prompt first: give it the same budget, ``build_press(name, kv_budget=N)``).
        small_step_threads: ``"auto"``: a step of at most ``kvforge.threads.SMALL_STEP`` tokens on CPU (decode rows,
            short prompts) runs with one thread or torch's full team, whichever
            :class:`kvforge.threads.SmallStepThreads` measures faster on this machine now; None: torch's setting.
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
        prefill_budget: int | None = None,
        decoding_press: DecodingPress | None = None,
        small_step_threads: threads.SmallStepThreads | str | None = "auto",
    ) -> None:
        for name, value in (("chunk size", chunk_size), ("window", window), ("prefill budget", prefill_budget)):
            if value is not None and value < 1:
                raise UserError(f"{name} must be >= 1, got {value}")
        if isinstance(small_step_threads, str) and small_step_threads != "auto":
            raise UserError(f"small_step_threads must be 'auto', SmallStepThreads or None, got {small_step_threads!r}")
        if window is not None and decoding_press is not None:
            raise UserError("a decoding budget does not combine with a sliding-window cache (--window): choose one")
        self.model = model
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size
        self.window = window
        self.num_sink = num_sink if window is not None else 0
        self.reuse = reuse
        self.prefill_budget = prefill_budget
        self.decoding_press = decoding_press  # a token budget the cache keeps while generating (and prefilling)
        # small CPU steps (decoding, short prompts): one thread or the full team, whichever measures faster
        self.small_step_threads = threads.SmallStepThreads() if small_step_threads == "auto" else small_step_threads
        self.max_positions = context_length(model)
        self.eos_token_ids = eos_ids(model, tokenizer)
        self.running: list[Sequence] = []  # in arrival order
        self.stats = {"steps": 0, "decode_rows": 0, "prefill_tokens": 0}  # since start (the server's /metrics)
        self._lock = threading.RLock()  # one step at a time, whoever calls it (the server's thread, a test's)
        self._checks: dict[int, _CheckRun] = {}  # id(sequence) -> the check it is one side of

    @property
    def model_id(self) -> str:
        """Fingerprint of model + tokenizer (keys stored caches)."""
        return model_fingerprint(self.model, self.tokenizer)

    def prepare_codec(self, strategy: ReuseStrategy | None, context: Any = None) -> None:
        """Calibrate this model's kvtc basis (once per machine; saved with the model's artefacts) and name it in the
        strategy's store, before that store codes the model's KV with kvtc (its own quantisation or the document's):
        the store never runs the model."""
        store = getattr(strategy, "store", None)
        tiers = getattr(store, "tiers", None) or [store]
        quants = [getattr(context, "quant", None)] + [getattr(t, "quant", None) for t in tiers]
        if store is not None and any(q and parse_transform(str(q)) for q in quants):
            prepare_basis(self.model, self.tokenizer, store, model_id=self.model_id)

    @cached_property
    def vocab_size(self) -> int:
        """Rows of the input embedding: token ids must lie in ``[0, vocab_size)``."""
        return int(self.model.get_input_embeddings().num_embeddings)

    # ------------------------------------------------------------------------------------------ tokens
    def encode(self, request: Request) -> Encoded:
        """Tokenise ``request`` (once: the result is kept in ``request.encoded``) and check it fits the model.

        Touches no model state: the server runs it off the model thread.
        """
        if isinstance(request.prompt, list) and len(request.prompt) > self.max_positions:
            self.check_length(len(request.prompt), request.max_new_tokens)  # before looking at each id
        enc = encode(self.tokenizer, request)
        self.check_length(len(enc.ids), request.max_new_tokens)
        self._check_vocab(enc.ids)
        request.encoded = enc
        return enc

    def _check_vocab(self, ids: list[int]) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise UserError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def encode_chat(self, prompt: Prompt, raw: bool = False) -> list[int]:
        """Token ids of chat text, messages or ids (see :func:`kvforge.request.encode_chat`)."""
        ids = encode_chat(self.tokenizer, prompt, raw=raw)
        self._check_vocab(ids)
        return ids

    def encode_qa(
        self, context: str, question: str, system: str | None = None, answer_prefix: str = ""
    ) -> tuple[list[int], list[int]]:
        """(context ids, question ids) of one prompt (see :func:`kvforge.request.encode_qa`)."""
        return encode_qa(self.tokenizer, context, question, system, answer_prefix)

    def check_length(self, num_tokens: int, max_new_tokens: int = 0) -> None:
        if num_tokens + max_new_tokens > self.max_positions:
            raise UserError(
                f"prompt of {num_tokens} tokens + {max_new_tokens} new tokens exceeds the model's context of "
                f"{self.max_positions} tokens"
            )
        if num_tokens == 0:
            raise UserError("empty prompt")

    # ------------------------------------------------------------------------------------------ the loop
    def add(self, request: Request, tag: Any = None) -> Sequence:
        """Plan what is stored for ``request``, load it, and queue the prompt units left; returns its sequence
        (``tag``: the caller's handle, kept on the sequence)."""
        enc = request.encoded or self.encode(request)
        with self._lock:
            return self._add(request, enc, tag)

    def _add(self, request: Request, enc: Encoded, tag: Any) -> Sequence:
        start = time.perf_counter()
        strategy = self.strategy_of(request)
        self.prepare_codec(strategy, enc.context)
        plan = self._plan(request, enc, strategy)
        self.check_length(len(plan.token_ids), request.max_new_tokens)
        units = self._units(request, plan, strategy)
        if not units and plan.logits is None and request.max_new_tokens:
            raise ValueError("a plan that covers the whole prompt must give its last logits")
        seq = Sequence(
            request, enc, plan, strategy, plan.cache if plan.cache is not None else self.new_cache(), units,
            self._decode_state(request, enc), start, time.perf_counter() - start, logits=plan.logits, tag=tag,
        )  # fmt: skip
        if request.press is None or not units:  # a prompt press sees the whole prompt before any budget cut
            attach_policy(self.decoding_press, seq.cache)
        if not units:
            seq.prefilled_at = time.perf_counter()
        self.running.append(seq)
        return seq

    def step(self) -> list[Sequence]:
        """Advance every running request by one step; returns the sequences that finished in it.

        First one prompt unit that runs alone (a press prefill, a RAG recompute), then one forward with the next token
        of every decoding sequence and this step's prompt chunks. A sequence past its deadline ends with
        :class:`~kvforge.errors.Aborted`; a failed forward ends every sequence it held with the error.
        """
        with self._lock:
            return self._step()

    def _step(self) -> list[Sequence]:
        done = [self._end(s, Aborted("timeout")) for s in [s for s in self.running if _expired(s)]]
        alone = next((s for s in self.running if s.is_prefilling and s.units[0].runs_alone), None)
        if alone is not None:
            try:
                self._run_alone(alone)
            except Exception as e:
                done.append(self._end(alone, e))
        picks: list[tuple[Sequence, int]] = []
        for seq in [s for s in self.running if not s.units and s.state is not None]:
            token = self._pick(seq)
            if token is None:
                done.append(self._finish(seq))
            else:
                picks.append((seq, token))
        prefilling = [s for s in self.running if s.is_prefilling and not s.units[0].runs_alone]
        chunks = self.schedule(prefilling, len(picks))
        rows = [s.units[0].ids[s.offset : s.offset + n] for s, n in chunks] + [[t] for _, t in picks]
        caches = [s.cache for s, _ in chunks] + [s.cache for s, _ in picks]
        if rows:
            self.stats["steps"] += 1
            self.stats["decode_rows"] += len(picks)
            self.stats["prefill_tokens"] += sum(n for _, n in chunks)
            try:
                logits = self._forward_timed(rows, caches)
            except Exception as e:
                return done + [self._end(s, e) for s, _ in [*chunks, *picks]]
            for i, (seq, n) in enumerate(chunks):
                seq.logits = logits[i : i + 1]
                self._advance(seq, n)
            for i, (seq, _) in enumerate(picks, start=len(chunks)):
                seq.logits = logits[i : i + 1]
        done += [self._finish(s) for s in [s for s in self.running if not s.units and s.state is None]]  # no tokens
        return done

    def complete(self, seq: Sequence) -> Generation:
        """Step until ``seq`` finished (other running requests advance with it); its generation."""
        while not seq.is_finished:
            self.step()
        return seq.result()

    def run(self, request: Request) -> Generation:
        """``add`` then ``step`` until done: what the CLI, RAG, the evaluation and benchmarks call."""
        return self.complete(self.add(request))

    def run_many(self, requests: Seq[Request]) -> list[Generation]:
        """All ``requests`` added at once and stepped together (decoded in one forward per step)."""
        seqs = [self.add(r) for r in requests]
        return [self.complete(s) for s in seqs]

    def run_pending(self) -> None:
        """Step until no request is left, the checks that finished requests queued included (a CLI before it exits:
        what a check learns is stored for the next process)."""
        while self.running:
            self.step()

    def abort(self, seq: Sequence, error: BaseException) -> None:
        """End ``seq`` now with ``error`` (a client gone, a server shutting down)."""
        with self._lock:
            if not seq.is_finished:
                self._end(seq, error)

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    # ------------------------------------------------------------------------------------------ plan
    def strategy_of(self, request: Request) -> ReuseStrategy | None:
        """The reuse strategy ``request`` runs with (``reuse=True``: the engine's)."""
        if request.reuse is True:
            return self.reuse
        return None if request.reuse is False else request.reuse  # type: ignore[return-value]

    def _plan(self, request: Request, enc: Encoded, strategy: ReuseStrategy | None) -> ReusePlan:
        """The strategy's plan for ``enc``, or prefill everything; every combination that cannot work is refused."""
        press, context = request.press, enc.context
        if isinstance(request.prompt, Chunks) and not isinstance(strategy, ChunkReuse):
            raise UserError("a question over chunks needs a RAG chunk reuse strategy (kvforge.reuse.rag.ChunkReuse)")
        if strategy is None:
            plan = miss_plan(enc.ids)
            plan.press_size = enc.press_size if press is not None else 0
            return plan
        agnostic = isinstance(context, PromptContext) and context.press is not None  # a document compressed alone
        check_combination(press=press is not None, stores_documents=isinstance(strategy, StoresCompressedDocuments),
                          query_aware=not agnostic, has_document=agnostic, window=self.window is not None,
                          decoding_budget=self.decoding_press is not None)  # fmt: skip
        plan = strategy.plan(enc.ids, text=enc.text, context=context)  # type: ignore[arg-type]
        if plan.cache is not None and (problem := mismatch_with_model(plan.cache, self.model)) is not None:
            logger.warning("stored KV does not fit this model (%s): treated as a miss", problem)
            plan = miss_plan(enc.ids, reason=f"stored KV does not fit the model: {problem}")
            plan.press_size = enc.press_size if press is not None else 0
        return plan

    def _units(self, request: Request, plan: ReusePlan, strategy: ReuseStrategy | None) -> list[Unit]:
        """The prompt left to run: the document part (under the press, recorded alone), then the rest."""
        ids = list(plan.prefill_ids)
        if plan.prefill_positions is not None:
            return [Unit(ids, positions=list(plan.prefill_positions))] if ids else []
        n = plan.press_size
        units = [Unit(ids[:n], press=request.press, is_document=strategy is not None and n < len(ids))] if n else []
        return units + ([Unit(ids[n:])] if ids[n:] else [])

    def _decode_state(self, request: Request, enc: Encoded) -> DecodeState | None:
        if not request.max_new_tokens:
            return None
        return DecodeState(
            request.max_new_tokens,
            request.sampling,
            eos_token_ids=() if request.ignore_eos else self.eos_token_ids,
            stop=list(request.stop),
            tokenizer=self.tokenizer,
            on_token=request.on_token,
            processors=request.processors,
            prompt_ids=enc.ids if request.processors else (),
            logprobs=request.logprobs,
        )

    # ------------------------------------------------------------------------------------------ step parts
    def schedule(self, prefilling: list[Sequence], num_decoding: int) -> list[tuple[Sequence, int]]:
        """This step's prompt chunks (:mod:`kvforge.schedule`): the budget, reuse hits first, no starvation."""
        return schedule_chunks(prefilling, step_budget(self.chunk_size, self.prefill_budget, num_decoding))

    def _run_alone(self, seq: Sequence) -> None:
        """A press prefill (the press scores the whole unit) or a RAG recompute (tokens at their positions)."""
        unit = seq.units[0]
        if unit.positions is not None:
            seq.logits = prefill_at(self.model, unit.ids, unit.positions, seq.cache, chunk_size=self.chunk_size)
            seq.cache.token_ids = list(seq.plan.token_ids)
        else:
            _, seq.logits = self.prefill(unit.ids, seq.cache, press=unit.press, on_chunk=self._progress(seq))
        self._advance(seq, len(unit.ids))

    def _forward_timed(self, rows: list[list[int]], caches: list[KVCache]) -> Tensor:
        """``_forward``; a small step on CPU runs with the team size :class:`SmallStepThreads` measures faster."""
        tokens = sum(len(r) for r in rows)
        policy = self.small_step_threads
        if policy is None or tokens > threads.SMALL_STEP or self.model.device.type != "cpu":
            return self._forward(rows, caches)
        size = policy.pick()
        start = time.perf_counter()
        with threads.team(size):
            logits = self._forward(rows, caches)
        policy.observe(size, time.perf_counter() - start, tokens)
        return logits

    def _forward(self, rows: list[list[int]], caches: list[KVCache]) -> Tensor:
        """Last-token logits ``(N, V)`` of every row on its cache: one forward (a lone row runs as a plain one)."""
        if len(rows) == 1:
            return forward(self.model, rows[0], caches[0])[:, -1]
        return forward_packed(self.model, rows, caches)

    def _advance(self, seq: Sequence, num_tokens: int) -> None:
        """``num_tokens`` more of the current unit are prefilled."""
        seq.offset += num_tokens
        if seq.request.on_prefill is not None:
            total = len(seq.plan.prefill_ids)
            seq.request.on_prefill(total - seq.num_prompt_left, total)
        if seq.offset < len(seq.units[0].ids):
            return
        unit = seq.units.pop(0)
        seq.offset = 0
        if unit.is_document:
            seq.document = CacheSnapshot(seq.cache)
        if not seq.units:
            seq.prefilled_at = time.perf_counter()
            attach_policy(self.decoding_press, seq.cache)  # decoding keeps the budget (a no-op when attached at add)

    def _progress(self, seq: Sequence) -> Callable[[int, int], None] | None:
        report, total = seq.request.on_prefill, len(seq.plan.prefill_ids)
        if report is None:
            return None
        done = total - seq.num_prompt_left
        return lambda n, _: report(done + n, total)

    def _pick(self, seq: Sequence) -> int | None:
        """The next token of a decoding sequence (None: it ends here)."""
        assert seq.state is not None and seq.logits is not None
        num_tokens = len(seq.state.tokens)
        token = seq.state.pick(seq.logits)
        now = time.perf_counter()
        if seq.first_token_at is None:
            seq.first_token_at = now
        if len(seq.state.tokens) > num_tokens:
            seq.token_times.append(now)
        return token

    def _end(self, seq: Sequence, error: BaseException) -> Sequence:
        seq.error = error
        self.running.remove(seq)
        self._checks.pop(id(seq), None)  # a check that failed teaches nothing
        return seq

    def _finish(self, seq: Sequence) -> Sequence:
        """Build the generation and record what is new (after the answer, so it never delays the first token)."""
        self.running.remove(seq)
        state, now = seq.state, time.perf_counter()
        tokens = list(state.tokens) if state is not None else []
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if seq.request.stop:
            text = trim_at_stop(text, seq.request.stop)
        first = seq.first_token_at or now
        gen = Generation(
            text=text,
            token_ids=tokens,
            prompt_tokens=len(seq.encoded.ids),
            ttft_s=first - seq.started,
            decode_s=now - first,
            finish_reason=(state.finish_reason if state is not None else None) or "length",
            cache_bytes=seq.cache.nbytes(),
        )
        gen.info.update(seq.cache.info)
        gen.info["prefill_s"] = (seq.prefilled_at or now) - seq.started
        gen.info["cache_entries"] = seq.cache.num_entries()
        gen.info["token_times"] = seq.token_times
        if state is not None and state.num_logprobs is not None:
            gen.info["logprobs"] = state.logprobs
        if seq.strategy is not None:
            gen.reused_tokens = seq.plan.reused_tokens
            gen.reuse = seq.plan.facts(plan_s=round(seq.plan_s, 6), **self._record(seq))
        seq.generation = gen
        if (run := self._checks.pop(id(seq), None)) is not None:
            run.done(seq)
        if seq.plan.check is not None:
            self._start_check(seq.plan.check)
        return seq

    def _start_check(self, check: Check) -> None:
        """Queue ``check``'s two greedy requests (the prompt asked, prefilled in full; the donor's tokens on its
        stored KV): they step with the other requests, after the answer that asked for the check."""
        try:
            loaded = check.load()
            if loaded is None:
                return  # the donor's KV is gone: nothing to compare with
            cache, donor_ids = loaded
            requests = [Request(list(ids), check.num_tokens, reuse=reuse, encoded=Encoded(list(ids)))
                        for ids, reuse in ((check.asked_ids, False), (donor_ids, GivenCache(cache)))]  # fmt: skip
            run = _CheckRun(check)
            for request in requests:
                assert request.encoded is not None
                seq = self._add(request, request.encoded, None)
                self._checks[id(seq)] = run
                run.sides.append(seq)
        except Exception as e:  # a check is best effort: it must never cost an answer
            logger.warning("semantic check not run: %s: %s", type(e).__name__, e)

    def _record(self, seq: Sequence) -> dict[str, float | int]:
        """Store the prompt's new KV (a document: its KV alone, without the question); best effort."""
        start = time.perf_counter()
        if seq.document is not None:
            seq.document.restore()
        enc = seq.encoded
        from kvforge.store import track_writes

        with track_writes() as writes:  # what the store kept and skipped (a full or read-only disk, Redis down)
            try:
                seq.strategy.record(enc.ids, seq.cache, text=enc.text, context=enc.context)  # type: ignore[union-attr]
            except Exception as e:  # the answer is computed: a store that cannot take it costs only later reuse
                logger.warning("reuse record failed: %s: %s", type(e).__name__, e)
                writes.skipped.setdefault("<record>", f"{type(e).__name__}: {e}")
        return {"record_s": round(time.perf_counter() - start, 6), "stored_writes": len(writes.stored),
                "lost_writes": len(writes.lost)}

    # ------------------------------------------------------------------------------------------ stages
    def new_cache(self) -> KVCache:
        return KVCache.for_model(self.model, window=self.window, num_sink=self.num_sink)

    def prefill(
        self,
        ids: Seq[int],
        cache: KVCache | None = None,
        press: Press | None = None,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> tuple[KVCache, Tensor]:
        """Prefill ``ids`` on ``cache`` (new if None), compressing with ``press`` if given; returns (cache, logits)."""
        cache = cache if cache is not None else self.new_cache()
        if press is None:
            attach_policy(self.decoding_press, cache)
            return cache, prefill(self.model, list(ids), cache, chunk_size=self.chunk_size, on_chunk=on_chunk)
        logits = press.compress_prefill(
            self.model, list(ids), cache, chunk_size=self.chunk_size, tokenizer=self.tokenizer, on_chunk=on_chunk
        )
        return cache, logits

    def decode(
        self,
        cache: KVCache,
        logits: Tensor,
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: Seq[str] | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        """Decode one prefilled cache from its last ``logits`` (the step's per-sequence rule, for callers that
        prefill by hand); ``ttft_s`` = time to pick the first token."""
        state = DecodeState(max_new_tokens, sampling, eos_token_ids=self.eos_token_ids, stop=list(stop or ()),
                            tokenizer=self.tokenizer, on_token=on_token)  # fmt: skip
        attach_policy(self.decoding_press, cache)
        result = decode(self.model, cache, logits, state)
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return Generation(
            text=trim_at_stop(text, stop) if stop else text,
            token_ids=result.token_ids,
            prompt_tokens=0,
            ttft_s=result.first_token_s,
            decode_s=result.decode_s,
            finish_reason=result.finish_reason,
            cache_bytes=cache.nbytes(),
        )

    # ------------------------------------------------------------------------------------------ one-liners over run
    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        stop: Seq[str] | None = None,
        raw: bool = False,
        press: Press | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        """``run(Request(prompt, ...))``: chat text, messages or ids; a press compresses the whole prompt."""
        return self.run(Request(prompt, max_new_tokens, sampling or SamplingParams(), stop or (), raw, press,
                                on_token=on_token))  # fmt: skip

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
        stop: Seq[str] | None = None,
        quant: str | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        """``run(Request(Document(context, question), ...))``; ``query_aware=False``: the press sees the document."""
        return self.run(Request(Document(context, question, system, answer_prefix), max_new_tokens,
                                sampling or SamplingParams(), stop or (), press=press, query_aware=query_aware,
                                quant=quant, on_token=on_token))  # fmt: skip

    def answer_chunks(
        self,
        chunks: Seq[str],
        question: str,
        rag: ChunkReuse | None = None,
        system: str | None = None,
        separator: str = "\n\n",
        answer_prefix: str = "",
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: Seq[str] | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> Generation:
        """``run(Request(Chunks(chunks, question), reuse=rag))`` (``rag`` None: the engine's strategy)."""
        return self.run(Request(Chunks(list(chunks), question, system, separator, answer_prefix), max_new_tokens,
                                sampling or SamplingParams(), stop or (), reuse=rag or True,
                                on_token=on_token))  # fmt: skip

    def answer_many(
        self,
        context: str,
        questions: Seq[str],
        press: Press | None = None,
        system: str | None = None,
        answer_prefix: str = "",
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: Seq[str] | None = None,
    ) -> list[Generation]:
        """Several questions on one document, computed (and compressed by ``press``, query-agnostic) once: ``run``
        with document reuse (the engine's strategy when it stores documents, else an in-memory store)."""
        reuse = (
            self.reuse
            if isinstance(self.reuse, StoresCompressedDocuments)
            else DocumentReuse(MemoryStore(), self.model_id, self.model.device)
        )
        return [self.run(Request(Document(context, q, system, answer_prefix), max_new_tokens, sampling or
                                 SamplingParams(), stop or (), press=press, query_aware=False, reuse=reuse))
                for q in questions]  # fmt: skip


class _CheckRun:
    """The two sides of a running :class:`~kvforge.reuse.base.Check`; reports once both finished."""

    def __init__(self, check: Check) -> None:
        self.check = check
        self.sides: list[Sequence] = []

    def done(self, seq: Sequence) -> None:
        if not all(s.generation is not None for s in self.sides):
            return
        asked, donor = (s.generation for s in self.sides)
        assert asked is not None and donor is not None
        agree = asked.token_ids == donor.token_ids and asked.finish_reason == donor.finish_reason
        try:
            self.check.report(agree)
        except Exception as e:  # statistics that cannot be saved: the answer was already given
            logger.warning("semantic check outcome not recorded: %s: %s", type(e).__name__, e)


def _expired(seq: Sequence) -> bool:
    deadline = seq.request.deadline
    return deadline is not None and time.monotonic() > deadline


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
