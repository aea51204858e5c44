"""Run examples x methods x compression ratios on an engine; append one JSON row per run to ``results.jsonl``.

A :class:`Trial` is one row kind: a method at a ratio, with a ``prefill(engine, example)`` that builds the cache the
answer is decoded from: an engine request (a press during prefill, RAG chunk reuse, a stored document) stepped until
its prompt is prefilled (:func:`prefill_request`). Per example the
full cache trial runs first: its cache size is the reference for ``kept_ratio`` and its teacher-forced distributions the
reference for the fidelity metrics, computed once per example and shared by every method and ratio. Decoding is
greedy, so runs are deterministic; rows are keyed by (example id, method, ratio) and a re-run skips finished rows.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kvforge.cache import KVCache
from kvforge.engine import Engine
from kvforge.errors import UserError
from kvforge.eval import fidelity
from kvforge.eval.data import Example
from kvforge.eval.metrics import score_prediction
from kvforge.kvzap_train import ensure_trained
from kvforge.request import Chunks, Document, Request
from kvforge.reuse.base import GivenCache, PromptContext
from kvforge.reuse.rag import RagPrompt
from kvforge.sequence import Sequence

logger = logging.getLogger(__name__)
FULL = "full"


@dataclass
class Prefilled:
    """A prompt's cache, ready to decode: the last prompt token's logits ``(1, V)`` and what building it cost."""

    cache: KVCache
    logits: Tensor
    ttft_s: float
    prompt_ids: list[int]
    info: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, Any] = field(default_factory=dict)  # extra row columns (stored trials: stored_bytes, quant)


@dataclass(frozen=True)
class Trial:
    """One row kind of the sweep: ``method`` at ``compression_ratio``, and how it prefills an example."""

    method: str
    compression_ratio: float
    prefill: Callable[[Engine, Example], Prefilled]
    press: Any = None  # a press trial's press (None: the full cache); lets the runner share one prefill
    query_aware: bool | None = None  # set on press trials only (None: not a press trial)

    @property
    def key(self) -> tuple[str, float]:
        return self.method, round(self.compression_ratio, 6)


def prefill_request(engine: Engine, request: Request, max_new_tokens: int) -> tuple[Prefilled, Sequence]:
    """Run ``request`` through the engine up to its first token (it generates nothing): its cache, last logits and
    TTFT (the plan: store reads, RAG assembly; the prefill under its press; picking the first token)."""
    enc = engine.encode(request)
    engine.check_length(len(enc.ids), max_new_tokens)
    _sync()
    seq = engine.add(request)
    gen = engine.complete(seq)
    assert seq.logits is not None
    start = time.perf_counter()
    seq.logits.argmax(-1).tolist()  # the first token: forces the computation (and a GPU sync)
    ttft = gen.ttft_s + time.perf_counter() - start
    return Prefilled(seq.cache, seq.logits, ttft, list(seq.plan.token_ids)), seq


def document_of(example: Example) -> Document:
    return Document(example.context, example.question, example.system, example.answer_prefix)


def press_trial(method: str, compression_ratio: float, query_aware: bool = True) -> Trial:
    """A trial that prefills under the press ``method`` (``full``: no press).

    Query-aware: the press sees context and question (the question ends the observation window). Query-agnostic:
    the press compresses the context alone, the question is prefilled on top, uncompressed (the cache could be
    reused for any question). TTFT covers prefill, compression and picking the first token.
    """
    press = None
    if method != FULL:
        from kvforge.presses import build_press

        press = build_press(method, compression_ratio=compression_ratio)

    def prefill(engine: Engine, example: Example) -> Prefilled:
        ensure_trained(press, engine.model, engine.tokenizer)  # a learned press's scorer: trained once per model
        request = Request(document_of(example), max_new_tokens=0, press=press, query_aware=query_aware, reuse=False)
        return prefill_request(engine, request, example.max_new_tokens)[0]

    return Trial(method, 0.0 if method == FULL else compression_ratio, prefill, press, query_aware)


def ttft_stages(pre: Prefilled) -> dict[str, float]:
    """``pre.ttft_s`` split into ``prefill`` (the forward passes and picking the first token), ``compression`` (the
    press's scoring and selection, KVzip's replay included) and ``lookahead`` (draft tokens), from the press's
    per-stage clocks; the three add up to the TTFT."""
    info = getattr(pre.cache, "info", {}).get("press") or {}
    seconds = info.get("seconds", {})
    lookahead = float(seconds.get("lookahead", 0.0))
    compression = float(seconds.get("reconstruction", 0.0)) + float(seconds.get("compress", 0.0))
    prefill = max(0.0, pre.ttft_s - lookahead - compression)
    return {"prefill": round(prefill, 6), "compression": round(compression, 6), "lookahead": round(lookahead, 6)}


def press_trials(methods: Seq[str], ratios: Seq[float], query_aware: bool = True) -> list[Trial]:
    """The full cache once, then every other method at every ratio, ratio by ratio in the given order (a time-boxed
    run then covers every method at the first ratio). Presses are built now, so a bad name fails early."""
    trials = [press_trial(FULL, 0.0, query_aware)]
    trials += [press_trial(m, r, query_aware) for r in ratios for m in methods if m != FULL]
    return trials


_CHUNK_STORES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def chunk_trial(
    method: str, recompute_ratio: float = 0.2, aux: Any = None, aux_name: str | None = None, **kwargs: Any
) -> Trial:
    """A trial answering over the example's chunks (``example.chunks``, else the context as one chunk) with RAG chunk
    reuse ``method`` (:data:`kvforge.reuse.rag.STRATEGIES`; ``full`` prefills the same prompt without reuse).

    Chunks are precomputed and stored before the clock starts ("chunks already stored"; one in-memory store per
    engine shared by the trials of the current example); TTFT covers the plan (loads, re-rotation, CacheBlend/
    CacheClip selection), the recomputation it lists and the first token. The recompute ratio keys the rows (ratio
    column).
    """
    from kvforge.reuse.rag import RECOMPUTING, ChunkReuse, make_strategy

    ratio = recompute_ratio if method in RECOMPUTING else 0.0
    if aux is not None:
        kwargs["aux"] = aux
    built = make_strategy(method, ratio if method in RECOMPUTING else None, **kwargs)
    name = method if aux_name is None else f"{method}:{aux_name}"

    def prefill(engine: Engine, example: Example) -> Prefilled:
        from kvforge.store.memory import MemoryStore

        held = _CHUNK_STORES.get(engine)
        if held is None or held[0] != example.id:  # one example's chunks at a time: memory stays bounded
            held = _CHUNK_STORES[engine] = (example.id, MemoryStore())
        rag = ChunkReuse(engine.model, engine.tokenizer, store=held[1], model_id=engine.model_id, method=built)
        docs = list(example.chunks) if example.chunks else [example.context]
        chunks = Chunks(docs, example.question, example.system, answer_prefix=example.answer_prefix)
        request = Request(chunks, max_new_tokens=0, reuse=rag)
        encoded = engine.encode(request)
        assert isinstance(encoded.context, RagPrompt)
        rag.warm(encoded.context)  # stored before the clock starts
        pre, seq = prefill_request(engine, request, example.max_new_tokens)
        pre.info = seq.plan.summary() | {"strategy": method, "recompute_ratio": ratio}
        return pre

    return Trial(name, ratio, prefill)


def chunk_trials(methods: Seq[str], ratios: Seq[float], aux: dict[str, Any] | None = None) -> list[Trial]:
    """``full`` first, then every method (recomputing ones at every ratio, CacheClip also with each aux model)."""
    from kvforge.reuse.rag import RECOMPUTING

    trials = [chunk_trial(FULL)]
    for r in ratios:
        for m in methods:
            if m == FULL or (m not in RECOMPUTING and r != ratios[0]):
                continue
            trials.append(chunk_trial(m, r))
            if m == "cacheclip":
                trials += [chunk_trial(m, r, aux=a, aux_name=n) for n, a in (aux or {}).items()]
    return trials


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_memory() -> int:
    """Peak GPU memory allocated since the last reset, or else the process's resident-set high-water mark."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


_OPTIONS = {"mode": "--query-agnostic", "separate_prefill": "--separate-prefill", "model_id": "the model's weights"}


def _option(setting: str) -> str:
    """The command-line option behind a ``run.json`` setting (``max_new_tokens`` -> ``--max-new-tokens``)."""
    return _OPTIONS.get(setting, "--" + setting.replace("_", "-"))


def read_run_info(out_dir: str | Path) -> dict[str, Any]:
    """``out_dir/run.json`` as ``{"settings": {...}, "runs": [...]}`` (also for one written by kvforge <= 0.1.0)."""
    path = Path(out_dir) / "run.json"
    if not path.is_file():
        return {"settings": {}, "runs": []}
    info = json.loads(path.read_text())
    return info if "settings" in info else {"settings": info, "runs": []}


def row_key(row: dict[str, Any]) -> tuple[str, str, float]:
    return str(row["id"]), str(row["method"]), round(float(row["compression_ratio"]), 6)


def load_rows(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """Rows already written; a torn line from an interrupted run is dropped (and, with ``repair``, removed from the
    file so that appending starts on a fresh line)."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    rows, is_torn = [], bool(text) and not text.endswith("\n")
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s:%d: unreadable row dropped (interrupted write?)", path, line_no)
            is_torn = True
    if repair and is_torn:
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return rows


@dataclass
class _FullReference:
    """What every trial of one example compares against."""

    num_entries: int | None = None
    cont_ids: list[int] | None = None
    logprobs: Tensor | None = None


class SharedPrefill:
    """One example's prompt prefilled once; every press trial of the example compresses a restored copy of it.

    Query-aware: the prompt is context + question, compressed whole. Query-agnostic: the context is compressed, then
    the question is prefilled on top (an engine request on the compressed cache: :class:`~kvforge.reuse.GivenCache`).
    A trial's TTFT is the shared prefill's time (plus the lookahead drafts' time if its press uses them) + its own
    compression + the question's prefill, i.e. what a run with this press alone takes (the per-stage clocks of
    :class:`kvforge.presses.CompressionSource`); the rows equal those of separate prefills.
    """

    def __init__(self, engine: Engine, example: Example, needs: Any, query_aware: bool) -> None:
        from kvforge.presses import CompressionSource

        self.engine, self.example = engine, example
        self.encoded = engine.encode(Request(document_of(example), max_new_tokens=0))
        engine.check_length(len(self.encoded.ids), example.max_new_tokens)
        assert isinstance(self.encoded.context, PromptContext) or self.encoded.context is None
        num_context = self.encoded.context.num_tokens if self.encoded.context is not None else 0
        self.whole = query_aware or not num_context or num_context == len(self.encoded.ids)
        ids = self.encoded.ids if self.whole else self.encoded.ids[:num_context]
        input_ids = torch.tensor([ids], dtype=torch.long, device=engine.model.device)
        _sync()
        self.source = CompressionSource(
            engine.model, input_ids, engine.new_cache(), needs, chunk_size=engine.chunk_size, tokenizer=engine.tokenizer
        )
        _sync()

    def run(self, press: Any) -> Prefilled:
        _sync()
        start = time.perf_counter()
        if press is None:
            cache, shared_s = self.source.restore(), self.source.seconds["prefill"]
        else:
            cache = self.source.compress(press)
            info = cache.info["press"]
            shared_s = self.source.seconds["prefill"] + info["seconds"]["lookahead"]
            if info.get("replay_reused"):  # a KVzip replay shared with an earlier press: count it as if run here
                shared_s += info["seconds"]["reconstruction"]
        given = GivenCache(cache, self.source.logits if self.whole else None)
        request = Request(document_of(self.example), max_new_tokens=0, reuse=given, encoded=self.encoded)
        pre, _ = prefill_request(self.engine, request, self.example.max_new_tokens)
        pre.ttft_s = shared_s + time.perf_counter() - start
        return pre


class EvalRunner:
    """Runs trials over examples on ``engine`` and appends rows to ``out_dir/results.jsonl``.

    Args:
        engine: an :class:`kvforge.engine.Engine` (``encode_qa``, ``prefill``, ``decode``, ``model``, ``tokenizer``).
        trials: row kinds; the first must be the full cache (``press_trials`` does this).
        run_info: every setting that changes rows (model, mode, ...: see ``kvforge eval``), saved in
            ``out_dir/run.json`` under ``settings``; a re-run must match it, or is refused naming the option.
        provenance: what ran (versions, git sha, command...): recorded in ``run.json`` once per run that added rows.
        with_fidelity: add ``answer_nll``, ``kl``, ``top1_agreement`` and ``needle_kept`` columns.
        max_new_tokens: cap on each example's ``max_new_tokens``.
        share_prefill: prefill each example once for all press trials (:class:`SharedPrefill`; same rows, a
            fraction of the time); False prefills every trial separately (TTFT measured end to end per trial).
    """

    def __init__(
        self,
        engine: Engine,
        trials: Seq[Trial],
        out_dir: str | Path,
        run_info: dict[str, Any],
        with_fidelity: bool = False,
        max_new_tokens: int | None = None,
        fidelity_tokens: int = 64,
        share_prefill: bool = True,
        provenance: dict[str, Any] | None = None,
    ) -> None:
        if not trials or trials[0].method != FULL:
            raise ValueError("the first trial must be the full cache (the reference of every other row)")
        self.engine, self.trials, self.out_dir = engine, list(trials), Path(out_dir)
        self.run_info = run_info | {
            "fidelity": with_fidelity,
            "fidelity_tokens": fidelity_tokens if with_fidelity else None,
            "max_new_tokens": max_new_tokens,
            "separate_prefill": not share_prefill,
        }
        self.provenance = provenance or {}
        self.with_fidelity, self.max_new_tokens, self.fidelity_tokens = with_fidelity, max_new_tokens, fidelity_tokens
        self.results_path = self.out_dir / "results.jsonl"
        self.share_prefill = share_prefill
        self._shared: dict[bool, SharedPrefill] = {}  # the current example's shared prefills, by query_aware

    def _check_run_info(self) -> None:
        """Refuse to add rows to a folder whose rows were made with other settings; record this run's provenance."""
        info_path = self.out_dir / "run.json"
        runs: list[dict[str, Any]] = []
        if info_path.is_file():
            old = json.loads(info_path.read_text())
            stored = old.get("settings", old)  # a run.json of kvforge <= 0.1.0 holds the settings at its top level
            # that one recorded fewer settings: compare those it has
            keys = sorted(set(stored) | set(self.run_info)) if "settings" in old else sorted(stored)
            diff = [k for k in keys if stored.get(k) != self.run_info.get(k)]
            if diff:
                changes = "; ".join(f"{_option(k)} was {stored.get(k)!r}, now {self.run_info.get(k)!r}" for k in diff)
                raise UserError(
                    f"{self.out_dir} holds rows made with other settings ({changes}): resume with the same "
                    "options, or use another --out"
                )
            runs = list(old.get("runs", []))
        if self.provenance and (not runs or runs[-1] != self.provenance):
            runs.append(self.provenance)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        info = {"settings": self.run_info, "runs": runs}
        info_path.write_text(json.dumps(info, indent=2) + "\n")

    def run(self, examples: Seq[Example], progress: bool = True) -> list[dict[str, Any]]:
        """Run every unfinished (example, trial) pair; returns all rows of ``results.jsonl``."""
        from tqdm.auto import tqdm

        self._check_run_info()
        for trial in self.trials:  # learned scorers trained (once per model) before any prefill shares them
            ensure_trained(trial.press, self.engine.model, self.engine.tokenizer)
        done = {row_key(r): r for r in load_rows(self.results_path, repair=True)}
        total = len(examples) * len(self.trials)
        finished = sum((e.id, *t.key) in done for e in examples for t in self.trials)
        logger.info("%d of %d rows already in %s", finished, total, self.results_path)
        with (
            self.results_path.open("a", encoding="utf-8") as out,
            tqdm(total=total, initial=finished, disable=not progress, desc="eval", unit="run", file=sys.stderr) as bar,
        ):
            for example in examples:
                if all((example.id, *t.key) in done for t in self.trials):
                    continue
                ref = _FullReference()
                self._shared.clear()
                full_row = done.get((example.id, FULL, 0.0))
                if full_row is not None:
                    ref.num_entries = full_row.get("num_entries")
                for trial in self.trials:
                    if (example.id, *trial.key) in done:
                        continue
                    bar.set_postfix_str(f"{example.id} {trial.method}@{trial.compression_ratio:g}", refresh=False)
                    row = self.run_one(example, trial, ref)
                    out.write(json.dumps(row, ensure_ascii=False) + "\n")
                    out.flush()
                    done[row_key(row)] = row
                    bar.update(1)
                self._shared.clear()
        return load_rows(self.results_path)

    def _prefill(self, example: Example, trial: Trial) -> Prefilled:
        """``trial``'s cache for ``example``: from the example's shared prefill when the trial is a press trial."""
        if not self.share_prefill or trial.query_aware is None:
            return trial.prefill(self.engine, example)
        shared = self._shared.get(trial.query_aware)
        if shared is None:
            from kvforge.presses import Needs

            needs = Needs()
            for t in self.trials:
                if t.press is not None and t.query_aware == trial.query_aware and t.press.ratio() > 0:
                    needs = needs.merge(t.press.needs())
            shared = self._shared[trial.query_aware] = SharedPrefill(self.engine, example, needs, trial.query_aware)
        return shared.run(trial.press)

    def _full_reference(self, example: Example, ref: _FullReference, pre: Prefilled | None) -> None:
        """Fill in the full cache's teacher-forced distributions (re-prefilling it when resuming)."""
        if pre is None:
            pre = self._prefill(example, self.trials[0])
        if ref.num_entries is None:
            ref.num_entries = pre.cache.num_entries()
        ref.cont_ids = fidelity.continuation_ids(self.engine.tokenizer, example, self.fidelity_tokens)
        if ref.cont_ids:
            ref.logprobs = fidelity.teacher_forced_logprobs(self.engine.model, pre.cache, pre.logits, ref.cont_ids)

    def run_one(self, example: Example, trial: Trial, ref: _FullReference) -> dict[str, Any]:
        """Prefill, measure, decode and score one (example, trial) pair."""
        is_full = trial.method == FULL
        if not is_full:  # resumed without the full row: rebuild the references first (a shared prefill holds one
            # cache, so it must not be restored under this trial's compressed cache later)
            if self.with_fidelity and ref.logprobs is None and ref.cont_ids != []:
                self._full_reference(example, ref, None)
            if ref.num_entries is None:
                ref.num_entries = self._prefill(example, self.trials[0]).cache.num_entries()
        _reset_peak()
        pre = self._prefill(example, trial)
        cache_bytes, num_entries = pre.cache.nbytes(), pre.cache.num_entries()
        if is_full:
            ref.num_entries = num_entries
        extra: dict[str, Any] = {}
        if self.with_fidelity:
            if is_full and ref.logprobs is None and ref.cont_ids != []:
                self._full_reference(example, ref, pre)
            extra = self._fidelity(example, pre, ref, is_full)
        max_new = min(example.max_new_tokens, self.max_new_tokens or example.max_new_tokens)
        given = GivenCache(pre.cache, pre.logits)  # decoded by the engine's loop from the prefilled cache
        gen = self.engine.run(Request(pre.prompt_ids, max_new, reuse=given))
        return {
            "id": example.id,
            "task": example.task,
            "metric": example.metric,
            "method": trial.method,
            "compression_ratio": trial.compression_ratio,
            "prediction": gen.text,
            "answers": example.answers,
            "score": score_prediction(gen.text, example.answers, example.metric),
            "ttft_s": pre.ttft_s,
            "ttft_stages": ttft_stages(pre),
            "decode_s": gen.decode_s,
            "prompt_tokens": len(pre.prompt_ids),
            "new_tokens": len(gen.token_ids),
            "cache_bytes": cache_bytes,
            "num_entries": num_entries,
            "kept_ratio": num_entries / ref.num_entries if ref.num_entries else None,
            "peak_memory_bytes": _peak_memory(),
            **pre.columns,
            **extra,
            **({"info": pre.info} if pre.info else {}),
        }

    def _fidelity(self, example: Example, pre: Prefilled, ref: _FullReference, is_full: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if ref.cont_ids and ref.logprobs is not None:
            if is_full:  # the reference itself: no second teacher-forced pass
                logprobs = ref.logprobs
            else:
                logprobs = fidelity.teacher_forced_logprobs(self.engine.model, pre.cache, pre.logits, ref.cont_ids)
            out |= fidelity.fidelity_metrics(logprobs, ref.logprobs, ref.cont_ids)
        if example.needles:
            positions = fidelity.needle_positions(self.engine.tokenizer, pre.prompt_ids, example.needles)
            out["needle_kept"] = fidelity.needle_kept(pre.cache, positions)
        return out
