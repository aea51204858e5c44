"""The transformers seam (kvforge.compat): the declared range, one module naming transformers' internals, and the
calling conventions of the installed release (CI runs this file on the oldest and the newest allowed release)."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest
import tomllib
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kvforge import compat
from kvforge.batch import BatchedCache
from kvforge.cache import KVCache
from kvforge.engine import Engine
from kvforge.prefill import prefill
from kvforge.presses import build_press

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvforge"

# transformers names that change between releases: only kvforge/compat.py may use them (as identifiers, attributes,
# keywords, imported modules or exact string keys; prose and messages may mention them)
INTERNAL = {
    "past_key_values", "cache_utils", "masking_utils", "modeling_outputs", "AttentionInterface",
    "AttentionMaskInterface", "_attn_implementation", "_attn_implementation_internal", "DynamicCache",
    "CausalLMOutputWithPast", "position_embeddings", "rotary_emb", "self_attn", "cache_position",
}


def _transformers_requirement() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(r"transformers\b", d)]
    return spec[len("transformers") :].strip()


def test_the_declared_range_is_the_seams_and_holds_the_installed_release():
    assert _transformers_requirement() == compat.TRANSFORMERS_RANGE
    spec = SpecifierSet(compat.TRANSFORMERS_RANGE)
    assert Version(compat.transformers_version()) in spec, (
        f"transformers {compat.transformers_version()} is outside the tested range {compat.TRANSFORMERS_RANGE}"
    )
    assert Version("5.16.1") in spec and Version("5.19.0") in spec  # vLLM's CPU build pins >=5.16.1,<5.20


def _internal_names(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif isinstance(node, ast.ImportFrom):
            names = [*(node.module or "").split("."), *(a.name for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [part for a in node.names for part in a.name.split(".")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        found += [f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}: {n}" for n in names if n in INTERNAL]
    return found


def test_only_the_seam_names_transformers_internals():
    offenders = [hit for path in sorted(SRC.rglob("*.py")) if path.name != "compat.py" for hit in _internal_names(path)]
    assert not offenders, "transformers internals outside kvforge/compat.py:\n" + "\n".join(offenders)


def test_the_forward_keyword_is_this_releases_and_warns_nothing(model):
    ids = torch.tensor([[5, 6, 7, 8]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache = KVCache.for_model(model)
        prefill(model, ids, cache)  # kvforge's own forward
        out = model(ids, **compat.cache_arg(model, compat.dynamic_cache([])), use_cache=True)
    assert compat.output_cache(out) is not None
    assert compat.cache_from({"cache": 1}) == 1 and compat.cache_from({"past_key_values": 2}) == 2
    assert compat.cache_from({}) is None


def test_cache_update_takes_what_every_release_passes(model):
    """Decoder layers call ``update(k, v, layer_idx)`` up to 5.22 and ``update(k, v, layer_idx, kwargs=...)`` after."""
    keys = torch.randn(1, 2, 3, 16)
    for cache in (KVCache(2), BatchedCache([KVCache(2)], sizes=[3])):
        first = cache.caches[0] if isinstance(cache, BatchedCache) else cache
        first.begin(torch.arange(3)[None])
        cache.update(keys, keys, 0)
        cache.update(keys, keys, 1, kwargs={"position_ids": None})
        assert first.layers[0].length == 3 and first.layers[1].length == 3


def test_press_generate_equals_engine_without_warnings(model, tokenizer):
    """``with press(model): model.generate(...)`` gives Engine's greedy tokens, on whichever release is installed."""
    engine = Engine(model, tokenizer, chunk_size=16)
    prompt = "The secret number is 4231. " * 3 + "What is the secret number?"
    ids = engine.encode_chat(prompt, raw=True)
    press = build_press("snapkv", compression_ratio=0.5)
    expected = engine.generate(ids, max_new_tokens=6, press=press).token_ids
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with press(model, tokenizer=tokenizer):
            out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = out[0, len(ids) :].tolist()
    assert got[: len(expected)] == expected


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi", "--max-new-tokens", "2", "--press", "snapkv"]])
def test_the_cli_prints_no_deprecation(tiny_llama_dir, command, capfd):
    from kvforge.cli import main

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main([*command, "--model", str(tiny_llama_dir), "--raw"]) == 0
    err = capfd.readouterr().err
    assert "FutureWarning" not in err and "deprecated" not in err.lower(), err
