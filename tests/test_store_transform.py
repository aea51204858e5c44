"""Transform-coded storage (kvtc): PCA basis per layer and KV head, bits by variance, DEFLATE; exact through stores."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from store_helpers import make_segment

from kvforge.cache import KVCache
from kvforge.calibrate import calibrate_basis, prepare_basis
from kvforge.engine import Engine
from kvforge.prefill import forward, prefill
from kvforge.presses import build_press
from kvforge.reuse.prefix import PrefixReuse
from kvforge.store import open_store
from kvforge.store.codec import decode, encode, quant_roundtrip, read_header, segments_equal
from kvforge.store.quant import canonical_quant
from kvforge.store.transform import BOOK, BasisBook, allocate_bits, parse_transform, store_basis
from kvforge.testing import tiny_model, tiny_tokenizer


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path, monkeypatch):
    """Bases go to a temporary cache dir; the process's book forgets them between tests."""
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "kvforge-cache"))
    monkeypatch.setattr("kvforge.store.transform.BOOK", BasisBook())
    monkeypatch.setattr("kvforge.store.codec.transform.BOOK", BasisBook(), raising=False)


def _book():
    from kvforge.store import transform

    return transform.BOOK


def _rel_err(a: torch.Tensor, b: torch.Tensor, m: torch.Tensor | None) -> float:
    a, b = (a[m], b[m]) if m is not None else (a, b)
    return float((a.float() - b.float()).pow(2).sum() / a.float().pow(2).sum().clamp_min(1e-12))


def test_names_and_bit_allocation():
    assert parse_transform("kvtc").key_bits == 2 and parse_transform("kvtc-b3").name == "kvtc-b3"
    assert parse_transform("kvtc-k3-v1.5").value_bits == 1.5 and parse_transform("int4") is None
    assert canonical_quant("kvtc-b2") == "kvtc" and canonical_quant("kvtc-b2-o2") == "kvtc"
    assert parse_transform("kvtc").outliers == 2 and parse_transform("kvtc-b2-o0").outliers == 0
    assert canonical_quant("kvtc-b2-o0") == "kvtc-o0" and canonical_quant("kvtc-k3-v2-o1.5") == "kvtc-k3-v2-o1.5"
    with pytest.raises(ValueError, match="bits"):
        parse_transform("kvtc-b9")
    with pytest.raises(ValueError, match="16 bits"):
        parse_transform("kvtc-o60")
    var = torch.tensor([16.0, 4.0, 1.0, 0.25, 1e-6, 0.0])
    for budget in (0.5, 1, 2, 3):
        bits = allocate_bits(var, budget)
        assert int(bits.sum()) <= budget * 6 and bool((bits[:-1] >= bits[1:]).all())  # more variance, more bits
    assert allocate_bits(var, 8).tolist()[:4] == [8, 8, 8, 8] and int(allocate_bits(var, 8)[-1]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_error_falls_with_bits_and_positions_masks_are_exact(dtype):
    seg = make_segment(dtype, lengths=(64, 48, 0, 40), num_heads=2, head_dim=16)
    errors = []
    for quant in ("kvtc-b1", "kvtc-b3", "kvtc-b8"):
        out = quant_roundtrip(seg, quant)
        assert out.meta["quant"] == quant and all(k.dtype == dtype for k in out.keys)
        for i, m in enumerate(seg.valid):
            assert (m is None) == (out.valid[i] is None) and (m is None or torch.equal(m, out.valid[i]))
            pos = out.positions[i] if m is None else out.positions[i][m]
            assert torch.equal(pos, seg.positions[i] if m is None else seg.positions[i][m])
        layers = zip(seg.keys, out.keys, seg.valid, strict=True)
        errors.append(sum(_rel_err(a, b, m) for a, b, m in layers if a.numel()))
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-3


def test_a_segment_of_sinks_only_comes_back_exact():
    """Entries at positions < 4 are stored as they are: a segment holding nothing else (a document of a few tokens)
    has no codes at all and decodes to exactly what was stored, beside a layer with no entries."""
    seg = make_segment(lengths=(3, 2, 0, 3), num_heads=2, head_dim=16, masked=False)
    out = quant_roundtrip(seg, "kvtc")
    assert all(torch.equal(a, b) for a, b in zip(seg.keys + seg.values, out.keys + out.values, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_entries_the_code_blurs_most_are_kept_beside_it(dtype):
    """kvtc keeps the ceil(2%) coded entries of each head (keys and values apiece) with the largest error at 16 bits:
    exactly those rows come back as stored (fp16-rounded from fp32), every other row is what the code without them
    (-o0) decodes. A planted outlier (a rare token the basis does not describe) is among them."""

    def shaped(seed: int):  # most of the variance in 4 of 16 dimensions, as in real KV
        seg = make_segment(dtype, lengths=(200, 150, 120), num_heads=2, head_dim=16, seed=seed)
        for layer in seg.keys + seg.values:
            layer[..., 4:] *= 0.001
        return seg

    quant_roundtrip(shaped(1), "kvtc")  # the basis: fitted on a first segment without the outlier
    seg = shaped(0)
    for layer in seg.keys + seg.values:
        layer[:, 57, -1] = 3.0  # an entry along a direction the basis gives no bits (slot 57: never a sink)
    plain, kept = quant_roundtrip(seg, "kvtc-o0"), quant_roundtrip(seg, "kvtc")
    stored = torch.float16 if dtype == torch.float32 else dtype
    checked = 0
    for orig_layers, plain_layers, kept_layers in ((seg.keys, plain.keys, kept.keys), (seg.values, plain.values,
                                                                                       kept.values)):  # fmt: skip
        for i, (x, a, b) in enumerate(zip(orig_layers, plain_layers, kept_layers, strict=True)):
            for h in range(x.shape[0]):
                rows = seg.valid[i][h] if seg.valid[i] is not None else torch.ones(x.shape[1], dtype=torch.bool)
                coded = rows & (seg.positions[i][h] >= 4)
                xs, as_, bs = x[h][coded], a[h][coded], b[h][coded]
                error = (xs.float() - as_.float()).square().sum(-1)
                count = math.ceil(0.02 * xs.shape[0])
                worst = torch.zeros(xs.shape[0], dtype=torch.bool)
                worst[error.topk(count).indices] = True
                planted = (torch.arange(x.shape[1]) == 57)[coded]
                assert bool(worst[planted].all()) and torch.equal(bs[planted], xs[planted].to(stored).to(dtype))
                if dtype == torch.float32:  # the ranking is the codec's (fp32 decode); bf16 rounding reorders ties
                    assert torch.equal(bs[worst], xs[worst].to(stored).to(dtype))
                    assert torch.equal(bs[~worst], as_[~worst])
                assert int((bs != as_).any(-1).sum()) <= count
                assert torch.equal(b[h][rows & ~coded], x[h][rows & ~coded])  # sinks exact as before
                checked += int(worst.sum())
    assert checked > 0
    assert read_header(encode(seg, "kvtc"))["version"] == 5 and read_header(encode(seg, "kvtc-o0"))["version"] == 4
    extra = len(encode(seg, "kvtc")) - len(encode(seg, "kvtc-o0"))
    assert 0 < extra <= checked * (16 * 2 + 4) + 4096  # 16 fp16 numbers and one int32 index per kept row, + headers


def test_head_wise_layer_stored_without_padding():
    """A head-wise layer is coded from its valid entries only: padding costs no bytes (none and kvtc alike)."""
    dense = make_segment(lengths=(1000,), num_heads=4, head_dim=64, masked=False)
    padded = make_segment(lengths=(1000,), num_heads=4, head_dim=64, masked=False)
    padded.valid = [torch.arange(1000)[None].expand(4, -1) < torch.tensor([[1000], [200], [200], [200]])]
    for quant in (None, "kvtc-b2"):
        full, sparse = len(encode(dense, quant)), len(encode(padded, quant))
        assert sparse < 0.5 * full  # 1600 of 4000 entries valid
    out = decode(encode(padded))
    assert segments_equal(out, padded) and not bool(out.keys[0][~padded.valid[0]].any())


def test_batched_inverse_equals_the_formula_matrix_by_matrix():
    """decode_matrices (bytes straight into one batched product) gives, for each matrix, mean + coef @ basis.T with
    coef = offset + step * (code - 128) on the used components: unequal row counts, a matrix of no rows and one whose
    components all got no bits (its rows are its mean)."""
    from kvforge.store.transform import decode_matrices, encode_matrix

    g = torch.Generator().manual_seed(3)
    d, counts, budgets = 8, [37, 0, 12, 5], [2.0, 2.0, 3.0, 1e-9]
    basis = torch.linalg.qr(torch.randn(4, d, d, generator=g))[0]
    mean = torch.randn(4, d, generator=g)
    streams, side, want = [], [[], [], []], []
    for h, (n, budget) in enumerate(zip(counts, budgets, strict=True)):
        x = torch.randn(n, d, generator=g) * torch.linspace(3, 0.1, d)
        data, bits, offset, step = encode_matrix(x, mean[h], basis[h], budget)
        streams.append(data)
        for j, t in enumerate((bits, offset, step)):
            side[j].append(t)
        used = bits > 0
        codes = torch.zeros(n, d)
        if n and int(used.sum()):
            import zlib

            raw = torch.frombuffer(bytearray(zlib.decompress(data)), dtype=torch.uint8).float()
            codes[:, used] = raw.view(int(used.sum()), n).T - 128
        coef = torch.where(used, offset.float() + step.float() * codes, torch.zeros(()))
        want.append(mean[h] + coef @ basis[h].T)
    assert int(side[0][3].sum()) == 0  # the last matrix's components all got no bits
    got = decode_matrices(streams, counts, *(torch.stack(t) for t in side), mean, basis)
    assert got.shape == (4, max(counts), d)
    for h, n in enumerate(counts):
        torch.testing.assert_close(got[h, :n], want[h], rtol=1e-5, atol=1e-5)


def test_layers_decoded_together_equal_layers_decoded_one_by_one(monkeypatch):
    """Layers of one shape and RoPE are decoded in one batch; layers of other RoPE frequencies, other widths or none
    form their own batches: the result is the same as decoding each layer alone (up to float rounding)."""
    from kvforge.store import codec, transform

    seg = make_segment(lengths=(90, 70, 60, 90, 40), num_heads=2, head_dim=16, masked=True)
    seg.positions = [p + 10 for p in seg.positions]  # past the sinks: rotations of every size
    seg.positions[0][:, :3] = torch.arange(3)  # ...but for a few sinks
    freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    rng = [freq, freq, None, freq * 0.5, freq]  # layer 2: no RoPE; layer 3: other frequencies
    basis = transform.basis_from_segment(seg)
    basis.inv_freq = rng
    transform.BOOK.add(basis)
    data = codec.encode(seg, "kvtc-b3", basis=basis)
    together = codec.decode(data)
    monkeypatch.setattr(codec, "MAX_DECODE_ELEMENTS", 1)  # every layer alone
    alone = codec.decode(data)
    for a, b in zip(together.keys + together.values, alone.keys + alone.values, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for i, m in enumerate(seg.valid):
        rows = m if m is not None else torch.ones(seg.keys[i].shape[:2], dtype=torch.bool)
        sinks = rows & (seg.positions[i] < transform.SINKS)
        assert torch.equal(together.keys[i][sinks], seg.keys[i][sinks])  # sinks exact in their own slots
        assert _rel_err(seg.keys[i], together.keys[i], rows) < 0.1  # keys back at their positions


def test_rotating_each_key_by_its_own_delta_equals_the_direct_rotation():
    from kvforge.rope import rotate_each, rotate_keys

    freq = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    keys = torch.randn(3, 50, 32)
    for delta in (torch.randint(-5, 40, (3, 50)), torch.randint(0, 10**6, (3, 50))):  # a range; scattered values
        torch.testing.assert_close(rotate_each(keys, delta, freq), rotate_keys(keys, delta, freq), rtol=1e-5,
                                   atol=1e-5)  # fmt: skip


def test_store_round_trip_is_bit_exact_with_the_in_process_decode(tmp_path):
    """memory, disk and tiered stores return exactly what quant_roundtrip gives; the basis is kept as a store blob."""
    seg = make_segment(lengths=(96, 80, 64), num_heads=2, head_dim=16)
    want = quant_roundtrip(seg, "kvtc")
    for url in ("memory://", f"file://{tmp_path}/d", f"memory://,file://{tmp_path}/t"):
        store = open_store(url + ("?quant=kvtc" if "," not in url else ""))
        store.put("doc", seg, quant="kvtc")
        got = store.get("doc")
        assert got is not None and segments_equal(got, want)
        assert any(k.startswith("kvbasis-") for k in store.blob_keys())
        store.close()


def test_another_process_reads_the_store_with_another_thread_count(tmp_path):
    """A document written by this process is decoded by another one (fresh cache dir: the basis comes from the store,
    other torch thread count) to exactly the bytes this process decodes."""
    seg = make_segment(lengths=(300, 256), num_heads=2, head_dim=64, masked=True)
    store = open_store(f"file://{tmp_path}/store?quant=kvtc-b2")
    store.put("doc", seg)
    want = store.get("doc")
    assert want is not None
    torch.save({"k": want.keys, "v": want.values, "p": want.positions}, tmp_path / "want.pt")
    code = textwrap.dedent(f"""
        import torch
        torch.set_num_threads(1)
        from kvforge.store import open_store
        got = open_store("file://{tmp_path}/store").get("doc")
        want = torch.load("{tmp_path}/want.pt")
        pairs = zip(got.keys + got.values + got.positions, want["k"] + want["v"] + want["p"])
        same = all(torch.equal(a, b) for a, b in pairs)
        print("SAME" if same else "DIFFERENT")
    """)  # fmt: skip
    env = dict(os.environ, KVFORGE_CACHE_DIR=str(tmp_path / "other-cache"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.strip() == "SAME", out.stderr[-2000:]


def test_missing_basis_is_a_miss_that_keeps_the_entry(tmp_path, monkeypatch):
    seg = make_segment(lengths=(64,), num_heads=2, head_dim=16, masked=False)
    store = open_store(f"file://{tmp_path}/store?quant=kvtc")
    store.put("doc", seg)
    for key in store.blob_keys():
        store.delete_blob(key)
    monkeypatch.setattr("kvforge.store.transform.BOOK", BasisBook(tmp_path / "empty"))
    assert store.get("doc") is None and store.contains("doc")  # not corrupt: kept for a process that has the basis


def test_calibrated_basis_codes_keys_before_rope_and_continues_a_model(tmp_path):
    """A basis calibrated on the model (keys before RoPE); a kvzip-compressed (head-wise) document stored kvtc-b8
    continues with logits within rounding of the uncompressed store's."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    basis = calibrate_basis(model, tok, num_tokens=256)
    assert all(f is not None for f in basis.inv_freq) and basis.info["rope"]
    _book().add(basis)
    engine = Engine(model, tok)
    ids = tok("It was the best of times, it was the worst of times. " * 6).input_ids
    cache, _ = engine.prefill(ids, press=build_press("kvzip", 0.5))
    seg = cache.to_segment(model_id=engine.model_id, token_ids=ids)
    assert any(m is not None for m in seg.valid)  # head-wise layers
    data = encode(seg, "kvtc-b8")
    assert read_header(data)["basis"] == basis.digest
    logits = {}
    for quant in (None, "kvtc-b8", "kvtc-b2"):
        restored = KVCache.from_segment(quant_roundtrip(seg, quant), model)
        logits[quant] = forward(model, torch.tensor([[5, 6, 7]]), restored)[:, -1]
    assert torch.allclose(logits["kvtc-b8"], logits[None], atol=2e-2)
    assert (logits["kvtc-b2"] - logits[None]).abs().max() > (logits["kvtc-b8"] - logits[None]).abs().max()


def test_first_segment_fits_the_basis_of_an_unknown_model_or_calibrates_a_known_one(tmp_path):
    """A store never runs a model: an uncalibrated model's first segment fits the basis (keys after RoPE); the
    engine calibrates the model (keys before RoPE, saved in the cache dir) before a kvtc store sees its KV."""
    model, tok = tiny_model("qwen2"), tiny_tokenizer()
    cache = KVCache.for_model(model)
    prefill(model, torch.randint(3, 90, (1, 80)), cache)
    seg = cache.to_segment(model_id="unknown-model")
    header = read_header(encode(seg, "kvtc"))
    basis = _book().by_digest(header["basis"])
    assert basis is not None and basis.info["fitted_on"] == "first segment" and basis.inv_freq[0] is None
    engine = Engine(model, tok)
    assert _book().saved(engine.model_id) is None  # reading the model id registers nothing
    store = open_store(f"file://{tmp_path}/kv?quant=kvtc")
    engine.reuse = PrefixReuse(store=store, model_id=engine.model_id, block_size=16)
    engine.generate("It was the best of times. " * 4, max_new_tokens=1)
    basis2 = _book().saved(engine.model_id)
    assert basis2 is not None and basis2.inv_freq[0] is not None  # calibrated on the model: keys before RoPE
    assert basis2.info["calibrated_on"] == "bundled sample"
    assert store_basis(open_store(f"file://{tmp_path}/kv"), engine.model_id).digest == basis2.digest
    entries = store.keys()
    assert entries and all(read_header(store.load(k))["basis"] == basis2.digest for k in entries)
    assert prepare_basis(model, tok) is basis2  # once per machine: saved, not calibrated again


def test_rag_chunks_through_a_kvtc_store():
    """RAG chunk reuse on a kvtc store: chunks are coded, loaded and re-rotated; at 8 bits the answer's logits are
    those of the full-precision store within rounding, and the second answer is all hits."""
    from kvforge.reuse.rag import ChunkReuse

    model, tok = tiny_model("llama"), tiny_tokenizer()
    docs = [
        "The harbour master keeps the spare key. " * 3,
        "The code of the gate is 4242. " * 3,
        "Ships leave at noon. " * 3,
    ]
    engine = Engine(model, tok)
    answers = {}
    for quant in ("none", "kvtc-b8"):
        reuse = ChunkReuse(model, tok, method="cacheblend", recompute_ratio=0.2,
                           store=open_store(f"memory://?quant={quant}"))  # fmt: skip
        first = engine.answer_chunks(docs, "What is the code?", rag=reuse, max_new_tokens=4)
        again = engine.answer_chunks(docs, "What is the code?", rag=reuse, max_new_tokens=4)
        assert first.reuse.chunks.chunk_misses == len(docs) and again.reuse.chunks.chunk_misses == 0
        assert again.token_ids == first.token_ids
        answers[quant] = first.token_ids
    assert answers["kvtc-b8"] == answers["none"]


def test_every_writer_of_a_store_codes_with_the_basis_the_store_names(tmp_path, caplog):
    """The store's ``kvbasis-model-`` blob, not each process's own basis, decides how a model's entries are coded:
    kvforge's engine and a vLLM connector writing one store code alike; a forged pointer is ignored."""
    from kvforge.store.transform import basis_for_put, basis_from_segment, model_blob_key, publish_basis, store_basis

    segment = make_segment(lengths=(64, 64), masked=False, model_id="m:shared:1:float32")
    other = make_segment(lengths=(64, 64), masked=False, model_id="m:shared:1:float32", seed=5)
    named, mine = basis_from_segment(segment), basis_from_segment(other)
    assert named.digest != mine.digest
    store = open_store(f"file://{tmp_path}/kv")
    publish_basis(store, named)
    BOOK.add(mine)  # this process would code with its own basis
    assert basis_for_put(store, other, "kvtc").digest == named.digest
    store.put("k", other, quant="kvtc")
    fresh = open_store(f"file://{tmp_path}/kv")  # another process: finds the basis in the store
    assert store_basis(fresh, other.model_id).digest == named.digest
    assert fresh.get("k") is not None

    empty = open_store(f"file://{tmp_path}/kv2")
    assert basis_for_put(empty, other, "kvtc").digest == mine.digest  # no pointer yet: this process's, now named
    assert store_basis(open_store(f"file://{tmp_path}/kv2"), other.model_id).digest == mine.digest

    forged = open_store(f"file://{tmp_path}/kv3")
    forged.put_blob(model_blob_key(other.model_id), b'{"model_id": "m:shared:1:float32", "digest": "../../etc"}')
    assert store_basis(forged, other.model_id) is None


def test_cache_calibrate_names_the_models_basis_in_the_store(tiny_llama_dir, tmp_path, capsys):
    from kvforge.cli import main
    from kvforge.model import load_model, model_fingerprint
    from kvforge.store.transform import store_basis

    url = f"file://{tmp_path}/kv"
    assert main(["cache", "calibrate", "--store", url, "--model", str(tiny_llama_dir), "--device", "cpu"]) == 0
    model_id = model_fingerprint(*load_model(str(tiny_llama_dir), device="cpu"))
    basis = store_basis(open_store(url), model_id)
    assert basis is not None and basis.digest in capsys.readouterr().out
