"""The connector's scheduler-side planning, block segments and options, without vLLM."""

from __future__ import annotations

import logging

import pytest
import torch

from kvforge.cache import KVCache
from kvforge.errors import UserError
from kvforge.prefill import prefill
from kvforge.reuse import PrefixReuse
from kvforge.reuse.base import segment_slice
from kvforge.store import open_store
from kvforge.testing import tiny_model
from kvforge.vllm.blocks import BlockWriter, block_segment, check_block
from kvforge.vllm.plan import BlockMove, StepMoves, TransferPlanner
from kvforge.vllm.settings import ConnectorSettings

MODEL_ID = "LlamaForCausalLM:test:test:float32"
BS, SBS = 4, 8  # vLLM block size, store block size


def planner(store, **kwargs):
    prefix = PrefixReuse(store, MODEL_ID, block_size=SBS)
    return TransferPlanner(prefix.block_keys, store.contains, BS, SBS, **kwargs), prefix


def fake_block(key_prefix, move: BlockMove, num_layers=2, heads=2, dim=4):
    k = [torch.randn(heads, move.end - move.start, dim) for _ in range(num_layers)]
    return block_segment(move, k, [x + 1 for x in k], MODEL_ID)


def store_blocks(store, prefix, prompt, num_blocks):
    keys = prefix.block_keys(prompt)
    for i in range(num_blocks):
        move = BlockMove(keys[i], i * SBS, (i + 1) * SBS, prompt[i * SBS : (i + 1) * SBS], i * SBS, (i + 1) * SBS, [])
        store.put(keys[i], fake_block("", move))


def test_lookup_walks_the_chain_and_leaves_the_last_token():
    store = open_store("memory://")
    plan, prefix = planner(store)
    prompt = list(range(100, 130))  # 30 tokens: 3 whole store blocks, then 6 more
    assert plan.stored_tokens(prompt) == 0
    store_blocks(store, prefix, prompt, 2)
    assert plan.stored_tokens(prompt) == 16
    assert plan.matched_tokens(prompt, num_computed=8) == 8  # vLLM already holds 8
    assert plan.matched_tokens(prompt, num_computed=20) == 0
    other = [*prompt[:4], 7, *prompt[5:]]  # differs inside block 0: the chain breaks there
    assert plan.stored_tokens(other) == 0
    exact = prompt[:16]  # all stored: the last token is recomputed, cut to a vLLM block (12, not 15)
    assert plan.stored_tokens(exact) == 12
    assert TransferPlanner(prefix.block_keys, store.contains, BS, SBS, load=False).stored_tokens(prompt) == 0


def test_a_gap_in_the_chain_stops_the_hit():
    store = open_store("memory://")
    plan, prefix = planner(store)
    prompt = list(range(40))
    store_blocks(store, prefix, prompt, 3)
    store.delete(prefix.block_keys(prompt)[1])
    assert plan.stored_tokens(prompt) == 8


def test_loads_cover_the_external_tokens_with_their_vllm_blocks():
    store = open_store("memory://")
    plan, prefix = planner(store)
    prompt = list(range(50, 80))
    store_blocks(store, prefix, prompt, 3)
    assert plan.matched_tokens(prompt, num_computed=4) == 20
    plan.allocated("r", 20)
    moves = StepMoves()
    block_ids = [10, 11, 12, 13, 14, 15, 16, 17]  # vLLM blocks of tokens 0-3, 4-7, ...
    plan.start("r", prompt, block_ids, num_computed=24, num_scheduled=6, moves=moves)
    loads = [(m.first, m.last, m.block_ids) for m in moves.loads]
    assert loads == [(4, 8, [11]), (8, 16, [12, 13]), (16, 24, [14, 15])]
    assert moves.loads[0].token_ids == prompt[:8] and moves.loads[0].start == 0
    assert moves.saves == []  # every whole block is stored already


def test_saves_follow_chunked_prefill_and_skip_what_is_stored():
    store = open_store("memory://")
    plan, prefix = planner(store)
    prompt = list(range(200, 237))  # 37 tokens: 4 whole store blocks
    store_blocks(store, prefix, prompt, 1)
    keys = prefix.block_keys(prompt)
    block_ids = list(range(10))
    steps = []
    moves = StepMoves()
    plan.start("r", prompt, block_ids[:3], num_computed=0, num_scheduled=12, moves=moves)  # tokens 0-11
    steps.append(moves)
    moves = StepMoves()
    plan.advance("r", block_ids[3:8], num_computed=12, num_scheduled=20, moves=moves)  # tokens 12-31
    steps.append(moves)
    moves = StepMoves()
    plan.advance("r", block_ids[8:], num_computed=32, num_scheduled=5, moves=moves)  # 32-36: no whole block
    steps.append(moves)
    moves = StepMoves()
    plan.advance("r", None, num_computed=37, num_scheduled=1, moves=moves)  # decoding: nothing saved
    steps.append(moves)
    assert [[m.key for m in s.saves] for s in steps] == [[], [keys[1], keys[2], keys[3]], [], []]
    block2 = steps[1].saves[1]
    assert (block2.start, block2.end, block2.block_ids, block2.token_ids) == (16, 24, [4, 5], prompt[16:24])
    plan.finish({"r"})
    moves = StepMoves()
    plan.advance("r", None, num_computed=38, num_scheduled=1, moves=moves)  # finished: forgotten
    assert moves.saves == []


def test_a_block_being_written_is_not_saved_again_by_the_next_request():
    store = open_store("memory://")
    now = [100.0]
    prefix = PrefixReuse(store, MODEL_ID, block_size=SBS)
    plan = TransferPlanner(prefix.block_keys, store.contains, BS, SBS, in_flight_s=30, clock=lambda: now[0])
    prompt = list(range(16))
    moves = StepMoves()
    plan.start("a", [*prompt, 1], [0, 1, 2, 3, 4], 0, 17, moves)
    assert len(moves.saves) == 2  # queued, not written yet: the store does not hold them
    moves = StepMoves()
    plan.start("b", [*prompt, 2], [5, 6, 7, 8, 9], 0, 17, moves)
    assert moves.saves == []
    now[0] += 31  # never written (a failed write): planned again once the window is over
    moves = StepMoves()
    plan.start("c", [*prompt, 3], [5, 6, 7, 8, 9], 0, 17, moves)
    assert len(moves.saves) == 2


def test_two_requests_with_one_prefix_save_it_once_per_step():
    store = open_store("memory://")
    plan, _ = planner(store)
    prompt = list(range(16))
    moves = StepMoves()
    plan.start("a", [*prompt, 1], [0, 1, 2, 3, 4], 0, 17, moves)
    plan.start("b", [*prompt, 2], [5, 6, 7, 8, 9], 0, 17, moves)
    assert len(moves.saves) == 2 and {m.block_ids[0] for m in moves.saves} == {0, 2}


def test_a_preempted_request_resumes_on_new_blocks():
    store = open_store("memory://")
    plan, prefix = planner(store)
    prompt = list(range(300, 324))
    moves = StepMoves()
    plan.start("r", prompt, [0, 1, 2], 0, 12, moves)  # block 0 saved
    assert [m.start for m in moves.saves] == [0]
    store_blocks(store, prefix, prompt, 1)
    plan.allocated("r", 8)  # resumed: the stored block is loaded into its new vLLM blocks
    moves = StepMoves()
    plan.resume("r", [7, 8, 9, 10, 11, 12], num_computed=8, num_scheduled=16, moves=moves)
    assert [(m.first, m.last, m.block_ids) for m in moves.loads] == [(0, 8, [7, 8])]
    assert [(m.start, m.block_ids) for m in moves.saves] == [(8, [9, 10]), (16, [11, 12])]


def test_blocks_that_failed_to_load_are_saved_again_once_recomputed():
    store = open_store("memory://")
    plan, prefix = planner(store)
    prompt = list(range(500, 520))
    store_blocks(store, prefix, prompt, 2)
    plan.allocated("r", 16)
    moves = StepMoves()
    plan.start("r", prompt, [3, 4, 5, 6, 7], num_computed=16, num_scheduled=4, moves=moves)
    assert len(moves.loads) == 2 and moves.saves == []
    store.delete(prefix.block_keys(prompt)[1])  # its load failed: the store dropped the corrupt entry
    plan.failed({5})  # vLLM block 5 holds tokens 8-11: store block 1
    moves = StepMoves()
    plan.advance("r", None, num_computed=8, num_scheduled=12, moves=moves)  # vLLM recomputes from token 8
    assert [(m.start, m.block_ids) for m in moves.saves] == [(8, [5, 6])]


def test_an_abandoned_load_names_the_blocks_vllm_must_recompute():
    store = open_store("memory://")
    plan, _ = planner(store)
    plan.allocated("r", 12)  # the scheduler counts tokens 4..15 as loaded
    assert plan.abandon("r", [7, 8, 9, 10, 11], num_computed=16) == [8, 9, 10]
    assert plan.abandon("r", [7, 8, 9, 10, 11], num_computed=16) == []  # once


def test_store_blocks_must_be_whole_vllm_blocks():
    store = open_store("memory://")
    with pytest.raises(ValueError, match="multiple"):
        TransferPlanner(lambda ids: [], store.contains, 16, 24)


@torch.no_grad()
def test_saved_blocks_are_kvforge_prefix_blocks():
    """What the connector writes is what PrefixReuse reads: same keys, same header, logits of a full prefill."""
    model = tiny_model("llama")
    store = open_store("memory://")
    prefix = PrefixReuse(store, MODEL_ID, block_size=SBS)
    ids = torch.randint(3, 100, (1, 21))
    cache = KVCache(model.config.num_hidden_layers)
    full_logits = prefill(model, ids, cache)
    keys = prefix.block_keys(ids[0].tolist())
    for i in range(2):
        start, end = i * SBS, (i + 1) * SBS
        ref = segment_slice(cache, start, end, MODEL_ID, ids[0, start:end].tolist())
        move = BlockMove(keys[i], start, end, ids[0, start:end].tolist(), start, end, [])
        store.put(move.key, block_segment(move, ref.keys, ref.values, MODEL_ID))
    plan = prefix.plan(ids[0].tolist())
    assert plan.kind == "prefix" and plan.reused_tokens == 16
    logits = prefill(model, ids[:, 16:], plan.cache)
    torch.testing.assert_close(logits, full_logits, rtol=1e-4, atol=1e-4)


def test_check_block_refuses_foreign_or_mismatched_blocks():
    move = BlockMove("k", 8, 16, list(range(8, 16)), 8, 16, [2, 3])
    segment = fake_block("", move)
    assert check_block(segment, move, MODEL_ID, 2, 2, 4) is None
    assert "made by model" in check_block(segment, move, "other", 2, 2, 4)
    shifted = BlockMove("k", 8, 16, list(range(9, 17)), 8, 16, [2, 3])
    assert "tokens" in check_block(segment, shifted, MODEL_ID, 2, 2, 4)
    assert "layers" in check_block(segment, move, MODEL_ID, 3, 2, 4)
    assert "shape" in check_block(segment, move, MODEL_ID, 2, 3, 4)
    segment.positions = [p + 1 for p in segment.positions]
    assert "positions" in check_block(segment, move, MODEL_ID, 2, 2, 4)


def test_block_writer_writes_in_the_background_and_survives_a_failing_store(caplog):
    store = open_store("memory://")
    writer = BlockWriter(store)
    move = BlockMove("key-a", 0, 8, list(range(8)), 0, 8, [])
    writer.put("key-a", fake_block("", move))
    writer.flush()
    assert store.get("key-a") is not None and writer.num_written == 1

    class Broken:
        def put(self, key, segment, quant=None):
            raise OSError("disk full")

    broken = BlockWriter(Broken())  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="kvforge.vllm.blocks"):
        broken.put("key-b", fake_block("", move))
        broken.flush()
    assert broken.num_failed == 1 and "disk full" in caplog.text
    broken.put("key-c", fake_block("", move))  # still running
    broken.flush()
    assert broken.num_failed == 2
    broken.close()
    writer.close()


def test_block_writer_quantises_when_asked():
    store = open_store("memory://")
    writer = BlockWriter(store, quant="int8")
    move = BlockMove("key-q", 0, 8, list(range(8)), 0, 8, [])
    writer.put("key-q", fake_block("", move))
    writer.close()
    assert store.describe("key-q")["quant"] == "int8-kivi"


def test_settings_are_checked_with_clear_errors():
    s = ConnectorSettings.parse({"store": "file:///tmp/kv", "block_size": 512, "quant": "int4"})
    assert (s.block_size, s.quant) == (512, "int4")
    assert ConnectorSettings.parse(None).store.startswith("file://")
    with pytest.raises(UserError, match="unknown kvforge connector option"):
        ConnectorSettings.parse({"stor": "file:///tmp/kv"})
    with pytest.raises(UserError, match="block_size"):
        ConnectorSettings.parse({"block_size": "256"})
    with pytest.raises(UserError, match="quant"):
        ConnectorSettings.parse({"quant": "int3"})
    assert "***" in ConnectorSettings.parse({"store": "redis://:secret@h:6379/0"}).describe()
