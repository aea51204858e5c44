"""KV cache compression presses: build one by name, apply it while prefilling.

>>> press = build_press("snapkv", compression_ratio=0.75)
>>> press.compression_ratio, press.window_size
(0.75, 64)
>>> build_press("adakv", compression_ratio=0.5, window_size=32).press.window_size
32
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from kvforge.errors import UserError
from kvforge.names import PRESS_DESCRIPTIONS, parse_press
from kvforge.presses.adakv import AdaKVPress
from kvforge.presses.apply import CompressionSource, compress_prefill, compressible_layers
from kvforge.presses.base import Press, ScorerPress, WrapperPress
from kvforge.presses.criticalkv import CriticalAdaKVPress, CriticalKVPress
from kvforge.presses.decoding import BudgetPolicy, DecodingPress
from kvforge.presses.expected_attention import ExpectedAttentionPress
from kvforge.presses.full import FullPress
from kvforge.presses.h2o import H2OPress
from kvforge.presses.knorm import KnormPress
from kvforge.presses.kvzap import KVzapModel, KVzapPress
from kvforge.presses.kvzip import KVzipPress
from kvforge.presses.kvzip_heads import KVzipHeadPress
from kvforge.presses.layer import LayerContext, Needs, Selection, num_kept
from kvforge.presses.pyramidkv import PyramidKVPress
from kvforge.presses.snapkv import SnapKVPress
from kvforge.presses.streaming_llm import StreamingLLMPress
from kvforge.presses.surrogatekv import SurrogateKVPress

DEFAULT_LOOKAHEAD = 12  # draft tokens of the *-lookahead presses (probes: 12 solved 7 of 8 needles at 25% kept)

# name -> (outer class, inner scorer class or None, default options)
_SPECS: dict[str, tuple[type[Press], type[ScorerPress] | None, dict[str, Any]]] = {
    "full": (FullPress, None, {}),
    "streaming_llm": (StreamingLLMPress, None, {}),
    "h2o": (H2OPress, None, {}),
    "snapkv": (SnapKVPress, None, {}),
    "snapkv-lookahead": (SnapKVPress, None, {"lookahead": DEFAULT_LOOKAHEAD}),
    "pyramidkv": (PyramidKVPress, None, {}),
    "adakv": (AdaKVPress, SnapKVPress, {}),
    "adakv-lookahead": (AdaKVPress, SnapKVPress, {"lookahead": DEFAULT_LOOKAHEAD}),
    "criticalkv": (CriticalKVPress, SnapKVPress, {}),
    "criticalkv-lookahead": (CriticalKVPress, SnapKVPress, {"lookahead": DEFAULT_LOOKAHEAD}),
    "criticaladakv": (CriticalAdaKVPress, SnapKVPress, {}),
    "surrogatekv-null": (SurrogateKVPress, None, {"surrogate": "null"}),
    "surrogatekv-local": (SurrogateKVPress, None, {"surrogate": "local"}),
    "surrogatekv-global": (SurrogateKVPress, None, {"surrogate": "global"}),
    "surrogatekv-critical": (SurrogateKVPress, None, {"surrogate": "global", "value_aware": True}),
    "surrogatekv-ada": (SurrogateKVPress, None, {"surrogate": "global", "headwise": True}),
    "surrogatekv-lookahead": (SurrogateKVPress, None, {"surrogate": "global", "lookahead": DEFAULT_LOOKAHEAD}),
    "kvzip": (KVzipPress, None, {}),
    "kvzip-global": (KVzipPress, None, {"budget": "global"}),
    "kvzip-layer": (KVzipPress, None, {"budget": "layer"}),
    "kvzip-plus": (KVzipPress, None, {"value_aware": True}),
    "kvzip-head": (KVzipHeadPress, None, {}),
    "kvzip-ada": (AdaKVPress, KVzipPress, {"budget": "head"}),
    "kvzap": (KVzapPress, None, {}),
    "kvzap-mlp": (KVzapPress, None, {"kind": "mlp"}),
    "knorm": (KnormPress, None, {}),
    "expected_attention": (ExpectedAttentionPress, None, {}),
    "surrogatekv-kvzip": (SurrogateKVPress, None, {"surrogate": "global", "scores": "kvzip"}),
}


DESCRIPTIONS = PRESS_DESCRIPTIONS  # one line per name, in kvforge.names (checkable without torch)


def _builder(name: str) -> Callable[..., Press]:
    def build(compression_ratio: float = 0.0, **options: Any) -> Press:
        return build_press(name, compression_ratio, **options)

    return build


PRESSES: dict[str, Callable[..., Press]] = {name: _builder(name) for name in _SPECS}


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - {"press", "compression_ratio"}


def press_options(name: str) -> dict[str, tuple[Any, str]]:
    """The options ``name`` (a registered press, options allowed) takes: option -> (its value for this name, the
    class it sets). Options whose default is built per press (a model, token ids) show as None."""
    spec = name.strip()
    press = build_press(spec, 0.5)
    outer_cls, inner_cls, _ = _SPECS[parse_press(spec)[0]]
    objects = [(press, outer_cls)] + ([(press.press, inner_cls)] if inner_cls is not None else [])  # type: ignore
    out: dict[str, tuple[Any, str]] = {}
    for obj, cls in objects:
        for f in dataclasses.fields(cls):
            if f.init and f.name not in ("press", "compression_ratio") and f.name not in out:
                value = getattr(obj, f.name, None)
                out[f.name] = (value if isinstance(value, (bool, int, float, str, type(None))) else None, cls.__name__)
    return out


def _check_kind(spec: str, key: str, value: Any, cls: Any) -> None:
    """An option read from a press name must have its field's kind: a number where the default is one, etc."""
    default = next((f.default for f in dataclasses.fields(cls) if f.name == key), None)
    kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(type(default))
    if kinds is None or value is None:
        return  # no plain default (None, a list, a model): the press checks the value
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        kind = {bool: "true or false", int: "a whole number", float: "a number", str: "a word"}[type(default)]
        raise UserError(f"press {spec!r}: option {key} must be {kind} (default {default!r}), got {value!r}")


def build_press(name: str, compression_ratio: float = 0.0, kv_budget: int | None = None, **options: Any) -> Press:
    """The press registered as ``name`` at ``compression_ratio`` (fraction of new entries removed per layer).

    ``name`` may carry options, ``name:key=value[:key=value...]`` (``"kvzip:pool=3"``): the form every entry point
    takes (``--press``, ``--methods``); an option given both there and as a keyword is an error.

    ``kv_budget``: a fixed number of entries per layer and KV head to keep instead of a ratio (kvpress #102): a prompt
    of S > kv_budget tokens is compressed at ratio ``1 - kv_budget / S`` (global-budget presses such as KVzip keep
    ``kv_budget`` per layer on average), a shorter one is kept whole.
    ``options`` set dataclass fields of the press, or of its inner scorer for wrappers (AdaKV, CriticalKV).

    Raises:
        UserError: unknown name or option, ratio outside [0, 1), a budget < 1, or an invalid option value.
    """
    spec = name.strip()
    name, named = parse_press(spec)
    if twice := set(named) & set(options):
        raise UserError(f"press {spec!r}: option {', '.join(sorted(twice))} is given in the name and as a keyword")
    options = named | options
    if kv_budget is not None and (not isinstance(kv_budget, int) or kv_budget < 1):
        raise UserError(f"kv budget must be a whole number of entries >= 1, got {kv_budget!r}")
    try:
        ratio = float(compression_ratio)
    except (TypeError, ValueError):
        raise UserError(f"compression ratio must be a number, got {compression_ratio!r}") from None
    if not 0.0 <= ratio < 1.0:
        raise UserError(f"compression ratio must be in [0, 1) (fraction of entries removed), got {ratio}")
    outer_cls, inner_cls, defaults = _SPECS[name]
    opts = defaults | options
    outer_fields = _field_names(outer_cls)
    inner_fields = _field_names(inner_cls) if inner_cls is not None else set()
    unknown = set(opts) - outer_fields - inner_fields
    if unknown:
        valid = sorted(outer_fields | inner_fields)
        raise UserError(f"press {name!r} has no option {', '.join(sorted(unknown))}; valid: {', '.join(valid)}")
    for key, value in named.items():  # options typed as text: their kind must be the field's
        _check_kind(spec, key, value, outer_cls if key in outer_fields else inner_cls)
    try:
        if inner_cls is None:
            press = outer_cls(compression_ratio=ratio, **opts)  # type: ignore[call-arg]
        else:
            inner = inner_cls(compression_ratio=ratio, **{k: v for k, v in opts.items() if k in inner_fields})
            press = outer_cls(press=inner, **{k: v for k, v in opts.items() if k in outer_fields})  # type: ignore
    except (ValueError, TypeError) as exc:
        raise UserError(f"press {spec!r}: {exc}") from None
    press.registry_name = spec  # type: ignore[attr-defined]  # reported in cache.info
    if kv_budget is not None:
        press.kv_budget = kv_budget  # type: ignore[attr-defined]  # read by CompressionSource.compress
    return press


__all__ = [
    "DESCRIPTIONS",
    "PRESSES",
    "AdaKVPress",
    "BudgetPolicy",
    "CompressionSource",
    "CriticalAdaKVPress",
    "CriticalKVPress",
    "DecodingPress",
    "ExpectedAttentionPress",
    "FullPress",
    "H2OPress",
    "KVzapModel",
    "KVzapPress",
    "KVzipHeadPress",
    "KVzipPress",
    "KnormPress",
    "LayerContext",
    "Needs",
    "Press",
    "PyramidKVPress",
    "ScorerPress",
    "Selection",
    "SnapKVPress",
    "StreamingLLMPress",
    "SurrogateKVPress",
    "WrapperPress",
    "build_press",
    "compress_prefill",
    "compressible_layers",
    "num_kept",
    "press_options",
]
