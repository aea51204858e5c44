"""Reuse over the real stores (disk, a real redis-server, tiered): hits survive reopening, logits stay exact."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from store_helpers import redis_server
from test_reuse_prefix import full_prefill, ids_of, reuse_prefill

from kvforge.reuse import FakeEmbedder, PrefixReuse, SemanticReuse
from kvforge.store import open_store
from kvforge.testing import tiny_model


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("redis")
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(params=["file", "redis", "tiered"])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/kv"
    url = request.getfixturevalue("redis_url")
    open_store(url).clear()
    return url if request.param == "redis" else f"memory://,file://{tmp_path}/kv,{url}"


@pytest.mark.redis
def test_prefix_and_semantic_hits_survive_reopening(store_url):
    model = tiny_model("qwen2")
    ids = ids_of(40, seed=12)
    cache, ref = full_prefill(model, ids)
    PrefixReuse(open_store(store_url), "tiny", block_size=16).record(ids, cache)
    plan, _, logits = reuse_prefill(model, PrefixReuse(open_store(store_url), "tiny", block_size=16), ids)
    assert plan.reused_tokens == 39
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)

    semantic = SemanticReuse(open_store(store_url), "tiny", FakeEmbedder(), threshold=0.6)
    semantic.record(ids, cache, text="What is the capital of Normandy?")
    reopened = SemanticReuse(open_store(store_url), "tiny", FakeEmbedder(), threshold=0.6)
    plan = reopened.plan(ids_of(30, seed=13), text="what is the capital of normandy")
    assert plan.kind == "semantic" and plan.token_ids == ids


@pytest.mark.redis
def test_token_granular_hits_across_reopening(store_url):
    """A question on a stored document, asked through another store handle (another process's view): reused to the
    document's last token, the document's tail stored once, logits exact."""
    model = tiny_model("llama")
    doc, q1, q2 = ids_of(45, seed=14), ids_of(9, seed=15), ids_of(7, seed=16)
    q2[0] = q1[0] % 90 + 4
    cache, _ = full_prefill(model, doc)
    PrefixReuse(open_store(store_url), "tiny", block_size=16).record(doc, cache)
    writer = PrefixReuse(open_store(store_url), "tiny", block_size=16)
    plan, cache1, _ = reuse_prefill(model, writer, doc + q1)
    assert plan.reused_tokens == 45
    writer.record(doc + q1, cache1)
    reader = PrefixReuse(open_store(store_url), "tiny", block_size=16)
    plan, _, logits = reuse_prefill(model, reader, doc + q2)
    assert plan.reused_tokens == 45
    _, ref = full_prefill(model, doc + q2)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    store = open_store(store_url)
    assert sum(store.describe(k)["num_tokens"] for k in store.keys())  # noqa: SIM118 (a store, not a dict) == 45 + 9  # no token stored twice
