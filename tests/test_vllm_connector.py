"""KVForgeConnector inside a real vLLM engine (CPU build, in-process, tiny random Llama with the character tokenizer).

Needs vLLM: run by ``scripts/ci_vllm.sh`` in its own virtual environment; skipped (one line) where vLLM is not
importable. Each test starts one or two in-process engines (a few seconds each on the tiny model).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

try:
    import vllm  # noqa: F401
except Exception as e:  # not installed, or installed with broken vision/audio wheels
    pytest.skip(f"vLLM is not importable here ({type(e).__name__}: {str(e)[:80]})", allow_module_level=True)

from vllm_engine import PROMPT, TEXT, assert_same_answer, run

from kvforge.engine import Engine
from kvforge.model import folder_fingerprint, load_model
from kvforge.reuse import PrefixReuse
from kvforge.store import open_store

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("vllm_in_process")]


def block_files(store_dir: Path) -> list[Path]:
    return sorted(store_dir.glob("segments/*/prefix-v2-*.kvseg"))


def test_a_restarted_engine_loads_the_stored_blocks_and_answers_the_same(vllm_model_dir, tmp_path):
    store = f"file://{tmp_path}/kv"
    (cold,) = run(vllm_model_dir, [PROMPT], store)
    assert cold["cached"] == 0 and len(block_files(tmp_path / "kv")) == 2
    (warm,) = run(vllm_model_dir, [PROMPT], store)  # a new engine: only the store remembers
    assert warm["cached"] == 512
    assert_same_answer(warm, cold)
    (plain,) = run(vllm_model_dir, [PROMPT], None)  # vLLM without the connector: the reference answer
    assert_same_answer(cold, plain)


def test_kvforge_engine_and_vllm_share_blocks(vllm_model_dir, tmp_path):
    """vLLM's blocks give kvforge's engine a full prefill's logits; kvforge's blocks give vLLM its own answer."""
    store_url = f"file://{tmp_path}/kv"
    (first,) = run(vllm_model_dir, [PROMPT], store_url)
    model, tokenizer = load_model(str(vllm_model_dir), device="cpu")
    engine = Engine(model, tokenizer)
    assert engine.model_id == folder_fingerprint(vllm_model_dir)
    store = open_store(store_url)
    prefix = PrefixReuse(store, engine.model_id)
    ids = first["prompt_ids"]
    plan = prefix.plan(ids)
    assert plan.kind == "prefix" and plan.reused_tokens == 512
    _, reused_logits = engine.prefill(plan.prefill_ids, cache=plan.cache)
    _, full_logits = engine.prefill(ids)
    torch.testing.assert_close(reused_logits, full_logits, rtol=0, atol=1e-4)
    zeroed = prefix.plan(ids)  # the comparison sees wrong KV: zero the loaded values
    for layer in zeroed.cache.layers:
        layer.values.zero_()
    _, wrong_logits = engine.prefill(zeroed.prefill_ids, cache=zeroed.cache)
    assert (wrong_logits - full_logits).abs().max() > 1e-2

    other = tokenizer(TEXT[1000:1600]).input_ids  # a prompt vLLM never saw: kvforge's engine stores its blocks
    cache, _ = engine.prefill(other)
    prefix.record(other, cache)
    store.close()
    (warm,) = run(vllm_model_dir, [other], store_url)
    (plain,) = run(vllm_model_dir, [other], None)
    assert warm["cached"] == 512
    assert_same_answer(warm, plain)


def test_blocks_carry_kvforges_chain_header_and_a_copied_block_is_recomputed(vllm_model_dir, tmp_path):
    """vLLM's blocks have PrefixReuse's header (chain, parent, block_start, next) and are listed as kvforge lists its
    own; a block copied under another prompt's key (same tokens at the same positions, another first block) fails
    the chain check inside vLLM: recomputed, the right block stored in its place, the answer vLLM's own."""
    from kvforge.reuse import chain as ch

    store_url = f"file://{tmp_path}/kv"
    (a,) = run(vllm_model_dir, [PROMPT], store_url)
    store = open_store(store_url)
    prefix = PrefixReuse(store, folder_fingerprint(vllm_model_dir))
    chains = prefix.block_chains(a["prompt_ids"])
    first = store.get(ch.block_key(chains[0]))
    second = store.get(ch.block_key(chains[1]))
    assert first.meta == ch.block_meta(chains[0], prefix.root, 0, [None] * 3, a["prompt_ids"][256:512])
    assert (second.meta["parent"], second.meta["block_start"]) == (chains[0], 256)
    roots = ch.decode_list(prefix.root, store.get_blob(ch.list_key(prefix.root, True)))
    assert [c for c, _ in roots] == [chains[0]]

    other = "Z" * 10 + PROMPT[10:]  # block 0 differs; blocks 1 and 2 hold the same characters
    (plain,) = run(vllm_model_dir, [other], None)
    b_ids = plain["prompt_ids"]
    b_chains = prefix.block_chains(b_ids)
    assert b_ids[256:512] == a["prompt_ids"][256:512] and b_chains[1] != chains[1]
    store.close()
    run(vllm_model_dir, [b_ids[:300]], store_url)  # stores b's block 0 only
    store = open_store(store_url)
    store.put(ch.block_key(b_chains[1]), second)  # a's block 1 copied under b's key
    store.close()
    (b,) = run(vllm_model_dir, [b_ids], store_url)
    assert_same_answer(b, plain)
    store = open_store(store_url)
    assert store.get(ch.block_key(b_chains[1])).meta["parent"] == b_chains[0]  # the right block, stored again
    store.close()
    (again,) = run(vllm_model_dir, [b_ids], store_url)
    assert again["cached"] == 512
    assert_same_answer(again, plain)


def test_a_corrupt_block_is_recomputed_never_used(vllm_model_dir, tmp_path):
    store = f"file://{tmp_path}/kv"
    (cold,) = run(vllm_model_dir, [PROMPT], store)
    files = block_files(tmp_path / "kv")
    data = bytearray(files[0].read_bytes())
    data[-100] ^= 0xFF  # inside the tensor data: the checksum catches it
    files[0].write_bytes(bytes(data))
    (warm,) = run(vllm_model_dir, [PROMPT], store)
    assert_same_answer(warm, cold)
    (again,) = run(vllm_model_dir, [PROMPT], store)  # the corrupt entry was removed and stored again
    assert again["cached"] == 512
    assert_same_answer(again, cold)


@pytest.mark.redis
def test_a_redis_store_survives_a_restart_too(vllm_model_dir, tmp_path):
    from store_helpers import redis_server

    with redis_server(tmp_path) as url:
        (cold,) = run(vllm_model_dir, [PROMPT], url)
        (warm,) = run(vllm_model_dir, [PROMPT], url)
    assert warm["cached"] == 512
    assert_same_answer(warm, cold)


def test_a_store_of_another_model_is_not_used(vllm_model_dir, tmp_path):
    store = f"file://{tmp_path}/kv"
    run(vllm_model_dir, [PROMPT], store, model_id="LlamaForCausalLM:another:model:float32")
    (warm,) = run(vllm_model_dir, [PROMPT], store)
    assert warm["cached"] == 0


def test_int8_blocks_cost_a_quarter_and_answer_close(vllm_model_dir, tmp_path):
    store = f"file://{tmp_path}/kv?quant=int8"
    (cold,) = run(vllm_model_dir, [PROMPT], store)
    stored = sum(f.stat().st_size for f in block_files(tmp_path / "kv"))
    full = 2 * 3 * 2 * 2 * 256 * 32 * 4  # blocks x layers x K/V x heads x tokens x dim x fp32 bytes
    assert stored < 0.35 * full
    (warm,) = run(vllm_model_dir, [PROMPT], store)
    assert warm["cached"] == 512
    assert_same_answer(warm, cold, tol=5e-2)


def test_kvtc_blocks_use_the_stores_calibrated_basis_and_kvforges_engine_reads_them(vllm_model_dir, tmp_path):
    """Transform-coded prefix blocks: coded with the basis kvforge calibrated for the model in this store (so either
    side reads and writes the other's blocks alike), a fraction of fp16's bytes, answering close."""
    from kvforge.cli import main
    from kvforge.store.codec import read_header
    from kvforge.store.transform import store_basis

    url = f"file://{tmp_path}/kv"
    assert main(["cache", "calibrate", "--store", url, "--model", str(vllm_model_dir), "--device", "cpu"]) == 0
    (plain,) = run(vllm_model_dir, [PROMPT], url, quant="kvtc-b4")  # computed by vLLM, its blocks stored
    files = block_files(tmp_path / "kv")
    fp16 = 2 * 3 * 2 * 2 * 256 * 32 * 2  # blocks x layers x K/V x heads x tokens x dim x fp16 bytes
    assert len(files) == 2 and sum(f.stat().st_size for f in files) < 0.4 * fp16
    (warm,) = run(vllm_model_dir, [PROMPT], url, quant="kvtc-b4")
    assert warm["cached"] == 512
    assert_same_answer(warm, plain, tol=0.1)
    model, tokenizer = load_model(str(vllm_model_dir), device="cpu")
    engine = Engine(model, tokenizer)
    store = open_store(url)
    basis = store_basis(store, engine.model_id)
    assert basis is not None and all(basis.digest in json.dumps(read_header(f.read_bytes())) for f in files)
    plan = PrefixReuse(store, engine.model_id).plan(warm["prompt_ids"])
    assert plan.reused_tokens == 512


# engines that fail to start leave vLLM's process-wide KV transfer group behind: the tests below start no engine after
def test_bad_options_stop_the_engine_with_a_clear_error(vllm_model_dir, tmp_path):
    with pytest.raises(Exception, match="unknown kvforge connector option"):
        run(vllm_model_dir, [PROMPT], f"file://{tmp_path}/kv", blocksize=128)
    with pytest.raises(Exception, match="multiple of vLLM's block size"):
        run(vllm_model_dir, [PROMPT], f"file://{tmp_path}/kv", block_size=200)


def test_the_cpu_backend_layout_round_trips_through_its_own_kernel():
    """The probe on vLLM's CPU attention writer: what the kernel writes is what gather reads back."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvforge.vllm.layout import probe_layout

    heads, block, dim = 2, 128, 32
    isa = _get_attn_isa(torch.float32, block, dim)

    def write(keys, values, cache, slots):  # as CPUAttentionBackendImpl.do_kv_cache_update
        key_cache, value_cache = cache.view(cache.shape[0], heads, 2 * block, dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)

    layout = probe_layout(write, (heads, block, 2 * dim), block, heads, dim, torch.float32)
    cache = torch.zeros(4, heads, block, 2 * dim)
    keys, values = torch.randn(2 * block, heads, dim), torch.randn(2 * block, heads, dim)
    write(keys, values, cache, torch.arange(2 * block) + block)  # blocks 1 and 2
    got_k, got_v = layout.gather(cache, [1, 2])
    assert torch.equal(got_k, keys.transpose(0, 1)) and torch.equal(got_v, values.transpose(0, 1))
