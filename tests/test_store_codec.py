"""Stored segment format: bit-exact round trips, refusal of foreign segments, corruption detection, int8 quant."""

from __future__ import annotations

import json
import sys

import pytest
import safetensors.torch
import torch
from store_helpers import make_segment

from kvforge.errors import CorruptSegmentError, ModelMismatchError
from kvforge.store import checksum, codec
from kvforge.store.codec import decode, encode, segments_equal
from kvforge.store.quant import QUANT_MODES
from kvforge.types import KVSegment

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("as_bytearray", [False, True])
def test_round_trip_is_bit_exact(dtype: torch.dtype, as_bytearray: bool) -> None:
    seg = make_segment(dtype, lengths=(9, 4, 0, 6))
    data = encode(seg)
    out = decode(bytearray(data) if as_bytearray else data)
    assert segments_equal(seg, out)
    masks = seg.valid + seg.valid
    for a, b, m in zip(seg.keys + seg.values, out.keys + out.values, masks, strict=True):
        assert a.dtype == b.dtype == dtype and (torch.equal(a, b) if m is None else torch.equal(a[m], b[m]))
        if m is not None:  # a head-wise layer is stored without its padding: padding slots come back as zeros
            assert not bool(b[~m].any()) and not bool(out.positions[1][~m].any())
    assert out.valid[1] is not None and torch.equal(out.valid[1], seg.valid[1])
    assert out.valid[0] is None and out.positions[1].dtype == torch.int64
    assert not torch.equal(out.positions[1][0], out.positions[1][1])  # per-head positions kept per head


def test_round_trip_keeps_large_positions_and_meta() -> None:
    seg = make_segment(meta={"press": "streaming_llm", "tokenizer_id": "tok-1", "nested": {"a": [1, 2.5, None]}})
    seg.positions[0] = seg.positions[0] + 2**40  # beyond int32: stored as int64
    out = decode(encode(seg))
    assert segments_equal(seg, out)
    assert codec.read_header(encode(seg))["tokenizer_id"] == "tok-1"


def test_segment_is_a_plain_safetensors_file(tmp_path) -> None:
    from safetensors import safe_open

    seg = make_segment(torch.bfloat16)
    data = encode(seg)
    path = tmp_path / "segment.kvseg"
    path.write_bytes(data)
    with safe_open(str(path), "pt") as f:  # the standard reader opens it, header in its metadata
        header = json.loads(f.metadata()[codec.METADATA_KEY])
        assert torch.equal(f.get_tensor("k.0"), seg.keys[0])
        assert torch.equal(f.get_tensor("k.1"), seg.keys[1][seg.valid[1]])  # head-wise: the valid entries only
    assert header == codec.read_header(data)
    assert header["version"] == 4 and header["dtype"] == "bfloat16"  # 4: a head-wise layer (5: kvtc outliers)
    assert header["layers"][0]["k_shape"] == [2, 7, 8] and header["token_ids"] == seg.token_ids
    assert header["full_bytes"] == seg.nbytes()
    tensors = safetensors.torch.load(data)
    assert torch.equal(tensors["v.2"], seg.values[2])


def test_a_foreign_safetensors_file_is_refused(tmp_path) -> None:
    data = safetensors.torch.save({"w": torch.zeros(3)}, metadata={"format": "pt"})
    with pytest.raises(CorruptSegmentError, match="without 'kvforge' metadata"):
        decode(data)


def test_decoded_tensors_are_independent_of_the_input_bytes() -> None:
    seg = make_segment()
    data = encode(seg)
    out = decode(data)
    out.keys[0].add_(1.0)
    assert segments_equal(seg, decode(data))


def test_refuses_another_model_tokenizer_or_dtype() -> None:
    data = encode(make_segment(torch.float16, meta={"tokenizer_id": "tok-a"}))
    decode(data, "tiny-model", expect_tokenizer_id="tok-a", expect_dtype=torch.float16)  # the right one loads
    with pytest.raises(ModelMismatchError, match="model 'tiny-model', not 'other-model'"):
        decode(data, expect_model_id="other-model")
    with pytest.raises(ModelMismatchError, match="tokenizer"):
        decode(data, expect_tokenizer_id="tok-b")
    with pytest.raises(ModelMismatchError, match="dtype 'float16', not 'float32'"):
        decode(data, expect_dtype=torch.float32)


def test_check_segment_after_a_store_get() -> None:
    seg = decode(encode(make_segment(torch.bfloat16, meta={"tokenizer_id": "tok-a"})))
    codec.check_segment(seg, "tiny-model", "tok-a", torch.bfloat16)
    for bad in ({"expect_model_id": "m2"}, {"expect_tokenizer_id": "tok-b"}, {"expect_dtype": torch.float16}):
        with pytest.raises(ModelMismatchError):
            codec.check_segment(seg, **bad)


def test_refuses_another_format_version() -> None:
    data = encode(make_segment())
    version = codec.read_header(data)["version"]
    patched = data.replace(b'\\"version\\":%d,' % version, b'\\"version\\":9,', 1)  # same length: well-formed
    assert patched != data
    with pytest.raises(ModelMismatchError, match="format version 9"):
        decode(patched)


def test_corrupt_or_truncated_bytes_raise_corrupt_error() -> None:
    data = encode(make_segment())
    hsize = codec.header_size(data)
    for cut in (0, 5, 16, hsize - 3, hsize + 10, len(data) - 1):
        with pytest.raises(CorruptSegmentError):
            decode(data[:cut])
    flipped = bytearray(data)
    flipped[-5] ^= 0x40  # one bit of a value
    with pytest.raises(CorruptSegmentError, match="checksum"):
        decode(bytes(flipped))
    with pytest.raises(CorruptSegmentError, match="not a kvforge segment"):
        decode(b"PK\x03\x04" + data[4:])
    garbled = bytearray(data)
    garbled[20] = ord("}")
    with pytest.raises(CorruptSegmentError):
        decode(bytes(garbled))
    assert not issubclass(CorruptSegmentError, ModelMismatchError)


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_checksum_algorithms(algo: str) -> None:
    if algo == "xxh3_128":
        pytest.importorskip("xxhash")
    seg = make_segment(torch.float16)
    data = encode(seg, checksum_algo=algo)
    assert codec.read_header(data)["checksum_algo"] == algo and segments_equal(decode(data), seg)
    flipped = bytearray(data)
    start = codec.header_size(data)
    flipped[(start + len(data)) // 2] ^= 0x01  # in the middle of the tensor data
    with pytest.raises(CorruptSegmentError, match="checksum"):
        decode(bytes(flipped))


def test_without_xxhash_sha256_is_used_and_xxh3_segments_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("xxhash")
    data = encode(make_segment(), checksum_algo="xxh3_128")
    monkeypatch.setitem(sys.modules, "xxhash", None)  # import xxhash now fails
    assert checksum.default_algo() == "sha256"
    assert codec.read_header(encode(make_segment()))["checksum_algo"] == "sha256"
    with pytest.raises(ModelMismatchError, match="pip install"):
        decode(data)


def test_meta_must_be_json() -> None:
    seg = make_segment(meta={"bad": object()})
    with pytest.raises(ValueError, match="JSON"):
        encode(seg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", sorted(QUANT_MODES))
def test_int8_quantisation_bounds_error_and_shrinks(mode: str, dtype: torch.dtype) -> None:
    seg = make_segment(dtype, lengths=(64, 32, 0), head_dim=16, masked=True)
    seg.keys[1][:, :, 3] *= 20  # an outlier channel
    seg.keys[1][~seg.valid[1]] = 1e4  # padding must not inflate the scales
    data = encode(seg, quant=mode)
    out = decode(data)
    assert out.meta["quant"] == mode and out.token_ids == seg.token_ids
    assert len(data) < len(encode(seg)) * (0.7 if dtype == torch.float32 else 0.9)
    for i in range(seg.num_layers):
        for name, x, y in (("k", seg.keys[i], out.keys[i]), ("v", seg.values[i], out.values[i])):
            assert y.dtype == dtype and y.shape == x.shape
            if x.numel() == 0:
                continue
            m = seg.valid[i]
            xf = x.float() if m is None else x.float().masked_fill(~m[..., None], 0)
            axis = QUANT_MODES[mode][0 if name == "k" else 1]
            scale = xf.abs().amax(dim=1 if axis == "channel" else 2, keepdim=True) / 127
            err = (y.float() - xf).abs()
            if m is not None:
                err = err.masked_fill(~m[..., None], 0)
            cast_err = 0.0 if dtype == torch.float32 else xf.abs() * (2**-8 if dtype == torch.bfloat16 else 2**-11)
            assert bool((err <= scale / 2 * 1.0001 + cast_err + 1e-7).all()), f"layer {i} {name}"


def test_quantised_positions_and_masks_stay_exact() -> None:
    seg = make_segment()
    out = decode(encode(seg, quant="int8-token"))
    assert all(torch.equal(a, b) for a, b in zip(seg.positions, out.positions, strict=True))
    assert torch.equal(seg.valid[1], out.valid[1])


def test_unknown_quant_mode() -> None:
    with pytest.raises(ValueError, match="int8-kivi"):
        encode(make_segment(), quant="int5")


def test_empty_segment_round_trips() -> None:
    seg = KVSegment(token_ids=[], keys=[], values=[], positions=[], valid=[], next_position=0, model_id="m")
    out = decode(encode(seg))
    assert out.num_layers == 0 and out.model_id == "m"


def test_header_is_self_describing_json() -> None:
    data = encode(make_segment())
    index = json.loads(data[8 : codec.header_size(data)])
    header = json.loads(index["__metadata__"][codec.METADATA_KEY])
    assert {
        "format",
        "version",
        "model_id",
        "tokenizer_id",
        "dtype",
        "layers",
        "token_ids",
        "next_position",
        "meta",
        "checksum_algo",
        "checksum",
        "quant",
        "full_bytes",
        "payload_bytes",
    } <= header.keys()


def test_every_header_byte_flip_is_caught() -> None:
    """The checksum covers the header too: no single flipped header byte gives a segment silently."""
    data = bytearray(encode(make_segment(), checksum_algo="sha256"))
    accepted = []
    for i in range(codec.header_size(data)):  # length field, tensor index and kvforge header
        flipped = bytearray(data)
        flipped[i] ^= 0x01
        try:
            decode(flipped)
        except (CorruptSegmentError, ModelMismatchError):
            continue
        accepted.append(i)
    assert accepted == []


def _old_format(seg, version: int) -> bytes:
    """``seg`` as formats 1 and 2 wrote it: magic + header length + header JSON + safetensors payload."""
    from kvforge.store.payload import tensor_index, write_parts

    data = encode(seg, checksum_algo="sha256")
    payload = b"".join(bytes(p) for p in write_parts(*tensor_index(safetensors.torch.load(data))))
    header = codec.read_header(data) | {"version": version, "payload_bytes": len(payload)}
    header["checksum"] = checksum.checksum([payload], "sha256")
    del header["header_checksum"]
    if version >= 2:
        header["header_checksum"] = checksum.checksum([codec._header_json(header)], "sha256")
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 16) % 8)
    return codec._PREFIX.pack(codec.MAGIC, len(raw)) + raw + payload


@pytest.mark.parametrize("version", [1, 2])
def test_format_1_and_2_segments_still_load(version: int) -> None:
    seg = make_segment()
    old = _old_format(seg, version)
    assert codec.read_header(old)["version"] == version and codec.header_size(old[:16]) > 16
    assert segments_equal(decode(old), seg)
    flipped = bytearray(old)
    flipped[-5] ^= 0x40
    with pytest.raises(CorruptSegmentError, match="checksum"):
        decode(bytes(flipped))
    relabelled = old.replace(b'"version":%d,' % version, b'"version":3,', 1)  # old layout, new version: refused
    with pytest.raises(CorruptSegmentError, match="layout"):
        decode(relabelled)
