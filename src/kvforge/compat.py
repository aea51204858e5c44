"""The one seam towards transformers' internals: every name kvforge needs from them is read here, and only here.

kvforge runs a model's own decoder layers on its own cache and attention, so it depends on calling conventions
that transformers changes between releases: the forward's cache keyword (``past_key_values`` up to 5.22, ``cache``
from 5.23 with the old name deprecated), what a decoder layer passes to ``Cache.update`` (``(k, v, layer_idx)``, then
``(k, v, layer_idx, kwargs=...)``), the output field that carries the cache, attention-interface and mask-function
registration, the config field that selects an attention implementation, how decoder layers and their attention
modules are laid out, and ``DynamicCache``'s constructor. Each is adapted once below and tested against the oldest
and the newest release of :data:`TRANSFORMERS_RANGE` (``tests/test_compat.py``); kvforge itself always speaks the
release's current names, so no deprecation warning reaches a user.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from transformers.cache_utils import Cache

__all__ = [
    "TRANSFORMERS_RANGE",
    "Cache",
    "attention_inputs",
    "attention_modules",
    "cache_arg",
    "cache_from",
    "causal_lm_output",
    "dynamic_cache",
    "dynamic_cache_layers",
    "find_rotary",
    "get_attn_implementation",
    "model_configs",
    "output_cache",
    "quiet_transformers",
    "register_attention",
    "set_attn_implementation",
    "transformers_version",
]

#: The transformers releases kvforge is tested on (kept equal to pyproject.toml by tests/test_compat.py).
TRANSFORMERS_RANGE = ">=5.16.1,<5.25"

#: Keyword names a model's forward (or ``generate``) may carry the cache under, the current one first.
CACHE_KWARGS = ("cache", "past_key_values")


def transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


# ----------------------------------------------------------------------------------------- the cache keyword
@functools.cache
def _forward_cache_kwarg(forward_cls: type) -> str:
    """The cache keyword a model class's ``forward`` declares (``cache`` on new releases, else ``past_key_values``)."""
    try:
        params = inspect.signature(forward_cls.forward).parameters  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_arg(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for a call of ``model(...)`` (or ``model.generate``) on this release, warning-free."""
    return {_forward_cache_kwarg(type(model)): cache}


def cache_from(kwargs: dict[str, Any]) -> Any:
    """The cache a forward was called with, under either keyword (None when there is none)."""
    for name in CACHE_KWARGS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def output_cache_field() -> str:
    """The field of ``CausalLMOutputWithPast`` that carries the cache on this release."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = getattr(CausalLMOutputWithPast, "__dataclass_fields__", {})
    return "cache" if "cache" in fields else "past_key_values"


def output_cache(output: Any) -> Any:
    """The cache a model or ``generate`` output carries (under this release's field name)."""
    return getattr(output, output_cache_field(), None)


def causal_lm_output(logits: Tensor, cache: Any) -> Any:
    """A ``CausalLMOutputWithPast`` holding ``logits`` and ``cache`` where this release's ``generate`` reads it."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(logits=logits, **{output_cache_field(): cache})


# ----------------------------------------------------------------------------------------- attention
def register_attention(name: str, fn: Any) -> None:
    """Register attention function ``fn`` as ``name``, with sdpa's mask function (for users who select it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)


def model_configs(model: Any) -> list[Any]:
    """Every config whose attention implementation the model's attention layers read (top, sub-configs, modules).

    Found once per model (walking the modules costs ~2 ms, paid by every forward otherwise)."""
    try:
        return _MODEL_CONFIGS[model]
    except (KeyError, TypeError):
        pass
    configs = _find_configs(model)
    with contextlib.suppress(TypeError):  # not weak-referenceable: found again next time
        _MODEL_CONFIGS[model] = configs
    return configs


_MODEL_CONFIGS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def _find_configs(model: Any) -> list[Any]:
    configs: dict[int, Any] = {}
    pending = [model.config]
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation_internal"):
            pending.append(config)
    while pending:
        config = pending.pop()
        if id(config) in configs:
            continue
        configs[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if sub is not None and hasattr(sub, "_attn_implementation_internal"):
                pending.append(sub)
    return list(configs.values())


def get_attn_implementation(config: Any) -> str | None:
    """The attention implementation a config selects (None: transformers' default)."""
    return config._attn_implementation_internal  # type: ignore[no-any-return]


def set_attn_implementation(config: Any, name: str | None) -> None:
    """Select attention implementation ``name`` on one config, without transformers' checks (kvforge's scopes)."""
    config._attn_implementation_internal = name


@contextmanager
def attn_implementation(model: Any, name: str) -> Iterator[Any]:
    """Run ``model`` with attention implementation ``name`` inside the block; the previous one is given back."""
    configs = [c for c in model_configs(model) if get_attn_implementation(c) != name]
    previous = [get_attn_implementation(c) for c in configs]
    for config in configs:
        set_attn_implementation(config, name)
    try:
        yield model
    finally:
        for config, impl in zip(configs, previous, strict=True):
            set_attn_implementation(config, impl)


# ----------------------------------------------------------------------------------------- model layout
_LAYER_PATHS = ("layers", "model.layers", "language_model.layers", "model.language_model.layers")


def attention_modules(model: Any) -> list[nn.Module]:
    """The ``self_attn`` module of every decoder layer, in layer order (Llama, Qwen2/3, Mistral, Gemma3...)."""
    for root in (model, getattr(model, "model", None)):
        if root is None:
            continue
        for path in _LAYER_PATHS:
            obj = root
            for part in path.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if isinstance(obj, nn.ModuleList) and len(obj) and hasattr(obj[0], "self_attn"):
                return [layer.self_attn for layer in obj]
    raise ValueError(f"cannot find decoder layers with self_attn in {type(model).__name__}")


def attention_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Tensor | None, Any]:
    """``(hidden_states, position_embeddings)`` an attention module's forward was called with (forward hooks)."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    return hidden, kwargs.get("position_embeddings")


def find_rotary(model: Any) -> nn.Module | None:
    """The model's rotary-embedding module (None for models without RoPE)."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            return module  # type: ignore[no-any-return]
    return None


# ----------------------------------------------------------------------------------------- DynamicCache
def dynamic_cache(pairs: list[tuple[Tensor, Tensor]]) -> Any:
    """A ``transformers.DynamicCache`` holding one ``(keys, values)`` pair per layer."""
    from transformers import DynamicCache

    return DynamicCache(pairs)


def dynamic_cache_layers(dynamic: Any) -> list[tuple[Tensor | None, Tensor | None]]:
    """Each layer's ``(keys, values)`` of a ``DynamicCache``."""
    return [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in dynamic.layers]


# ----------------------------------------------------------------------------------------- logging
def quiet_transformers() -> None:
    """No progress bars and no warnings from transformers (the CLI prints its own, one line each)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
