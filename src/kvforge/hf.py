"""transformers-native use: ``model.generate`` on kvforge caches and presses, kvpress-style.

>>> with build_press("snapkv", compression_ratio=0.5)(model):  # doctest: +SKIP
...     out = model.generate(input_ids, max_new_tokens=32)

Inside :func:`attach` (what ``press(model)`` returns) the model's ``forward`` is wrapped, and the wrapper only
routes: a forward that carries a :class:`~kvforge.cache.KVCache` runs as kvforge's own (:func:`kvforge.prefill.prefill`:
positions from the cache, not generate's ``position_ids``; kvforge attention with the cache's per-layer / per-head
masks; chunked); with a press, the prompt of a fresh ``generate`` (transformers' empty DynamicCache) is prefilled into
a new KVCache and compressed exactly as :class:`~kvforge.engine.Engine` does (``press.compress_prefill``:
observation window, lookahead drafts, KVzip replay), and the decoding steps that follow run on that compressed cache
(new tokens prefilled on a KVCache passed in, more than one at a time, are compressed likewise). Every other forward
goes to the model untouched. On exit (also on error) the wrapper is removed: the model is the object it was.

Why a wrapper and not only transformers' ``AttentionInterface``: kvforge's attention needs the cache's positions,
which transformers never hands to an attention function, and a press must see the whole prompt before the first
decoding step. Outside the block, ``model.generate(past_key_values=kv_cache)`` still works with the model's own
attention whenever transformers' masks can describe the cache (see :mod:`kvforge.cache`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from kvforge import compat
from kvforge.cache import KVCache
from kvforge.errors import UserError
from kvforge.prefill import DEFAULT_CHUNK_SIZE, forward, prefill

__all__ = ["attach"]

_UNSUPPORTED_OUTPUTS = ("output_attentions", "output_hidden_states", "inputs_embeds")


@contextmanager
def attach(
    model: Any, press: Any = None, *, tokenizer: Any = None, chunk_size: int | None = DEFAULT_CHUNK_SIZE
) -> Iterator[Any]:
    """Run ``model`` (and its ``generate``) through kvforge inside the block; the model is given back as it was.

    Args:
        model: a Hugging Face causal LM.
        press: compress every prompt prefilled in the block (None: only route forwards on a KVCache).
        tokenizer: what Engine would pass to the press (KVzip encodes its "repeat the context" request with it).
        chunk_size: prefill chunk, as :class:`~kvforge.engine.Engine`'s.

    Raises:
        UserError: a press that replays the context (KVzip family) without ``tokenizer``.
    """
    if chunk_size is not None and chunk_size < 1:
        raise UserError(f"chunk size must be >= 1, got {chunk_size}")
    if press is not None and tokenizer is None and press.needs_tokenizer():
        name = getattr(press, "registry_name", press.name)
        raise UserError(
            f"press {name!r} encodes its context replay with the tokenizer: use press(model, tokenizer=...)"
        )
    router = _Router(model, model.forward, press, tokenizer, chunk_size)
    had_own = "forward" in model.__dict__  # e.g. accelerate's hooks put a forward on the instance
    own = model.__dict__.get("forward")
    model.forward = functools.wraps(router.original)(router)
    try:
        yield model
    finally:
        if had_own:
            model.forward = own
        else:
            del model.forward


class _Router:
    """The wrapped ``forward``: kvforge's own forwards and foreign caches pass; KVCache forwards run as kvforge's."""

    def __init__(self, model: Any, original: Any, press: Any, tokenizer: Any, chunk_size: int | None) -> None:
        self.model, self.original, self.press = model, original, press
        self.tokenizer, self.chunk_size = tokenizer, chunk_size

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if "kv_cache" in kwargs:  # a forward of kvforge.prefill: already kvforge's
            return self.original(*args, **kwargs)
        cache = compat.cache_from(kwargs)  # ``cache=`` on new releases, ``past_key_values=`` on older ones
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(cache, KVCache):  # under a press, new tokens on a passed cache are a prefill: compressed
            compress = self.press is not None and input_ids is not None and input_ids.shape[1] > 1
            return self._run(cache, input_ids, kwargs, compress=compress)
        if self.press is None or input_ids is None or kwargs.get("use_cache") is False:
            return self.original(*args, **kwargs)
        if cache is not None and cache.get_seq_length() > 0:
            raise UserError(
                "a press compresses a prompt into a kvforge cache; this generate continues a transformers cache that "
                "already holds tokens: convert it first with KVCache.from_dynamic(cache, model)"
            )
        return self._run(KVCache.for_model(self.model), input_ids, kwargs, compress=True)

    @torch.inference_mode()
    def _run(self, cache: KVCache, input_ids: Tensor | None, kwargs: dict[str, Any], compress: bool) -> Any:
        _check_inputs(cache, input_ids, kwargs)
        assert input_ids is not None
        keep = kwargs.get("logits_to_keep", 0)  # generate asks for 1; a direct call for all (0)
        if compress:
            if input_ids.shape[0] != 1:
                raise UserError(f"with press(model): generate takes one sequence (batch 1), got {input_ids.shape[0]}")
            if keep != 1:
                raise UserError("under a press a prefill gives the last token's logits only: pass logits_to_keep=1")
            logits = self.press.compress_prefill(
                self.model, input_ids, cache, chunk_size=self.chunk_size, tokenizer=self.tokenizer
            )[:, None, :]
        elif keep == 1:
            logits = prefill(self.model, input_ids, cache, chunk_size=self.chunk_size)[:, None, :]
        else:
            logits = forward(self.model, input_ids, cache, logits_to_keep=keep)
        return compat.causal_lm_output(logits, cache)


def _check_inputs(cache: KVCache, input_ids: Tensor | None, kwargs: dict[str, Any]) -> None:
    """Refuse what a kvforge forward cannot honour, in one line each (never silently ignored)."""
    if input_ids is None:
        raise UserError("a forward on a KVCache takes input_ids (inputs_embeds are not supported)")
    asked = [k for k in _UNSUPPORTED_OUTPUTS if kwargs.get(k) is not None and kwargs.get(k) is not False]
    if asked:
        raise UserError(f"a forward on a KVCache does not support {', '.join(asked)}")
    mask = kwargs.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2 and not bool(mask.all()):
        raise UserError("a KVCache does not take padded batches (attention_mask with zeros): run one row at a time")
    n = input_ids.shape[1]
    if cache.next_position and n == cache.next_position and input_ids[0].tolist() == cache.token_ids[-n:]:
        raise UserError(
            f"all {n} tokens of input_ids are already in the cache: pass at least one new token (as with any HF "
            "cache, prefill all but the last prompt token, or append the next tokens)"
        )
