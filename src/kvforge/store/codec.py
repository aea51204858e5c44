"""KVSegment <-> bytes, with no pickle: a plain safetensors file whose metadata holds kvforge's JSON header.

Layout (format 3)::

    u64 n  JSON index {"__metadata__": {"kvforge": "<header JSON>"}, "k.0": {...}, ...} (space-padded)  tensor data

so ``safetensors.safe_open(path, "pt")`` opens a stored segment (``.metadata()["kvforge"]`` is the header) and any
safetensors tool lists its tensors. The header says what the segment is (format version, model/tokenizer
fingerprint, dtype, per-layer shapes, token ids, next position, meta such as the press applied, optional
quantisation) and carries two checksums (xxh3-128, or sha256: see checksum.py): ``checksum`` of the tensor index
(canonical JSON) and the tensor data, ``header_checksum`` of the header itself. A reader thus refuses a foreign
segment from the header alone and detects truncation or a flipped byte anywhere before trusting any tensor.
Tensors per layer: ``k.{l}``, ``v.{l}``, ``p.{l}`` (positions), optional ``m.{l}`` (valid mask) and, when
quantised, ``k.{l}.scale``/``v.{l}.scale`` (int8) or ``.min``/``.step``/``.recent`` (int4/int2).

Formats 1 and 2 (``b"KVFORGE\\n"  u64 header_len  header JSON  safetensors payload``) are still read.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from kvforge.errors import CorruptSegmentError, ModelMismatchError
from kvforge.store.checksum import checksum, default_algo, hasher
from kvforge.store.payload import index_json, parse_index, read_payload, tensor_index, write_parts
from kvforge.store.quant import (
    QUANT_MODES,
    GroupScheme,
    dequantize,
    dequantize_groups,
    effective_group,
    parse_scheme,
    quantize,
    quantize_groups,
)
from kvforge.types import KVSegment

FORMAT = "kvforge-segment"
# 3: a plain safetensors file, the header in its metadata; 2: the header carries a checksum of itself
# (``header_checksum``); 1: payload checksum only. 1 and 2 put a custom prefix before the safetensors bytes.
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
METADATA_KEY = "kvforge"  # the safetensors metadata entry holding the header
MAGIC = b"KVFORGE\n"  # formats 1 and 2 start with it
_PREFIX = struct.Struct("<8sQ")  # formats 1 and 2: magic, header length
_MAX_HEADER = 100_000_000  # bytes; a larger length field is garbage (safetensors has the same limit)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptSegmentError(f"unknown dtype {name!r} in segment header")
    return dtype


# ------------------------------------------------------------------------------------------------ encode
def _layer_tensors(i: int, seg: KVSegment, quant: str | None) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The payload tensors of layer ``i`` and its header entry."""
    k, v, p, m = (
        t.detach().cpu() if t is not None else None
        for t in (seg.keys[i], seg.values[i], seg.positions[i], seg.valid[i])
    )
    assert k is not None and v is not None and p is not None
    info: dict[str, Any] = {
        "k_shape": list(k.shape),
        "v_shape": list(v.shape),
        "dtype": dtype_name(k.dtype),
        "v_dtype": dtype_name(v.dtype),
        "p_dtype": dtype_name(p.dtype),
        "valid": m is not None,
    }
    out: dict[str, Tensor] = {}
    scheme = parse_scheme(quant)
    if scheme is None:
        out[f"k.{i}"], out[f"v.{i}"] = k, v
    elif isinstance(scheme, GroupScheme):
        out |= _group_tensors(i, k, v, m, scheme, info)
    else:
        out[f"k.{i}"], out[f"k.{i}.scale"] = quantize(k, QUANT_MODES[quant][0], m)
        out[f"v.{i}"], out[f"v.{i}.scale"] = quantize(v, QUANT_MODES[quant][1], m)
    # positions: int32 when lossless, one row when every head holds the same positions (the common case)
    info["p_shared"] = bool(p.shape[0] > 1 and p.shape[1] > 0 and bool((p == p[:1]).all()))
    stored = p[:1] if info["p_shared"] else p
    if p.dtype == torch.int64 and (stored.numel() == 0 or (stored.min() >= -(2**31) and stored.max() < 2**31)):
        stored = stored.to(torch.int32)
    out[f"p.{i}"] = stored
    if m is not None:
        out[f"m.{i}"] = m.to(torch.bool)
    return out, info


def _group_tensors(
    i: int, k: Tensor, v: Tensor, m: Tensor | None, scheme: GroupScheme, info: dict[str, Any]
) -> dict[str, Tensor]:
    """Layer ``i`` under an int4/int2 scheme: keys per channel (groups along tokens), values per token (groups along
    channels), the most recent ``scheme.residual`` tokens kept as they are."""
    n = k.shape[1]
    nq = max(0, n - scheme.residual)
    gk, gv = effective_group(nq, scheme.group), effective_group(v.shape[2], scheme.group)
    info |= {"q_tokens": nq, "k_group": gk, "v_group": gv}
    mk = None if m is None else m[:, None, :nq].bool()
    mv = None if m is None else m[:, :nq, None].bool()
    out: dict[str, Tensor] = {}
    out[f"k.{i}"], out[f"k.{i}.min"], out[f"k.{i}.step"] = quantize_groups(
        k[:, :nq].transpose(1, 2), scheme.bits, gk, mk
    )
    out[f"v.{i}"], out[f"v.{i}.min"], out[f"v.{i}.step"] = quantize_groups(v[:, :nq], scheme.bits, gv, mv)
    if nq < n:
        out[f"k.{i}.recent"], out[f"v.{i}.recent"] = k[:, nq:], v[:, nq:]
    return out


def _group_layer(
    i: int, info: dict[str, Any], tensors: dict[str, Tensor], scheme: GroupScheme
) -> tuple[Tensor, Tensor]:
    """Keys and values of layer ``i`` rebuilt from :func:`_group_tensors`' output."""
    dtype, v_dtype = _dtype_from_name(info["dtype"]), _dtype_from_name(info["v_dtype"])
    nq = int(info["q_tokens"])
    k = dequantize_groups(tensors[f"k.{i}"], tensors[f"k.{i}.min"], tensors[f"k.{i}.step"], scheme.bits, nq, dtype)
    k = k.transpose(1, 2)
    v = dequantize_groups(
        tensors[f"v.{i}"], tensors[f"v.{i}.min"], tensors[f"v.{i}.step"], scheme.bits, info["v_shape"][2], v_dtype
    )
    if f"k.{i}.recent" in tensors:
        k = torch.cat([k, tensors[f"k.{i}.recent"]], dim=1)
        v = torch.cat([v, tensors[f"v.{i}.recent"]], dim=1)
    return k.contiguous(), v.contiguous()


def quant_roundtrip(segment: KVSegment, quant: str | None) -> KVSegment:
    """``segment`` encoded under ``quant`` and decoded again, exactly as a store would (one home for "what does this
    quantisation do to my KV"): ``quant=None`` returns a bit-exact copy. Accepts the names of
    :func:`kvforge.store.quant.parse_scheme` (``int8``, ``int4``, ``int2-g64-r128``, ...)."""
    return decode(bytearray(encode(segment, quant)))


def encode_parts(
    segment: KVSegment, quant: str | None = None, checksum_algo: str | None = None
) -> list[bytes | memoryview]:
    """The encoded segment as a list of buffers (write them in order; ``b"".join`` gives :func:`encode`).

    Args:
        quant: None or an int8 mode of :data:`kvforge.store.quant.QUANT_MODES`.
        checksum_algo: ``xxh3_128`` or ``sha256``; default xxh3_128 when ``xxhash`` is installed.
    """
    scheme = parse_scheme(quant)  # ValueError naming the choices for an unknown name
    quant = scheme.name if isinstance(scheme, GroupScheme) else scheme
    tensors: dict[str, Tensor] = {}
    layers = []
    for i in range(segment.num_layers):
        layer_tensors, info = _layer_tensors(i, segment, quant)
        tensors |= layer_tensors
        layers.append(info)
    index, buffers = tensor_index(tensors)
    algo = checksum_algo or default_algo()
    header = {
        "format": FORMAT,
        "version": VERSION,
        "model_id": segment.model_id,
        "tokenizer_id": segment.meta.get("tokenizer_id"),
        "dtype": layers[0]["dtype"] if layers else None,
        "num_layers": segment.num_layers,
        "num_tokens": segment.num_tokens,
        "num_entries": segment.num_entries(),
        "next_position": segment.next_position,
        "full_bytes": segment.nbytes(),
        "payload_bytes": sum(len(b) for b in buffers),  # tensor data bytes
        "checksum_algo": algo,
        "checksum": checksum([index_json(index), *buffers], algo),  # tensor index + data
        "quant": quant,
        "layers": layers,
        "token_ids": [int(t) for t in segment.token_ids],
        "meta": segment.meta,
    }
    try:
        header["header_checksum"] = checksum([_header_json(header)], algo)  # a flipped header byte is caught too
        raw = json.dumps(header, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"segment.meta must be JSON-serialisable: {e}") from e
    return write_parts(index, buffers, {METADATA_KEY: raw})


def _header_json(header: dict[str, Any]) -> bytes:
    """The bytes the header checksum covers: the header's JSON without ``header_checksum`` (key order kept)."""
    return json.dumps({k: v for k, v in header.items() if k != "header_checksum"}, separators=(",", ":"),
                      allow_nan=False).encode()  # fmt: skip


def encode(segment: KVSegment, quant: str | None = None, checksum_algo: str | None = None) -> bytes:
    """Encode a segment, optionally quantised (``"int8-channel"``, ``"int8-token"``, ``"int8-kivi"`` = ``"int8"``, or
    group-wise ``"int4"``/``"int2"`` with ``-g<group>``/``-r<recent tokens>``: see :mod:`kvforge.store.quant`)."""
    return b"".join(encode_parts(segment, quant, checksum_algo))


# ------------------------------------------------------------------------------------------------ decode
def header_size(prefix: bytes | bytearray | memoryview) -> int:
    """Bytes before the tensor data (length field + JSON index, or the older formats' magic + length + header), from
    the first 16 bytes of an encoded segment."""
    if len(prefix) < 8:
        raise CorruptSegmentError(f"segment truncated: {len(prefix)} bytes, not even a header")
    if bytes(prefix[:8]) == MAGIC:  # formats 1 and 2
        if len(prefix) < _PREFIX.size:
            raise CorruptSegmentError(f"segment truncated: {len(prefix)} bytes, not even a header")
        size, n = _PREFIX.size, _PREFIX.unpack_from(prefix)[1]
    else:
        size, n = 8, struct.unpack_from("<Q", prefix)[0]
    if n > _MAX_HEADER:
        raise CorruptSegmentError("not a kvforge segment (neither a safetensors file nor an older kvforge segment)")
    return int(size + n)


class Parsed(NamedTuple):
    """What the bytes before the tensor data say: the kvforge header, the tensor index (None for formats 1 and 2),
    where the tensor data (or the older formats' payload) starts, and the header's JSON text as stored."""

    header: dict[str, Any]
    index: dict[str, Any] | None
    start: int
    text: str | bytes


def _parse(data: bytes | bytearray | memoryview) -> Parsed:
    """Parse the header and tensor index of an encoded segment (not the tensors)."""
    end = header_size(data)
    if len(data) < end:
        raise CorruptSegmentError(
            f"segment truncated inside its header, or not a kvforge segment ({len(data)} of {end} bytes)"
        )
    if bytes(data[:8]) == MAGIC:
        index, text = None, bytes(memoryview(data)[_PREFIX.size : end])
    else:
        index, _ = parse_index(data)
        metadata = index.pop("__metadata__", None)
        text = metadata.get(METADATA_KEY) if isinstance(metadata, dict) else None
        if not isinstance(text, str):
            raise CorruptSegmentError(f"not a kvforge segment (a safetensors file without {METADATA_KEY!r} metadata)")
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptSegmentError(f"segment header is not valid JSON: {e}") from e
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CorruptSegmentError("segment header does not describe a kvforge segment")
    return Parsed(header, index, end, text)


def payload_hasher(prefix: bytes | bytearray | memoryview) -> tuple[Parsed, Any]:
    """For a reader that hashes while reading: (the parsed header, an incremental hasher already fed what the
    checksum covers before ``parsed.start``). Feeding it every byte from ``parsed.start`` on gives the digest
    ``decode`` checks; the reader hands both to ``decode`` (``parsed=``, ``payload_checksum=``), which then parses
    nothing again."""
    parsed = _parse(prefix)
    h = hasher(parsed.header["checksum_algo"])
    if parsed.index is not None:
        h.update(index_json(parsed.index))
    return parsed, h


def _header_checksum_ok(parsed: Parsed) -> bool:
    """Whether the header's ``header_checksum`` matches the header.

    The checksum covers the header's JSON without its ``header_checksum`` entry (the last one, as ``encode`` writes
    it). When the stored text ends with that entry, the covered bytes are the stored text without it (no re-encoding
    of the header, whose token ids make it long); otherwise, or if that does not match (an older writer's spacing),
    the header is re-encoded as ``encode`` does."""
    header = parsed.header
    expected, algo = header.get("header_checksum"), header["checksum_algo"]
    text = parsed.text
    if isinstance(text, str) and isinstance(expected, str):
        tail = f',"header_checksum":"{expected}"}}'
        if text.endswith(tail) and checksum([(text[: -len(tail)] + "}").encode()], algo) == expected:
            return True
    return bool(checksum([_header_json(header)], algo) == expected)


def read_header(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """Parse the JSON header of an encoded segment (the tensors are not read, nor checked)."""
    return _parse(data)[0]


def check_header(
    header: dict[str, Any],
    expect_model_id: str | None = None,
    expect_tokenizer_id: str | None = None,
    expect_dtype: torch.dtype | None = None,
) -> None:
    """Raise :class:`ModelMismatchError` when the segment is of another format version, model, tokenizer or dtype."""
    if header.get("version") not in READABLE_VERSIONS:
        raise ModelMismatchError(
            f"stored segment has format version {header.get('version')}, this kvforge reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}; clear the store (kvforge cache clear) or use a matching kvforge"
        )
    checks = [
        ("model", expect_model_id, header.get("model_id")),
        ("tokenizer", expect_tokenizer_id, header.get("tokenizer_id")),
        ("dtype", None if expect_dtype is None else dtype_name(expect_dtype), header.get("dtype")),
    ]
    for what, expected, found in checks:
        if expected is not None and found != expected:
            raise ModelMismatchError(
                f"stored segment was made with {what} {found!r}, not {expected!r}: refusing to "
                f"load another {what}'s KV cache"
            )


def check_segment(
    segment: KVSegment,
    expect_model_id: str | None = None,
    expect_tokenizer_id: str | None = None,
    expect_dtype: torch.dtype | None = None,
) -> None:
    """The checks of :func:`check_header`, on a segment a store returned (``store.get`` does not know the model)."""
    dtype = dtype_name(segment.keys[0].dtype) if segment.keys else None
    header = {"version": VERSION, "model_id": segment.model_id, "tokenizer_id": segment.meta.get("tokenizer_id")}
    check_header(header | {"dtype": dtype}, expect_model_id, expect_tokenizer_id, expect_dtype)


def decode(
    data: bytes | bytearray | memoryview,
    expect_model_id: str | None = None,
    *,
    expect_tokenizer_id: str | None = None,
    expect_dtype: torch.dtype | None = None,
    verify: bool = True,
    payload_checksum: tuple[int, str] | None = None,
    parsed: Parsed | None = None,
) -> KVSegment:
    """Decode bytes made by :func:`encode` into a CPU segment, bit-exact (quantised ones back in their dtype).

    Given a writable buffer (``bytearray``) the tensors are views into it (no copy); given ``bytes``, into a copy.
    ``payload_checksum``: ``(offset, hex digest)`` of the bytes from ``offset`` to the end under the header's
    algorithm, computed by the caller while it read them (the disk store hashes each chunk as it arrives, while it is
    in cache); used instead of hashing again when ``offset`` is where the payload starts, ignored otherwise.
    ``parsed``: what :func:`payload_hasher` parsed from the first bytes of this same ``data`` (not parsed again).

    Raises:
        ModelMismatchError: another format version, or not the expected model / tokenizer / dtype.
        CorruptSegmentError: truncated or garbled bytes, or a payload whose checksum differs from the header's.
    """
    if parsed is None:
        parsed = _parse(data)
    header, index, start = parsed.header, parsed.index, parsed.start
    check_header(header, expect_model_id, expect_tokenizer_id, expect_dtype)
    buf = memoryview(data).cast("B")
    payload = buf[start:]
    if (header["version"] >= 3) != (index is not None):  # a flipped version digit must not skip a check
        raise CorruptSegmentError(f"segment header says format {header['version']}, its layout says otherwise")
    try:
        if len(payload) != header["payload_bytes"]:
            raise CorruptSegmentError(
                f"segment truncated: payload is {len(payload)} bytes, header says {header['payload_bytes']}"
            )
        algo = header["checksum_algo"]
        if verify and header["version"] >= 2 and not _header_checksum_ok(parsed):
            raise CorruptSegmentError("segment header checksum mismatch (the stored header was altered)")
        if verify:
            # a digest computed while reading (see payload_hasher) covers exactly ``covered``
            given = payload_checksum is not None and payload_checksum[0] == len(buf) - len(payload)
            if given:
                digest = payload_checksum[1]  # type: ignore[index]
            else:
                digest = checksum([payload] if index is None else [index_json(index), payload], algo)
            if digest != header["checksum"]:
                raise CorruptSegmentError("segment checksum mismatch (the stored bytes were altered)")
        tensors = read_payload(payload) if index is None else read_payload(buf, (index, start))
        return _segment_from(header, tensors)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        if isinstance(e, CorruptSegmentError):
            raise
        raise CorruptSegmentError(f"segment payload does not match its header: {e}") from e


def _segment_from(header: dict[str, Any], tensors: dict[str, Tensor]) -> KVSegment:
    keys, values, positions, valid = [], [], [], []
    quant = header.get("quant")
    scheme = parse_scheme(quant)
    for i, info in enumerate(header["layers"]):
        dtype, v_dtype = _dtype_from_name(info["dtype"]), _dtype_from_name(info["v_dtype"])
        m = tensors[f"m.{i}"] if info["valid"] else None
        if quant is None:
            k, v = tensors[f"k.{i}"], tensors[f"v.{i}"]
        elif isinstance(scheme, GroupScheme):
            k, v = _group_layer(i, info, tensors, scheme)
        else:
            k = dequantize(tensors[f"k.{i}"], tensors[f"k.{i}.scale"], dtype)
            v = dequantize(tensors[f"v.{i}"], tensors[f"v.{i}.scale"], v_dtype)
        if list(k.shape) != info["k_shape"] or list(v.shape) != info["v_shape"] or k.dtype != dtype:
            raise CorruptSegmentError(f"layer {i}: stored tensors do not match the header")
        p, p_dtype = tensors[f"p.{i}"], _dtype_from_name(info["p_dtype"])
        if info["p_shared"]:  # one row for every head: widened and repeated in one pass
            p = torch.empty((info["k_shape"][0], p.shape[1]), dtype=p_dtype).copy_(p.expand(info["k_shape"][0], -1))
        else:
            p = p.to(p_dtype)
        keys.append(k)
        values.append(v)
        positions.append(p)
        valid.append(m)
    meta = dict(header["meta"])
    if quant is not None:
        meta["quant"] = quant  # the caller must know this KV is approximate
    return KVSegment(
        token_ids=list(header["token_ids"]),
        keys=keys,
        values=values,
        positions=positions,
        valid=valid,
        next_position=int(header["next_position"]),
        model_id=header["model_id"],
        meta=meta,
    )


def summarize(header: dict[str, Any], stored_bytes: int | None = None) -> dict[str, Any]:
    """A small description of a stored segment (for ``kvforge cache ls`` and stats): no token ids, no layers."""
    meta = header.get("meta") or {}
    return {
        "num_tokens": header.get("num_tokens"),
        "num_entries": header.get("num_entries"),
        "next_position": header.get("next_position"),
        "num_layers": header.get("num_layers"),
        "model_id": header.get("model_id"),
        "tokenizer_id": header.get("tokenizer_id"),
        "dtype": header.get("dtype"),
        "quant": header.get("quant"),
        "press": meta.get("press"),
        "full_bytes": header.get("full_bytes"),
        "stored_bytes": stored_bytes,
        "version": header.get("version"),
    }


def segments_equal(a: KVSegment, b: KVSegment) -> bool:
    """Bit-exact equality of two segments (tensors with ``torch.equal``, dtypes included)."""

    def same(x: Sequence[Tensor | None], y: Sequence[Tensor | None]) -> bool:
        return len(x) == len(y) and all(
            (s is None and t is None) or (s is not None and t is not None and s.dtype == t.dtype and torch.equal(s, t))
            for s, t in zip(x, y, strict=True)
        )

    return (
        a.token_ids == b.token_ids
        and a.next_position == b.next_position
        and a.model_id == b.model_id
        and a.meta == b.meta
        and same(a.keys, b.keys)
        and same(a.values, b.values)
        and same(a.positions, b.positions)
        and same(a.valid, b.valid)
    )
