"""The connector's scheduler-side planning, block segments and options, without vLLM."""

from __future__ import annotations

import logging

import pytest
import torch

from kvforge.cache import KVCache
from kvforge.errors import UserError
from kvforge.prefill import prefill
from kvforge.reuse import PrefixReuse
from kvforge.reuse import chain as ch
from kvforge.store import open_store
from kvforge.testing import tiny_model
from kvforge.vllm.blocks import BlockWriter, block_segment, check_block
from kvforge.vllm.plan import BlockMove, StepMoves, TransferPlanner
from kvforge.vllm.settings import ConnectorSettings

MODEL_ID = "LlamaForCausalLM:test:test:float32"
BS, SBS = 4, 8  # vLLM block size, store block size


def planner(store, **kwargs):
    prefix = PrefixReuse(store, MODEL_ID, block_size=SBS)
    return TransferPlanner(prefix.block_chains, prefix.root, store.contains, BS, SBS, **kwargs), prefix


def fake_block(key_prefix, move: BlockMove, num_layers=2, heads=2, dim=4):
    k = [torch.randn(heads, move.end - move.start, dim) for _ in range(num_layers)]
    return block_segment(move, k, [x + 1 for x in k], MODEL_ID)


def block_move(prefix, prompt, i, block_ids=()):
    """Store block ``i`` of ``prompt`` as the planner names it (a whole block moved)."""
    chains = prefix.block_chains(prompt)
    start, end = i * SBS, (i + 1) * SBS
    parent = chains[i - 1] if i else prefix.root
    return BlockMove(chains[i], parent, start, end, prompt[start:end], start, end, list(block_ids),
                     next_ids=prompt[end : end + SBS])  # fmt: skip


def store_blocks(store, prefix, prompt, num_blocks):
    for i in range(num_blocks):
        move = block_move(prefix, prompt, i)
        store.put(move.key, fake_block("", move))


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
    assert (
        TransferPlanner(prefix.block_chains, prefix.root, store.contains, BS, SBS, load=False).stored_tokens(prompt)
        == 0
    )


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
    chains = prefix.block_chains(prompt)
    assert (block2.chain, block2.parent, block2.next_ids) == (chains[2], chains[1], prompt[24:32])
    assert steps[1].saves[2].next_ids == prompt[32:37]  # the header's next: what followed, at most one block
    # block 1's parent was stored before: it is listed among that parent's children; 2 and 3 follow a block this
    # request saved, whose header names them
    assert [m.listed for m in steps[1].saves] == [True, False, False]
    plan.finish({"r"})
    moves = StepMoves()
    plan.advance("r", None, num_computed=38, num_scheduled=1, moves=moves)  # finished: forgotten
    assert moves.saves == []


def test_a_block_being_written_is_not_saved_again_by_the_next_request():
    store = open_store("memory://")
    now = [100.0]
    prefix = PrefixReuse(store, MODEL_ID, block_size=SBS)
    plan = TransferPlanner(
        prefix.block_chains, prefix.root, store.contains, BS, SBS, in_flight_s=30, clock=lambda: now[0]
    )
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
        TransferPlanner(lambda ids: [], "root", store.contains, 16, 24)


@torch.no_grad()
def test_saved_blocks_are_kvforge_prefix_blocks():
    """What the connector writes is what PrefixReuse reads: same keys, same header, logits of a full prefill."""
    model = tiny_model("llama")
    store = open_store("memory://")
    prefix = PrefixReuse(store, MODEL_ID, block_size=SBS)
    ids = torch.randint(3, 100, (1, 21))
    cache = KVCache(model.config.num_hidden_layers)
    full_logits = prefill(model, ids, cache)
    prompt = ids[0].tolist()
    for i in range(2):
        move = block_move(prefix, prompt, i)
        ref = cache.to_segment(MODEL_ID, move.token_ids, start=move.start, end=move.end)
        store.put(move.key, block_segment(move, ref.keys, ref.values, MODEL_ID))
        assert move.key.startswith("prefix-v2-") and move.key == prefix.block_keys(prompt)[i]
    plan = prefix.plan(prompt)
    assert plan.kind == "prefix" and plan.reused_tokens == 16
    logits = prefill(model, ids[:, 16:], plan.cache)
    torch.testing.assert_close(logits, full_logits, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_blocks_kvforge_records_pass_the_connectors_checks_and_carry_the_same_header():
    """The other way: PrefixReuse's own blocks are accepted by check_block, and their headers equal the connector's."""
    model = tiny_model("llama")
    store = open_store("memory://")
    prefix = PrefixReuse(store, MODEL_ID, block_size=SBS)
    ids = torch.randint(3, 100, (1, 21))
    cache = KVCache(model.config.num_hidden_layers)
    prefill(model, ids, cache)
    prompt = ids[0].tolist()
    prefix.record(prompt, cache)
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    for i in range(2):
        move = block_move(prefix, prompt, i)
        stored = store.get(move.key)
        assert check_block(stored, move, MODEL_ID, cfg.num_hidden_layers, heads, dim) is None
        ours = block_segment(move, stored.keys, stored.values, MODEL_ID)
        assert ours.meta == stored.meta
        torch.testing.assert_close(ours.positions, stored.positions)


def test_a_block_copied_from_another_chain_is_refused():
    """Same tokens at the same position, other blocks before it: the parent check refuses it under any key."""
    store = open_store("memory://")
    _, prefix = planner(store)
    a = list(range(100, 124))
    b = [7, *a[1:]]  # block 0 differs, block 1 holds the same tokens at the same positions
    move_a, move_b = block_move(prefix, a, 1), block_move(prefix, b, 1)
    assert move_a.token_ids == move_b.token_ids and move_a.key != move_b.key
    copied = fake_block("", move_a)
    assert check_block(copied, move_a, MODEL_ID, 2, 2, 4) is None
    assert "another chain" in check_block(copied, move_b, MODEL_ID, 2, 2, 4)  # copied to b's key
    store.put(move_b.key, copied)
    store_blocks(store, prefix, b, 1)
    assert prefix.plan(b).reused_tokens == 8  # kvforge's engine refuses it too: a miss from block 1 on
    tampered = fake_block("", move_a)
    tampered.meta["chain"] = move_b.chain
    assert "chain hash" in check_block(tampered, move_a, MODEL_ID, 2, 2, 4)


def test_check_block_refuses_foreign_or_mismatched_blocks():
    _, prefix = planner(open_store("memory://"))
    prompt = list(range(24))
    move = block_move(prefix, prompt, 1, [2, 3])
    segment = fake_block("", move)
    assert check_block(segment, move, MODEL_ID, 2, 2, 4) is None
    assert "made by model" in check_block(segment, move, "other", 2, 2, 4)
    shifted = block_move(prefix, list(range(1, 25)), 1, [2, 3])
    assert "tokens" in check_block(segment, shifted, MODEL_ID, 2, 2, 4)
    assert "layers" in check_block(segment, move, MODEL_ID, 3, 2, 4)
    assert "shape" in check_block(segment, move, MODEL_ID, 2, 3, 4)
    segment.positions = [p + 1 for p in segment.positions]
    assert "positions" in check_block(segment, move, MODEL_ID, 2, 2, 4)


def test_block_writer_writes_in_the_background_and_survives_a_failing_store(caplog):
    store = open_store("memory://")
    _, prefix = planner(store)
    prompt = list(range(40))
    writer = BlockWriter(store, prefix=prefix)
    moves = [block_move(prefix, prompt, i) for i in range(3)]
    writer.put([(m, fake_block("", m)) for m in moves])
    writer.flush()
    assert all(store.get(m.key) is not None for m in moves) and writer.num_written == 3

    class Broken:
        def put(self, key, segment, quant=None):
            raise OSError("disk full")

    broken = BlockWriter(Broken())  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="kvforge.vllm.blocks"):
        broken.put([(moves[0], fake_block("", moves[0]))])
        broken.flush()
    assert broken.num_failed == 1 and "disk full" in caplog.text
    broken.put([(moves[0], fake_block("", moves[0]))])  # still running
    broken.flush()
    assert broken.num_failed == 2
    broken.close()
    writer.close()


def test_block_writer_writes_head_first_stops_after_a_failed_parent_and_touches_prefixes_last():
    store = open_store("memory://")
    _, prefix = planner(store)
    prompt = list(range(40))
    moves = [block_move(prefix, prompt, i) for i in range(4)]
    order: list[str] = []

    class Recording:
        def put(self, key, segment, quant=None):
            if key == moves[1].key:
                raise OSError("disk full")
            order.append("put " + key)
            store.put(key, segment)

        def touch(self, key):
            order.append("touch " + key)

    writer = BlockWriter(Recording())  # type: ignore[arg-type]
    writer.put([(m, fake_block("", m)) for m in reversed(moves)])  # handed over suffix first
    writer.flush()
    # block 0 written; 1 failed, so 2 and 3 (unreachable without it) are not written
    assert order == ["put " + moves[0].key, "touch " + moves[0].key] and writer.num_failed == 3
    order.clear()
    ok = BlockWriter(Recording())  # type: ignore[arg-type]
    ok.put([(moves[2], fake_block("", moves[2])), (moves[3], fake_block("", moves[3]))])
    ok.flush()
    assert order == ["put " + moves[2].key, "put " + moves[3].key, "touch " + moves[3].key, "touch " + moves[2].key]
    writer.close()
    ok.close()


def test_blocks_vllm_saves_are_listed_so_kvforge_finds_a_branch_in_them():
    """A vLLM block whose parent was stored before is listed among its parent's children, as PrefixReuse lists its
    own: kvforge's engine then reuses it to the last shared token for a prompt that leaves it mid-block."""
    store = open_store("memory://")
    plan, prefix = planner(store)
    prompt = list(range(100, 125))  # 25 tokens: 3 whole blocks
    moves = StepMoves()
    plan.start("r", prompt, list(range(7)), 0, 25, moves)
    assert [m.listed for m in moves.saves] == [True, False, False]
    writer = BlockWriter(store, prefix=prefix)
    writer.put([(m, fake_block("", m)) for m in moves.saves])
    writer.close()
    assert [c for c, _ in ch.decode_list(prefix.root, store.get_blob(ch.list_key(prefix.root, True)))] == [
        moves.saves[0].chain
    ]
    other = [*prompt[:5], 1, 2, 3]  # shares 5 tokens of block 0, then differs
    hit = prefix.plan(other)
    assert hit.reused_tokens == 5 and hit.info.get("branch_tokens") == 5


def test_block_writer_quantises_when_asked():
    store = open_store("memory://")
    _, prefix = planner(store)
    writer = BlockWriter(store, quant="int8")
    move = block_move(prefix, list(range(8)), 0)
    writer.put([(move, fake_block("", move))])
    writer.close()
    assert store.describe(move.key)["quant"] == "int8-kivi"


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


def test_vllm_releases_outside_the_tested_range_are_refused_in_one_line():
    from kvforge.vllm.settings import VLLM_RANGE, check_vllm_version

    for version in ("0.31.0", "0.32.0", "0.32.1+cpu"):
        check_vllm_version(version)
    for version in ("0.30.0", "0.33.0", "1.0.0"):
        with pytest.raises(UserError, match=f"vLLM {version} is outside .*{VLLM_RANGE}") as err:
            check_vllm_version(version)
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="not a release"):
        check_vllm_version("garbage")
