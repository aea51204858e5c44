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

import itertools
import json
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from kvforge.errors import CorruptSegmentError, ModelMismatchError
from kvforge.rope import rotate_each
from kvforge.store import transform
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
from kvforge.store.transform import KVBasis, MissingBasisError, TransformScheme
from kvforge.types import KVSegment

FORMAT = "kvforge-segment"
# 5: transform-coded layers keep the entries their code blurs most beside the codes (``.oidx``/``.orows``); 4: head-wise
# layers stored without padding (valid entries only, mask as bits), transform coding (kvtc); 3: a plain
# safetensors file, the header in its metadata; 2: the header carries a checksum of itself (``header_checksum``); 1:
# payload checksum only. 1 and 2 put a custom prefix before the safetensors bytes. A segment that needs none of
# version 4's layouts is written as version 3, one without outliers as version 4 (older readers still read them).
VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)
METADATA_KEY = "kvforge"  # the safetensors metadata entry holding the header
MAGIC = b"KVFORGE\n"  # formats 1 and 2 start with it
_PREFIX = struct.Struct("<8sQ")  # formats 1 and 2: magic, header length
_MAX_HEADER = 100_000_000  # bytes; a larger length field is garbage (safetensors has the same limit)
# What a header may make a reader allocate: decoded tensors of at most MAX_EXPANSION times the stored bytes (int2 and
# kvtc codes, DEFLATEd positions and head-wise padding stay far below it), or MIN_DECODED_LIMIT for small entries.
MAX_EXPANSION = 128
MIN_DECODED_LIMIT = 64 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptSegmentError(f"unknown dtype {name!r} in segment header")
    return dtype


# ------------------------------------------------------------------------------------------------ encode
def _layer_tensors(
    i: int, seg: KVSegment, quant: str | None, basis: KVBasis | None = None
) -> tuple[dict[str, Tensor], dict[str, Any]]:
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
    if isinstance(scheme, TransformScheme):
        assert basis is not None
        return _transform_tensors(i, k, v, p, m, scheme, basis, info), info
    if scheme is None and m is not None:  # head-wise: the valid entries only, no padding
        return _packed_tensors(i, k, v, p, m, info), info
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


def _packed_tensors(
    i: int, k: Tensor, v: Tensor, p: Tensor, m: Tensor | None, info: dict[str, Any]
) -> dict[str, Tensor]:
    """A head-wise layer without its padding: the valid entries of every head, head after head (``k.{i}``
    ``(N, D)``), their positions as per-head deltas (DEFLATE) and the mask as bits."""
    mask = m.bool()
    info["layout"] = "packed"
    out = {f"k.{i}": k[mask], f"v.{i}": v[mask]}
    out |= _compact_positions(i, p, mask, info)
    return out


def _compact_positions(i: int, p: Tensor, mask: Tensor | None, info: dict[str, Any]) -> dict[str, Tensor]:
    """Positions of the valid entries (all entries without a mask) as DEFLATEd per-head int64 deltas (the first of
    each head absolute); the mask as DEFLATEd bits."""
    import zlib

    rows = [p[h][mask[h]] if mask is not None else p[h] for h in range(p.shape[0])]
    shared = mask is None and p.shape[0] > 1 and p.shape[1] > 0 and bool((p == p[:1]).all())
    rows = rows[:1] if shared else rows
    deltas = torch.cat([torch.diff(r.long(), prepend=r.new_zeros(1).long()) for r in rows]) if rows else p.new_zeros(0)
    info["p_layout"], info["p_shared"] = "delta-deflate", shared
    out = {f"p.{i}": _bytes_tensor(zlib.compress(deltas.numpy().astype("<i8").tobytes(), 6))}  # runs: LZ77 helps
    if mask is not None:
        out[f"m.{i}"] = _bytes_tensor(zlib.compress(np.packbits(mask.numpy().reshape(-1)).tobytes(), 6))
    return out


def _bytes_tensor(data: bytes) -> Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def _transform_tensors(
    i: int, k: Tensor, v: Tensor, p: Tensor, m: Tensor | None, scheme: TransformScheme, basis: KVBasis,
    info: dict[str, Any],
) -> dict[str, Tensor]:  # fmt: skip
    """Layer ``i`` transform-coded (:mod:`kvforge.store.transform`): per KV head, the valid entries' keys (before
    RoPE when the basis says so) and values as PCA coefficients with bits by variance, DEFLATEd."""
    h, _, d = k.shape
    if i >= basis.num_layers or tuple(basis.key_basis[i].shape) != (h, d, d) or basis.value_basis[i].shape[0] != h:
        raise ValueError(f"layer {i}: KV of {h} heads x {d} dims does not fit the KV basis of {basis.model_id!r}")
    mask = None if m is None else m.bool()
    freq = basis.inv_freq[i]
    out: dict[str, Tensor] = {}
    streams: dict[str, list[bytes]] = {"k": [], "v": []}
    side: dict[str, list[list[Tensor]]] = {"k": [[], [], []], "v": [[], [], []]}
    exact: dict[str, list[Tensor]] = {"k": [], "v": []}
    worst: dict[str, tuple[list[Tensor], list[Tensor]]] = {"k": ([], []), "v": ([], [])}  # row indices, rows
    for head in range(h):
        rows = mask[head] if mask is not None else slice(None)
        positions = p[head][rows]
        sink = positions < transform.SINKS  # attention sinks: outliers, kept as they are
        exact["k"].append(k[head][rows][sink])
        exact["v"].append(v[head][rows][sink])
        coded = {"k": k[head][rows][~sink], "v": v[head][rows][~sink]}  # as stored: keys after RoPE
        keys = coded["k"].float()
        if freq is not None:
            keys = transform.unrotate(keys, positions[~sink], freq)
        parts = (
            ("k", keys, basis.key_mean[i][head], basis.key_basis[i][head], scheme.key_bits),
            ("v", coded["v"].float(), basis.value_mean[i][head], basis.value_basis[i][head], scheme.value_bits),
        )  # fmt: skip
        for name, x, mean, base, bits in parts:
            data, b, lo, step = transform.encode_matrix(x, mean, base, bits)
            streams[name].append(data)
            for j, t in enumerate((b, lo, step)):
                side[name][j].append(t)
            if scheme.outliers > 0:  # the entries this code blurs most, kept beside it as stored
                decoded = transform.decode_matrix(data, x.shape[0], b, lo, step, mean, base)
                idx = transform.worst_rows(x, decoded, scheme.outliers)
                worst[name][0].append(idx)
                worst[name][1].append(coded[name][idx])
    info["layout"] = "kvtc"
    for name in ("k", "v"):
        info[f"{name}_sizes"] = [len(x) for x in streams[name]]
        out[f"{name}.{i}"] = _bytes_tensor(b"".join(streams[name]))
        out[f"{name}.{i}.bits"], out[f"{name}.{i}.min"], out[f"{name}.{i}.step"] = (torch.stack(t) for t in side[name])
        out[f"{name}.{i}.exact"] = torch.cat(exact[name])
        if scheme.outliers > 0:
            idx, rows_kept = torch.cat(worst[name][0]), torch.cat(worst[name][1])
            info[f"{name}_outliers"] = [len(x) for x in worst[name][0]]
            out[f"{name}.{i}.oidx"] = idx.to(torch.int32)
            out[f"{name}.{i}.orows"] = rows_kept.to(transform.outlier_dtype(rows_kept))
    out |= _compact_positions(i, p, mask, info)
    return out


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
    quantisation do to my KV"): ``quant=None`` returns a bit-exact copy (head-wise padding as zeros). Accepts the
    names of :func:`kvforge.store.quant.parse_scheme` (``int8``, ``int4``, ``int2-g64-r128``, ``kvtc-b2``, ...)."""
    return decode(bytearray(encode(segment, quant)))


def encode_parts(
    segment: KVSegment, quant: str | None = None, checksum_algo: str | None = None, basis: KVBasis | None = None
) -> list[bytes | memoryview]:
    """The encoded segment as a list of buffers (write them in order; ``b"".join`` gives :func:`encode`).

    Args:
        quant: None, an int8 mode of :data:`kvforge.store.quant.QUANT_MODES`, ``int4``/``int2`` or ``kvtc``.
        checksum_algo: ``xxh3_128`` or ``sha256``; default xxh3_128 when ``xxhash`` is installed.
        basis: ``kvtc`` only: the PCA basis to code with (default: the model's, :data:`kvforge.store.transform.BOOK`).
    """
    scheme = parse_scheme(quant)  # ValueError naming the choices for an unknown name
    quant = scheme.name if isinstance(scheme, GroupScheme | TransformScheme) else scheme
    if isinstance(scheme, TransformScheme) and basis is None:
        basis = transform.BOOK.for_model(segment.model_id, sample=segment)
    tensors: dict[str, Tensor] = {}
    layers = []
    for i in range(segment.num_layers):
        layer_tensors, info = _layer_tensors(i, segment, quant, basis)
        tensors |= layer_tensors
        layers.append(info)
    index, buffers = tensor_index(tensors)
    algo = checksum_algo or default_algo()
    version = 3  # the oldest format that holds these layers
    if any("layout" in info for info in layers):
        version = 5 if any("k_outliers" in info for info in layers) else 4
    header = {
        "format": FORMAT,
        "version": version,
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
        "basis": basis.digest if isinstance(scheme, TransformScheme) and basis is not None else None,
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


def encode(
    segment: KVSegment, quant: str | None = None, checksum_algo: str | None = None, basis: KVBasis | None = None
) -> bytes:
    """Encode a segment, optionally quantised (``"int8-channel"``, ``"int8-token"``, ``"int8-kivi"`` = ``"int8"``,
    group-wise ``"int4"``/``"int2"`` with ``-g<group>``/``-r<recent tokens>``: see :mod:`kvforge.store.quant`; or
    transform-coded ``"kvtc"``: see :mod:`kvforge.store.transform`)."""
    return b"".join(encode_parts(segment, quant, checksum_algo, basis))


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
    basis_source: Any = None,
) -> KVSegment:
    """Decode bytes made by :func:`encode` into a CPU segment, bit-exact (quantised ones back in their dtype).

    Given a writable buffer (``bytearray``) the tensors are views into it (no copy); given ``bytes``, into a copy.
    ``payload_checksum``: ``(offset, hex digest)`` of the bytes from ``offset`` to the end under the header's
    algorithm, computed by the caller while it read them (the disk store hashes each chunk as it arrives, while it is
    in cache); used instead of hashing again when ``offset`` is where the payload starts, ignored otherwise.
    ``parsed``: what :func:`payload_hasher` parsed from the first bytes of this same ``data`` (not parsed again).
    ``basis_source``: ``fetch(blob key) -> bytes | None`` where a transform-coded segment's basis may be found besides
    this process and the kvforge cache dir (a store passes its own blobs).

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
        _check_layers(header, decoded_limit(len(buf)))
        tensors = read_payload(payload) if index is None else read_payload(buf, (index, start))
        basis = None
        if header.get("basis"):
            basis = transform.BOOK.by_digest(header["basis"], fetch=basis_source)
            if basis is None:
                raise MissingBasisError(
                    f"the segment is transform-coded with KV basis {header['basis']}, which is neither in this "
                    "process, the kvforge cache dir nor the store"
                )
        return _segment_from(header, tensors, basis)
    except (CorruptSegmentError, ModelMismatchError):
        raise
    except Exception as e:  # whatever odd value a header holds: a corrupt entry, never an error of the caller's
        raise CorruptSegmentError(f"segment payload does not match its header: {type(e).__name__}: {e}") from e


def decoded_limit(stored_bytes: int) -> int:
    """The most bytes of tensors an entry of ``stored_bytes`` may decode to (:data:`MAX_EXPANSION`)."""
    return max(MAX_EXPANSION * stored_bytes, MIN_DECODED_LIMIT)


def _shape(value: Any, what: str) -> tuple[int, int, int]:
    if not isinstance(value, list) or len(value) != 3 or not all(type(x) is int and x >= 0 for x in value):
        raise CorruptSegmentError(f"{what} is not a shape of three sizes: {str(value)[:80]}")
    return value[0], value[1], value[2]


def _check_layers(header: dict[str, Any], limit: int) -> None:
    """The header's layers are shapes of sane sizes whose tensors, decoded, fit in ``limit`` bytes: checked before
    anything is allocated from them (a forged header declaring huge shapes is a corrupt entry, not an allocation)."""
    layers, tokens = header["layers"], header["token_ids"]
    if (
        not isinstance(layers, list)
        or not isinstance(tokens, list)
        or header.get("num_layers", len(layers)) != len(layers)
    ):
        raise CorruptSegmentError("segment header's layers or token ids are not lists of the declared length")
    total = 0
    for i, info in enumerate(layers):
        if not isinstance(info, dict):
            raise CorruptSegmentError(f"layer {i}: header entry is not an object")
        h, s, d = _shape(info["k_shape"], f"layer {i}'s key shape")
        hv, sv, dv = _shape(info["v_shape"], f"layer {i}'s value shape")
        if (h, s) != (hv, sv):
            raise CorruptSegmentError(f"layer {i}: keys and values of different heads or lengths")
        sizes = [_dtype_from_name(str(info[x])).itemsize for x in ("dtype", "v_dtype", "p_dtype")]
        total += h * s * (d * sizes[0] + dv * sizes[1] + sizes[2] + 1)
        if total > limit:
            raise CorruptSegmentError(f"segment header declares tensors of over {limit} bytes (layer {i}): not decoded")


def _segment_from(header: dict[str, Any], tensors: dict[str, Tensor], basis: KVBasis | None = None) -> KVSegment:
    keys: list[Tensor] = []
    values: list[Tensor] = []
    positions: list[Tensor] = []
    valid: list[Tensor | None] = []
    quant = header.get("quant")
    scheme = parse_scheme(quant)
    compact: list[_CompactLayer] = []
    for i, info in enumerate(header["layers"]):
        dtype, v_dtype = _dtype_from_name(info["dtype"]), _dtype_from_name(info["v_dtype"])
        if "layout" in info:  # version 4: packed head-wise or transform-coded, decoded together below
            compact.append(_CompactLayer.read(i, info, tensors))
            for out in (keys, values, positions, valid):
                out.append(None)  # type: ignore[arg-type]
            continue
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
    coded = [layer for layer in compact if layer.info["layout"] != "packed"]
    if coded and basis is None:
        raise CorruptSegmentError(f"layer {coded[0].i} is transform-coded but the segment names no basis")
    decoded = _transform_layers(coded, tensors, basis) if coded else {}
    for layer in compact:
        if layer.info["layout"] == "packed":
            k_flat, v_flat = tensors[f"k.{layer.i}"], tensors[f"v.{layer.i}"]
        else:
            k_flat, v_flat = decoded[layer.i]
        keys[layer.i], values[layer.i], positions[layer.i], valid[layer.i] = layer.finish(k_flat, v_flat)
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


@dataclass
class _CompactLayer:
    """A version-4 layer's shape, mask and positions, read before its keys and values are decoded: ``flat`` holds
    every head's valid entries' positions, head after head (``counts`` per head)."""

    i: int
    info: dict[str, Any]
    mask: Tensor | None
    counts: list[int]
    flat: Tensor

    @classmethod
    def read(cls, i: int, info: dict[str, Any], tensors: dict[str, Tensor]) -> _CompactLayer:
        h, s, _ = info["k_shape"]
        mask = None
        if info["valid"]:
            packed = transform.inflate(tensors[f"m.{i}"].numpy().data, -(-h * s // 8), f"layer {i}'s mask")
            bits = np.unpackbits(np.frombuffer(packed, dtype=np.uint8))
            mask = torch.from_numpy(bits[: h * s].astype(bool).reshape(h, s))
        counts = mask.sum(dim=1).tolist() if mask is not None else [s] * h
        num_deltas = counts[0] if info["p_shared"] and counts else sum(counts)
        raw = transform.inflate(tensors[f"p.{i}"].numpy().data, 8 * num_deltas, f"layer {i}'s positions")
        deltas = np.frombuffer(raw, dtype="<i8")
        ends = np.cumsum([0, *(counts[:1] if info["p_shared"] else counts)])
        flat = np.concatenate([deltas[a:b].cumsum() for a, b in itertools.pairwise(ends)]) \
            if len(ends) > 1 else deltas.copy()  # fmt: skip
        if info["p_shared"]:
            flat = np.tile(flat, h)
        return cls(i, info, mask, counts, torch.from_numpy(np.ascontiguousarray(flat, dtype=np.int64)))

    def finish(self, k_flat: Tensor, v_flat: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Keys, values, positions and mask from the valid entries' keys and values (padding slots zero, as every
        KVCache holds them)."""
        info = self.info
        h, s, d = info["k_shape"]
        dv = info["v_shape"][2]
        dtype, v_dtype, p_dtype = (_dtype_from_name(info[x]) for x in ("dtype", "v_dtype", "p_dtype"))
        k_flat, v_flat = k_flat.to(dtype), v_flat.to(v_dtype)
        if self.mask is None:
            return k_flat.reshape(h, s, d), v_flat.reshape(h, s, dv), self.flat.reshape(h, s).to(p_dtype), None
        k = torch.zeros(h, s, d, dtype=dtype)
        v = torch.zeros(h, s, dv, dtype=v_dtype)
        p = torch.zeros(h, s, dtype=p_dtype)
        k[self.mask], v[self.mask], p[self.mask] = k_flat, v_flat, self.flat.to(p_dtype)
        return k, v, p, self.mask


MAX_DECODE_ELEMENTS = 1 << 24  # transform-coded layers decoded at once: at most this many coefficients (64 MB fp32)


def _transform_layers(
    layers: list[_CompactLayer], tensors: dict[str, Tensor], basis: KVBasis | None
) -> dict[int, tuple[Tensor, Tensor]]:
    """Keys and values ``(sum(counts), D)`` of each transform-coded layer, in its ``flat`` order: the attention sinks
    as stored, the rest decoded (:func:`kvforge.store.transform.decode_matrices`) for many layers at once (layers of
    one shape and RoPE, up to :data:`MAX_DECODE_ELEMENTS` coefficients: one product and one rotation for all), keys
    rotated back to their positions where the basis codes them before RoPE, and the outliers written over."""
    assert basis is not None
    out: dict[int, tuple[Tensor, Tensor]] = {}
    groups: list[list[_CompactLayer]] = []
    size = 0  # coefficients of the last group
    for layer in layers:
        h, _, d = layer.info["k_shape"]
        if layer.i >= basis.num_layers or tuple(basis.key_basis[layer.i].shape) != (h, d, d):
            raise CorruptSegmentError(f"layer {layer.i}: KV of {h} heads x {d} dims does not fit its KV basis")
        more = h * max(layer.counts, default=0) * d
        if groups and _same_coding(groups[-1][-1], layer, basis) and size + more <= MAX_DECODE_ELEMENTS:
            groups[-1].append(layer)
            size += more
        else:
            groups.append([layer])
            size = more
    for group in groups:
        out |= _transform_group(group, tensors, basis)
    return out


def _same_coding(a: _CompactLayer, b: _CompactLayer, basis: KVBasis) -> bool:
    """Layers decoded together: the same head count and widths, and the same RoPE frequencies (or none)."""
    fa, fb = basis.inv_freq[a.i], basis.inv_freq[b.i]
    same_rope = (fa is None and fb is None) or (fa is not None and fb is not None and torch.equal(fa, fb))
    return same_rope and a.info["k_shape"][0::2] == b.info["k_shape"][0::2] and \
        a.info["v_shape"][0::2] == b.info["v_shape"][0::2]  # fmt: skip


def _transform_group(
    group: list[_CompactLayer], tensors: dict[str, Tensor], basis: KVBasis
) -> dict[int, tuple[Tensor, Tensor]]:
    h = group[0].info["k_shape"][0]
    flat = torch.cat([layer.flat for layer in group])  # every entry of the group: layer after layer, head after head
    per_head = torch.tensor([n for layer in group for n in layer.counts], dtype=torch.long)
    matrix = torch.repeat_interleave(torch.arange(per_head.numel()), per_head)  # (layer, head) of each entry
    sink = flat < transform.SINKS
    rows_coded = torch.nonzero(~sink).flatten()  # entries decoded from codes, in order
    rows_exact = torch.nonzero(sink).flatten()
    of_coded = matrix[rows_coded]
    counts = torch.bincount(of_coded, minlength=per_head.numel())
    width = int(counts.max()) if counts.numel() else 0
    first = torch.cumsum(counts, 0) - counts
    source = of_coded * width + (torch.arange(of_coded.numel()) - first[of_coded])  # row in the decoded matrices
    counts_list = counts.tolist()
    gather = torch.zeros(flat.shape[0], dtype=torch.long)  # each entry's row in the decoded matrices (sinks: row 0)
    gather[rows_coded] = source
    freq = basis.inv_freq[group[0].i]
    result: dict[str, Tensor] = {}
    for name in ("k", "v"):
        streams: list[memoryview] = []
        for layer in group:
            sizes = layer.info[f"{name}_sizes"]
            if len(sizes) != h:
                raise CorruptSegmentError(f"layer {layer.i}: {len(sizes)} {name} streams for {h} heads")
            packed = tensors[f"{name}.{layer.i}"].numpy().data
            ends = np.cumsum([0, *sizes]).tolist()
            streams += [packed[ends[x] : ends[x + 1]] for x in range(h)]
        side = [torch.cat([tensors[f"{name}.{x.i}.{part}"] for x in group]) for part in ("bits", "min", "step")]
        means = basis.key_mean if name == "k" else basis.value_mean
        bases = basis.key_basis if name == "k" else basis.value_basis
        mean = torch.cat([means[x.i] for x in group])
        base = torch.cat([bases[x.i] for x in group])
        decoded = transform.decode_matrices(streams, counts_list, *side, mean, base)  # (layers * h, width, D)
        width_d = decoded.shape[-1]
        decoded = decoded.view(-1, width_d)
        if name == "k" and freq is not None:
            positions = torch.zeros(decoded.shape[0], dtype=torch.long)
            positions[source] = flat[rows_coded]
            decoded = rotate_each(decoded, positions, freq)
        index, kept = _outliers(group, tensors, name, counts, width)
        if index.numel():
            decoded[index] = kept.to(decoded.dtype)
        exact = torch.cat([tensors[f"{name}.{layer.i}.exact"] for layer in group])
        if exact.shape[0] != rows_exact.numel():
            raise CorruptSegmentError(f"layers {group[0].i}-{group[-1].i}: {exact.shape[0]} exact {name} entries "
                                      f"for {rows_exact.numel()} sinks")  # fmt: skip
        # one pass (the sinks' rows are overwritten next); nothing to gather from when every entry is a sink
        rows = decoded.index_select(0, gather) if decoded.shape[0] else decoded.new_empty(flat.shape[0], width_d)
        rows[rows_exact] = exact.to(decoded.dtype)
        result[name] = rows
    sizes = [layer.flat.shape[0] for layer in group]
    keys, values = result["k"].split(sizes), result["v"].split(sizes)
    return {layer.i: (k, v) for layer, k, v in zip(group, keys, values, strict=True)}


def _outliers(
    group: list[_CompactLayer], tensors: dict[str, Tensor], name: str, counts: Tensor, width: int
) -> tuple[Tensor, Tensor]:
    """The entries of a group's transform-coded layers kept at 16 bits beside the ``name`` codes: rows of the
    decoded ``(layers * heads * width, D)`` matrix and the rows to write there. Per layer, ``<name>.<i>.oidx``
    holds row indices among each head's coded entries (``info[<name>_outliers]`` per head), ``.orows`` the rows."""
    index, rows = [], []
    heads = len(group[0].counts)
    for g, layer in enumerate(group):
        per_head = layer.info.get(f"{name}_outliers")
        if per_head is None:  # written without outliers (version 4)
            continue
        idx, kept = tensors.get(f"{name}.{layer.i}.oidx"), tensors.get(f"{name}.{layer.i}.orows")
        if (
            idx is None
            or kept is None
            or len(per_head) != heads
            or idx.shape[0] != sum(per_head)
            or kept.shape[0] != idx.shape[0]
            or list(kept.shape[1:]) != layer.info[f"{name}_shape"][2:]
        ):
            raise CorruptSegmentError(f"layer {layer.i}: the entries kept beside the {name} codes do not match its "
                                      "header")  # fmt: skip
        matrix = g * heads + torch.repeat_interleave(torch.arange(heads), torch.tensor(per_head, dtype=torch.long))
        idx = idx.long()
        if idx.numel() and bool(((idx < 0) | (idx >= counts[matrix])).any()):
            raise CorruptSegmentError(f"layer {layer.i}: an entry kept beside the {name} codes lies outside them")
        index.append(matrix * width + idx)
        rows.append(kept)
    if not index:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0)
    return torch.cat(index), torch.cat(rows)


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
    """Bit-exact equality of two segments (tensors with ``torch.equal``, dtypes included). In a head-wise layer (a
    validity mask) only the valid entries are compared: padding slots hold nothing (stores keep them as zeros)."""

    def same(x: Tensor | None, y: Tensor | None, m: Tensor | None) -> bool:
        if x is None or y is None:
            return x is None and y is None
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        return torch.equal(x, y) if m is None else torch.equal(x[m], y[m])

    layers = len(a.keys) == len(b.keys) and all(
        same(ma, mb, None)
        and same(ka, kb, ma)
        and same(va, vb, ma)
        and same(pa, pb, ma)
        for ka, kb, va, vb, pa, pb, ma, mb in zip(a.keys, b.keys, a.values, b.values, a.positions, b.positions,
                                                  a.valid, b.valid, strict=True)
    )  # fmt: skip
    return (
        layers
        and a.token_ids == b.token_ids
        and a.next_position == b.next_position
        and a.model_id == b.model_id
        and a.meta == b.meta
    )
