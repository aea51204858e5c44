"""KVzip's context replay: the model is asked to repeat the context, which is teacher-forced as its answer, and the
max attention each context entry receives is its score (:class:`~kvforge.presses.kvzip.KVzipPress` explains the
method and its options). This module builds the replay's requests and runs it; it knows no press class: a press
names its replay settings in ``Needs.replay`` (:class:`ReplaySettings` are KVzip's defaults).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvforge.cache import CacheSnapshot, KVCache
from kvforge.prefill import prefill
from kvforge.presses.decoding import paused
from kvforge.presses.hooks import ReplayAttention

REPEAT_PROMPT = "Repeat the previous context exactly."
REPEAT_PART_PROMPT = "Repeat the part of the previous context exactly, starting with"
OVERLAP = 8  # a later chunk's request quotes the previous chunk's last tokens (KVzip / kvpress)
REPLAY_CHUNK = 2048
TURNS = ("continue", "new")
NORMALISE = ("chunk", "all")
logger = logging.getLogger(__name__)


@dataclass
class ReplaySettings:
    """How the context is replayed (KVzip's defaults; a :class:`~kvforge.presses.kvzip.KVzipPress` carries its own)."""

    prompt: str = REPEAT_PROMPT
    prompt_ids: list[int] | None = field(default=None, repr=False)
    chat_template: bool = True
    replay_chunk: int = REPLAY_CHUNK
    replay_turn: str = "continue"
    normalise: str = "chunk"
    keep_first: int = 4


def replay_key(settings: Any) -> tuple:
    """What makes two replays the same (one replay per setting is shared by every press and ratio using it)."""
    s = settings
    return (tuple(s.prompt_ids or ()), s.prompt, s.chat_template, s.replay_chunk, s.replay_turn, s.normalise,
            s.keep_first)  # fmt: skip


def replay_scores(
    model: Any,
    cache: KVCache,
    ids: Tensor,
    settings: Any,
    tokenizer: Any,
    chunk_size: int | None,
    start: list[int],
    layers: list[int],
) -> dict[int, Tensor]:
    """Teacher-force "repeat the context" + the context on top; undo. Returns ``{layer: (B, H, S)}``: the max
    attention each context entry received, taken inside the replay's attention (:class:`ReplayAttention` as
    ``cache.attention_hook``) for the compressible layers."""
    if cache.attention_hook is not None:
        raise ValueError("KVzip's replay cannot run on a cache that already has an attention hook (RAG assembly)")
    kvzip = settings  # a ReplaySettings or a KVzipPress: the same fields
    if kvzip.prompt_ids is None and tokenizer is None:
        logger.warning("KVzip without tokenizer or prompt_ids: repeating the context without an instruction")
    context = ids[0].tolist()
    # context tokens not repeated (as KVzip): the template header (found on the whole prompt: a BOS can be the
    # header's first token, as SmolLM2's <|im_start|>), else a leading BOS
    offset = header_length(tokenizer, context) if kvzip.chat_template else 0
    bos = getattr(tokenizer, "bos_token_id", None)
    if offset == 0 and bos is not None and context and context[0] == bos:
        offset = 1
    context = context[offset:]
    snapshot = CacheSnapshot(cache)
    bounds = {i: (start[i], cache.layers[i].length) for i in layers}
    scorer = ReplayAttention(bounds, normalise=kvzip.normalise, sinks=kvzip.keep_first)
    with paused(cache):
        cache.attention_hook = scorer
        try:
            for a, request in replay_requests(kvzip, tokenizer, context):  # each chunk behind its request, then undone
                scorer.chunk = (offset + a, offset + min(len(context), a + (kvzip.replay_chunk or len(context))))
                prefill(model, torch.tensor([request]), cache, chunk_size=chunk_size)
                snapshot.restore()
        finally:
            cache.attention_hook = None
            snapshot.restore()
    return scorer.scores


def head_scores_from_replay(reconstruction: dict[int, Tensor], num_layers: int, group: dict[int, int], skip: int):
    """``[layer][kv head]`` mean replay score of the context entries past the first ``skip`` (sinks)."""
    out: list[list[float] | None] = [None] * num_layers
    for idx, scores in reconstruction.items():  # (B, H, S) per query head
        b, h, s = scores.shape
        per_kv = scores.view(b, h // group[idx], group[idx], s).amax(dim=2)[..., min(skip, s - 1) :]
        out[idx] = per_kv.mean(dim=(0, 2)).tolist()
    return out


def header_length(tokenizer: Any, ids: list[int]) -> int:
    """Tokens of ``ids`` that are the chat template's header (system prompt + user role tokens), 0 without one.

    The header is what two renderings of a one-message chat with different contents share; the prompt's header is
    its common prefix with that.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return 0
    try:
        a, b = (_render(tokenizer, [{"role": "user", "content": c}], False) for c in ("a", "b"))
    except Exception:
        return 0
    return _common(a[: _common(a, b)], ids)


def replay_prefix(tokenizer: Any, prompt: str, use_template: bool, turn: str = "new") -> list[int]:
    """Token ids put before a teacher-forced context chunk.

    ``turn="continue"`` (KVzip's and kvpress's layout, for a context that ends inside the user turn that holds it, as
    :meth:`Engine.encode_qa` builds it): ``"\n\n" + prompt``, then the template's end of the user turn and the
    assistant's header. ``turn="new"``: the request as a later user turn of the template (no system prompt: the cache
    holds it) ending in the assistant's turn. Without a template: the bare prompt.
    """
    if use_template and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        if turn == "continue":
            suffix = _assistant_suffix(tokenizer)
            if suffix is not None:
                return _encode(tokenizer, "\n\n" + prompt) + _encode(tokenizer, suffix)
        try:
            earlier = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
            before = tokenizer.apply_chat_template(earlier, tokenize=False)
            after = tokenizer.apply_chat_template(
                [*earlier, {"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        except Exception:
            before, after = "", ""
        if after.startswith(before) and after != before:
            return _encode(tokenizer, after[len(before) :])
    if tokenizer is None:
        return []
    return _encode(tokenizer, "\n\n" + prompt + "\n")


def replay_requests(press: Any, tokenizer: Any, context: list[int]) -> list[tuple[int, list[int]]]:
    """``[(offset, ids), ...]``: each context chunk (``replay_chunk`` tokens from ``offset``) behind its request.

    With ``replay_turn="continue"`` a later chunk is asked for as KVzip does ("Repeat the part of the previous
    context exactly, starting with" + the previous chunk's last 8 tokens); otherwise every chunk repeats the prompt.
    """
    step = press.replay_chunk or len(context) or 1
    if press.prompt_ids is not None:
        first = later = list(press.prompt_ids)
    elif tokenizer is None:
        first = later = []
    else:
        first = replay_prefix(tokenizer, press.prompt, press.chat_template, press.replay_turn)
        later = first
    continued = press.prompt_ids is None and press.replay_turn == "continue" and press.chat_template
    suffix = _assistant_suffix(tokenizer) if continued and tokenizer is not None else None
    out = []
    for a in range(0, max(1, len(context)), step):
        chunk = context[a : a + step]
        if a and suffix is not None:
            quote = context[max(0, a - OVERLAP) : a]
            later = _encode(tokenizer, "\n\n" + REPEAT_PART_PROMPT) + quote + _encode(tokenizer, suffix)
        out.append((a, (later if a else first) + chunk))
    return out


def _assistant_suffix(tokenizer: Any) -> str | None:
    """What the template puts after a user message's content: end of the user turn + the assistant's header."""
    marker = "\x00kvzip\x00"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
        )
    except Exception:
        return None
    return text.split(marker, 1)[1] if marker in text else None


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _render(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
