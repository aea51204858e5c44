"""The safetensors payload of a stored segment, written and read without extra copies.

The writer streams tensor buffers (no concatenation); the reader returns tensors that are views into a writable
buffer (a file read straight into memory becomes tensors with no second copy). Both follow the safetensors format
(https://github.com/huggingface/safetensors): ``u64 header_len``, JSON index, then the raw little-endian data.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvforge.errors import CorruptSegmentError

# safetensors dtype names (https://github.com/huggingface/safetensors, format spec)
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
METADATA = "__metadata__"  # the index entry of string metadata (not a tensor)
MAX_INDEX_BYTES = 100_000_000  # safetensors' own limit on the index size


def tensor_index(tensors: dict[str, Tensor]) -> tuple[dict[str, Any], list[memoryview]]:
    """The safetensors index (name -> dtype, shape, data_offsets) of ``tensors`` and their data buffers in order."""
    index: dict[str, Any] = {}
    buffers: list[memoryview] = []
    offset = 0
    # widest dtypes first: every tensor then starts aligned to its element size (as the safetensors writer does)
    for name, t in sorted(tensors.items(), key=lambda item: -item[1].element_size()):
        t = t.contiguous()
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"cannot store tensor {name} of dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        index[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        if nbytes:
            buffers.append(t.view(torch.uint8).reshape(-1).numpy().data)
    return index, buffers


def index_json(index: dict[str, Any]) -> bytes:
    """Canonical bytes of a tensor index (what a checksum covers: a reader rebuilds them from the parsed index)."""
    entries = {k: v for k, v in index.items() if k != METADATA}
    return json.dumps(entries, separators=(",", ":"), sort_keys=True).encode()


def write_parts(
    index: dict[str, Any], buffers: list[memoryview], metadata: dict[str, str] | None = None
) -> list[bytes | memoryview]:
    """A safetensors file as buffers to write in order: ``u64 n``, JSON index (with ``__metadata__``), data."""
    full = ({METADATA: metadata} if metadata else {}) | index
    raw = json.dumps(full, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keeps tensor data 8-byte aligned, as the safetensors writer does
    return [struct.pack("<Q", len(raw)), raw, *buffers]


def parse_index(buf: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """The JSON index of a safetensors buffer (``__metadata__`` included) and where its data starts."""
    if len(buf) < 8:
        raise CorruptSegmentError("payload truncated")
    (n,) = struct.unpack_from("<Q", buf)
    if n > MAX_INDEX_BYTES:
        raise CorruptSegmentError(f"not a safetensors file (index of {n} bytes)")
    if 8 + n > len(buf):
        raise CorruptSegmentError(f"truncated inside its safetensors index ({len(buf)} of {8 + n} bytes)")
    try:
        index = json.loads(bytes(memoryview(buf)[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptSegmentError(f"payload header is not valid JSON: {e}") from e
    if not isinstance(index, dict):
        raise CorruptSegmentError("payload header is not a safetensors index")
    return index, 8 + n


def read_payload(buf: memoryview, parsed: tuple[dict[str, Any], int] | None = None) -> dict[str, Tensor]:
    """Tensors of a safetensors buffer: views into ``buf`` when it is writable, else into one copy of it.
    ``parsed``: ``parse_index(buf)`` when the caller has it already."""
    if buf.readonly:  # one allocation and one copy for the whole payload, not one per tensor
        buf = np.frombuffer(buf, dtype=np.uint8).copy().data
    index, start = parse_index(buf) if parsed is None else parsed
    out = {}
    for name, spec in index.items():
        if name == METADATA:
            continue
        dtype = _TORCH_DTYPES.get(spec.get("dtype"))
        begin, end = spec["data_offsets"]
        shape = spec["shape"]
        count = 1
        for s in shape:
            count *= s
        if dtype is None or not 0 <= begin <= end <= len(buf) - start or (end - begin) != count * dtype.itemsize:
            raise CorruptSegmentError(f"payload entry {name} is inconsistent")
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        if (start + begin) % dtype.itemsize == 0:  # aligned (kvforge's writer always aligns): one view
            out[name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=start + begin).view(shape)
        else:  # ``view(dtype)`` refuses a misaligned start (RuntimeError: the caller reports it as corrupt)
            t = torch.frombuffer(buf, dtype=torch.uint8, count=end - begin, offset=start + begin)
            out[name] = t.view(dtype).reshape(shape)
    return out
