"""Transform-coded storage of K/V (KVTC-style, arXiv 2511.01815): PCA per layer and KV head, bits by variance, DEFLATE.

A stored layer's keys and values are decorrelated with a basis fitted once per model (:class:`KVBasis`: mean and
principal directions of each layer and KV head, keys before RoPE when the basis says so), the coefficients of each
segment get bits by their variance in that segment under a budget of ``bits`` per element (reverse water-filling:
``b_j = round(log2(var_j / theta) / 2)`` capped at 8, ``theta`` set by bisection so the budget is met; a component
under the water level is dropped), are quantised uniformly with the Gaussian-optimal step of ``2^b_j`` levels for
their spread (fp16 offset and step per component; codes not clipped to those levels), and DEFLATE-compressed (zlib,
the standard library) one stream per layer, KV head and K/V: the entropy coder, not the bit count, sets the final
size. The attention sinks (positions < 4) are kept exact: their keys and values are outliers no low-bit code holds.
The entries the code blurs most are kept too: per KV head and K/V, the ``outliers`` percent (default 2%) of coded
entries with the largest squared error after decoding are stored beside the codes at 16 bits (exact for fp16/bf16
caches, fp16 for fp32 ones) and overwrite their decoded rows: tokens the basis describes badly (digits inside prose
are over-represented among them); without them a 2-bit code lost one digit of a 7-digit needle.
Positions of kept entries are stored as per-head deltas, the validity mask of head-wise layers as bits: only valid
entries are coded (a head-wise layer is not padded to its longest head).

The basis is not in the segment (it would cost more than the coded entries of a short document): the segment names it
by digest, and a reader finds it in this process, in the kvforge cache dir (``kv-basis/``) or in the store itself,
which keeps it as a blob next to the segments (:meth:`kvforge.store.base.BaseStore.put`). A basis is made once per
model, as an explicit step before the store sees its segments (:mod:`kvforge.calibrate`: on the bundled
public-domain sample text, keys before RoPE; the engine runs it when a store codes with kvtc, ``kvforge cache
calibrate`` ahead of time), else fitted on the first segment that needs one (keys as stored, after RoPE). The store
itself only sees segments and bytes: it never runs a model.

Decoding is deterministic: the same bytes give the same tensors in any process (tested across processes with other
thread counts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import threading
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvforge.errors import CorruptSegmentError, ModelMismatchError
from kvforge.paths import cache_dir
from kvforge.rope import rotate_keys

logger = logging.getLogger(__name__)
try:  # ISA-L inflates the same DEFLATE streams about 4x faster than zlib (a transform-coded load is mostly inflating)
    from isal import isal_zlib as _inflater

    _INFLATE_ERRORS: tuple[type[Exception], ...] = (zlib.error, _inflater.error)
except ImportError:  # a platform without its wheel
    _inflater = zlib  # type: ignore[assignment]
    _INFLATE_ERRORS = (zlib.error,)
BASIS_FORMAT = "kvforge-kv-basis/1"
BLOB_PREFIX = "kvbasis-"  # store blob key of a basis: kvbasis-<digest>
MAX_BITS = 8
SINKS = 4  # entries at positions < 4 (attention sinks) are stored exactly
DEFAULT_BITS = 2.0
DEFAULT_OUTLIERS = 2.0  # percent of the coded entries of each KV head (keys and values apiece) kept at 16 bits
MAX_OUTLIERS = 50.0
LEVEL = 6  # zlib level (Huffman only: the level changes little)
_DIGEST = re.compile(r"[0-9a-f]{32}")  # KVBasis.digest
_NUM = r"\d+(?:\.\d+)?"
_NAME = re.compile(rf"^kvtc(?:-b(?P<b>{_NUM}))?(?:-k(?P<k>{_NUM}))?(?:-v(?P<v>{_NUM}))?(?:-o(?P<o>{_NUM}))?$")


class MissingBasisError(ModelMismatchError):
    """A transform-coded segment names a basis this process cannot find (a miss; the entry is kept)."""


@dataclass(frozen=True)
class TransformScheme:
    """A parsed ``kvtc`` name: bits per element for keys and for values (before entropy coding), and the percent of
    coded entries kept at 16 bits (the ones the code blurs most)."""

    key_bits: float = DEFAULT_BITS
    value_bits: float = DEFAULT_BITS
    outliers: float = DEFAULT_OUTLIERS

    @property
    def name(self) -> str:
        if self.key_bits == self.value_bits:
            name = "kvtc" if self.key_bits == DEFAULT_BITS else f"kvtc-b{_num(self.key_bits)}"
        else:
            name = f"kvtc-k{_num(self.key_bits)}-v{_num(self.value_bits)}"
        return name if self.outliers == DEFAULT_OUTLIERS else f"{name}-o{_num(self.outliers)}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def parse_transform(name: str) -> TransformScheme | None:
    """``kvtc`` (2 bits, 2% outliers), ``kvtc-b3``, ``kvtc-b1.5``, ``kvtc-k3-v2``, ``kvtc-b2-o0`` (no outliers kept);
    None when ``name`` is not a kvtc name."""
    m = _NAME.match(name)
    if m is None:
        return None
    b = float(m["b"]) if m["b"] else DEFAULT_BITS
    k, v = float(m["k"]) if m["k"] else b, float(m["v"]) if m["v"] else b
    if not (0 < k <= MAX_BITS and 0 < v <= MAX_BITS):
        raise ValueError(f"quantisation {name!r}: bits per element must lie in (0, {MAX_BITS}]")
    outliers = float(m["o"]) if m["o"] else DEFAULT_OUTLIERS
    if outliers > MAX_OUTLIERS:
        raise ValueError(
            f"quantisation {name!r}: -o<percent of entries kept at 16 bits> must lie in [0, {MAX_OUTLIERS:g}]"
        )
    return TransformScheme(k, v, outliers)


# ------------------------------------------------------------------------------------------------ the basis
@dataclass
class KVBasis:
    """Per layer and KV head: mean ``(H_kv, D)`` and principal directions ``(H_kv, D, D)`` (columns by decreasing
    variance) of keys and of values; ``inv_freq[l]`` ``(D/2,)`` when layer l's keys are coded before RoPE."""

    model_id: str
    key_mean: list[Tensor]
    key_basis: list[Tensor]
    value_mean: list[Tensor]
    value_basis: list[Tensor]
    inv_freq: list[Tensor | None]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        if "_digest" not in self.__dict__:
            h = hashlib.sha256()
            for name, t in sorted(self._tensors().items()):
                h.update(name.encode() + str(tuple(t.shape)).encode())
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
            self.__dict__["_digest"] = h.hexdigest()[:32]
        return str(self.__dict__["_digest"])

    @property
    def num_layers(self) -> int:
        return len(self.key_mean)

    def _tensors(self) -> dict[str, Tensor]:
        out = {}
        for i in range(self.num_layers):
            out |= {f"km.{i}": self.key_mean[i], f"kb.{i}": self.key_basis[i]}
            out |= {f"vm.{i}": self.value_mean[i], f"vb.{i}": self.value_basis[i]}
            if self.inv_freq[i] is not None:
                out[f"f.{i}"] = self.inv_freq[i]  # type: ignore[assignment]
        return {k: v.float().contiguous().clone() for k, v in out.items()}  # no shared storage (RoPE tables)

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        meta = {"format": BASIS_FORMAT, "model_id": self.model_id, "num_layers": self.num_layers, "info": self.info,
                "digest": self.digest}  # fmt: skip
        return bytes(save(self._tensors(), metadata={"kvforge": json.dumps(meta)}))

    @classmethod
    def from_bytes(cls, data: bytes) -> KVBasis:
        from safetensors.torch import load

        try:
            n = int.from_bytes(data[:8], "little")
            meta = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["kvforge"])
            tensors = load(data)
        except Exception as exc:
            raise CorruptSegmentError(f"not a KV basis: {exc}") from None
        if meta.get("format") != BASIS_FORMAT:
            raise CorruptSegmentError("not a kvforge KV basis")
        n = int(meta["num_layers"])
        basis = cls(
            meta["model_id"],
            [tensors[f"km.{i}"] for i in range(n)],
            [tensors[f"kb.{i}"] for i in range(n)],
            [tensors[f"vm.{i}"] for i in range(n)],
            [tensors[f"vb.{i}"] for i in range(n)],
            [tensors.get(f"f.{i}") for i in range(n)],
            meta.get("info") or {},
        )
        if basis.digest != meta.get("digest"):
            raise CorruptSegmentError("KV basis checksum mismatch")
        return basis


def fit_basis(
    model_id: str,
    keys: list[list[Tensor]],
    values: list[list[Tensor]],
    inv_freq: list[Tensor | None] | None = None,
    info: dict[str, Any] | None = None,
) -> KVBasis:
    """A basis from samples: ``keys[l][h]`` ``(N, D)`` (already un-rotated where ``inv_freq[l]`` is given)."""

    def pca(x: Tensor) -> tuple[Tensor, Tensor]:
        x = x.double()
        mean = x.mean(dim=0)
        cov = (x - mean).T @ (x - mean) / max(1, x.shape[0] - 1)
        eigenvalues, vectors = torch.linalg.eigh(cov)
        order = eigenvalues.argsort(descending=True)
        return mean.float(), vectors[:, order].float()

    km, kb, vm, vb = [], [], [], []
    for layer_keys, layer_values in zip(keys, values, strict=True):
        k = [pca(x) for x in layer_keys]
        v = [pca(x) for x in layer_values]
        km.append(torch.stack([m for m, _ in k]))
        kb.append(torch.stack([b for _, b in k]))
        vm.append(torch.stack([m for m, _ in v]))
        vb.append(torch.stack([b for _, b in v]))
    freqs = inv_freq if inv_freq is not None else [None] * len(keys)
    return KVBasis(model_id, km, kb, vm, vb, [None if f is None else f.float() for f in freqs], info or {})


def unrotate(keys: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """Post-RoPE keys ``(N, D)`` at ``positions`` ``(N,)`` back to before RoPE (fp32)."""
    return rotate_keys(keys.float(), -positions, inv_freq)


# ------------------------------------------------------------------------------------------------ where bases live
class BasisBook:
    """The bases this process knows: by digest and by model, backed by the kvforge cache dir (``kv-basis/``), where a
    model's basis lies beside its other artefacts (:mod:`kvforge.calibrate` makes it on the model, keys before RoPE).
    """

    def __init__(self, folder: Path | None = None) -> None:
        self._folder = folder
        self._by_digest: dict[str, KVBasis] = {}
        self._by_model: dict[str, KVBasis] = {}
        self._lock = threading.Lock()

    @property
    def folder(self) -> Path:
        return self._folder if self._folder is not None else cache_dir() / "kv-basis"

    def _model_file(self, model_id: str) -> Path:
        return self.folder / f"model-{hashlib.sha256(model_id.encode()).hexdigest()[:24]}.kvbasis"

    def _digest_file(self, digest: str) -> Path:
        return self.folder / f"{digest}.kvbasis"

    def add(self, basis: KVBasis, for_model: bool = True) -> KVBasis:
        """Remember ``basis`` (in memory and, best effort, in the cache dir)."""
        with self._lock:
            self._by_digest[basis.digest] = basis
            if for_model:
                self._by_model[basis.model_id] = basis
        data = basis.to_bytes()
        files = [self._digest_file(basis.digest)] + ([self._model_file(basis.model_id)] if for_model else [])
        for path in files:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_bytes(data)
                os.replace(tmp, path)
            except OSError as exc:  # a read-only cache dir only costs the next process a calibration
                logger.warning("cannot save KV basis to %s: %s", path, exc)
                break
        return basis

    def by_digest(self, digest: str, fetch: Callable[[str], bytes | None] | None = None) -> KVBasis | None:
        """The basis with ``digest``: from memory, the cache dir, or ``fetch(blob key)`` (a store's blobs). A digest
        is hex digits (it names a file): anything else, e.g. a path read from a forged header, is refused."""
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise CorruptSegmentError(f"KV basis name {str(digest)[:40]!r} is not a digest")
        basis = self._by_digest.get(digest)
        if basis is not None:
            return basis
        data = _read(self._digest_file(digest))
        if data is None and fetch is not None:
            data = fetch(BLOB_PREFIX + digest)
        if data is None:
            return None
        basis = KVBasis.from_bytes(data)
        if basis.digest != digest:
            raise CorruptSegmentError(f"KV basis {digest} holds another basis ({basis.digest})")
        with self._lock:
            self._by_digest[digest] = basis
        return basis

    def saved(self, model_id: str) -> KVBasis | None:
        """The basis of ``model_id`` this process knows or the cache dir holds, else None."""
        basis = self._by_model.get(model_id)
        if basis is not None:
            return basis
        data = _read(self._model_file(model_id))
        if data is None:
            return None
        try:
            basis = KVBasis.from_bytes(data)
        except CorruptSegmentError as exc:
            logger.warning("KV basis file of %s is unreadable (%s): making a new one", model_id, exc)
            return None
        with self._lock:
            self._by_model[model_id] = self._by_digest[basis.digest] = basis
        return basis

    def for_model(self, model_id: str, sample: Any = None) -> KVBasis:
        """The basis of ``model_id``: known or saved (calibrated on the model), else fitted on ``sample`` (a
        :class:`~kvforge.types.KVSegment`, keys after RoPE)."""
        basis = self.saved(model_id)
        if basis is not None:
            return basis
        if sample is None:
            raise CorruptSegmentError(f"no KV basis for model {model_id!r}")
        logger.info("KV basis of %s fitted on the first segment stored with it (keys after RoPE)", model_id)
        return self.add(basis_from_segment(sample))


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


BOOK = BasisBook()  # the process's bases (like the read buffers of store/buffers.py: one per process)


def basis_from_segment(segment: Any) -> KVBasis:
    """A basis fitted on one segment's own entries (keys as stored, after RoPE)."""
    keys, values = [], []
    for k, v, m in zip(segment.keys, segment.values, segment.valid, strict=True):
        keys.append([k[h][m[h]] if m is not None else k[h] for h in range(k.shape[0])])
        values.append([v[h][m[h]] if m is not None else v[h] for h in range(v.shape[0])])
    return fit_basis(segment.model_id, keys, values, info={"fitted_on": "first segment", "tokens": segment.num_tokens})


# ------------------------------------------------------------------------------------------------ coding one matrix
def allocate_bits(variances: Tensor, budget: float) -> Tensor:
    """Integer bits per component (``(D,)``, 0..8) for coefficients of ``variances``: reverse water-filling,
    ``b_j = round(log2(var_j / theta) / 2)``, with the largest ``theta`` whose total fits ``budget * D`` bits."""
    var = variances.double().clamp_min(0)
    total = budget * var.numel()

    def bits(theta: float) -> Tensor:
        return (0.5 * torch.log2(var.clamp_min(1e-300) / theta)).round().clamp(0, MAX_BITS)

    top = float(var.max())
    if top <= 0:
        return torch.zeros(var.shape, dtype=torch.uint8)
    low = float(var[var > 0].min())
    lo, hi = low * 4.0 ** (-MAX_BITS - 1), top * 4.0  # bits(hi) = 0 everywhere; bits(lo) = 8 wherever var > 0
    for _ in range(64):
        mid = math.sqrt(lo * hi)
        if float(bits(mid).sum()) > total:
            lo = mid
        else:
            hi = mid
    return bits(hi).to(torch.uint8)


# step of the uniform quantiser with 2^b levels that minimises the squared error of a unit Gaussian (Max, 1960)
GAUSSIAN_STEP = (0.0, 1.596, 0.9957, 0.586, 0.3352, 0.1881, 0.1041, 0.0569, 0.0308)


def encode_matrix(x: Tensor, mean: Tensor, basis: Tensor, budget: float) -> tuple[bytes, Tensor, Tensor, Tensor]:
    """Code ``x`` ``(N, D)`` fp32: ``(deflated codes, bits (D,) uint8, offset (D,) f16, step (D,) f16)``.

    A component with ``b`` bits is quantised with the Gaussian-optimal step of ``2^b`` levels for its spread; codes
    are not clipped to those levels (a rare large coefficient costs DEFLATE a longer code, not a clipped value), up to
    +-127 steps; one byte per code, component after component, so each DEFLATE block sees one distribution."""
    coef = (x - mean) @ basis  # (N, D)
    n, d = coef.shape
    zeros = torch.zeros(d, dtype=torch.float16)
    if n == 0:
        return b"", torch.zeros(d, dtype=torch.uint8), zeros, zeros + 1
    bits = allocate_bits(coef.var(dim=0, unbiased=False), budget)
    offset = coef.mean(dim=0).to(torch.float16)
    table = torch.tensor(GAUSSIAN_STEP)[bits.long()]
    step = (coef.std(dim=0, unbiased=False) * table).to(torch.float16)
    step = torch.where(step.float() > 0, step, torch.ones_like(step))
    parts = []
    for j in torch.nonzero(bits, as_tuple=False).flatten().tolist():
        q = ((coef[:, j] - offset[j].float()) / step[j].float()).round_().clamp_(-127, 127)
        parts.append((q + 128).to(torch.uint8).numpy().tobytes())
    return deflate(b"".join(parts)), bits, offset, step


def worst_rows(x: Tensor, decoded: Tensor, percent: float) -> Tensor:
    """Indices (ascending, int64) of the ``ceil(percent% of N)`` rows of ``x`` ``(N, D)`` that ``decoded`` misses by the
    largest squared error: the entries a code blurs most."""
    n = x.shape[0]
    count = min(n, math.ceil(n * percent / 100 - 1e-9)) if percent > 0 else 0
    if count == 0:
        return torch.zeros(0, dtype=torch.long)
    error = (x.float() - decoded.float()).square().sum(dim=-1)
    return error.topk(count).indices.sort().values


def outlier_dtype(rows: Tensor) -> torch.dtype:
    """Where outlier entries are kept: as they are when 16-bit, fp16 for wider floats that fit it, else as they are."""
    if rows.dtype.itemsize <= 2 or not rows.is_floating_point():
        return rows.dtype
    fits = rows.numel() == 0 or bool(torch.isfinite(rows).all() and rows.abs().max() <= torch.finfo(torch.float16).max)
    return torch.float16 if fits else rows.dtype


def deflate(data: bytes) -> bytes:
    """DEFLATE with Huffman coding only: quantised coefficients hold no repeated strings for LZ77 to find, and its
    matches cost 20-25% over the codes' entropy (measured on Gaussian codes: 1.39 vs 1.15 bits at 1 bit, 2.48 vs 2.10 at
    2 bits; entropy 1.09 / 2.01). Any zlib inflates it."""
    packer = zlib.compressobj(LEVEL, zlib.DEFLATED, 15, 9, zlib.Z_HUFFMAN_ONLY)
    return packer.compress(data) + packer.flush()


def inflate(data: bytes | memoryview, size: int, what: str) -> bytes:
    """DEFLATEd ``data`` inflated to exactly ``size`` bytes, never more: a stream that holds more (a bomb) or less is
    a :class:`CorruptSegmentError`, found before more than ``size`` bytes are allocated."""
    unpacker = _inflater.decompressobj()
    try:
        out = unpacker.decompress(bytes(data), max(size, 1))  # (a max_length of 0 would mean "no limit")
    except _INFLATE_ERRORS as e:
        raise CorruptSegmentError(f"{what} is not a DEFLATE stream ({e})") from None
    if len(out) != size or unpacker.unconsumed_tail or (not unpacker.eof and unpacker.decompress(b"", 1)):
        raise CorruptSegmentError(f"{what} does not inflate to the {size} bytes its header says")
    return out


def decode_matrix(data: bytes | memoryview, n: int, bits: Tensor, offset: Tensor, step: Tensor, mean: Tensor,
                  basis: Tensor) -> Tensor:  # fmt: skip
    """Inverse of :func:`encode_matrix`: ``(n, D)`` fp32."""
    return decode_matrices([data], [n], bits[None], offset[None], step[None], mean[None], basis[None])[0, :n]


def decode_matrices(streams: list[bytes | memoryview], counts: list[int], bits: Tensor, offset: Tensor, step: Tensor,
                    mean: Tensor, basis: Tensor) -> Tensor:  # fmt: skip
    """:func:`encode_matrix`'s outputs for H matrices at once (``bits``/``offset``/``step``/``mean`` ``(H, D)``,
    ``basis`` ``(H, D, D)``, matrix ``h`` of ``counts[h]`` rows coded in ``streams[h]``): ``(H, max(counts), D)`` fp32,
    rows past a matrix's count holding its mean plus offsets.

    A coefficient is ``offset_j + step_j (c - 128)`` for its byte ``c``, and ``x = mean + coef @ basis.T``, so the
    centred codes go into one batched product as they are: ``x = (c - 128) @ (step_j basis_j) + mean + offset @
    basis.T``, over the used components only (components without bits have zero offset and no codes; matrices with
    fewer used components are padded with zero codes). One copy per matrix, one product for all."""
    h = bits.shape[0]
    rows = max(counts, default=0)
    bits_np = bits.numpy()
    used = [np.flatnonzero(bits_np[head]) for head in range(h)]
    width = max((len(u) for u in used), default=0)  # the product runs over used components only (padded)
    codes = np.zeros((h, width, rows), dtype=np.float32)  # component-major, as the streams hold them
    index = np.zeros((h, width), dtype=np.int64)
    for head, (data, n) in enumerate(zip(streams, counts, strict=True)):
        size = n * len(used[head])
        index[head, : len(used[head])] = used[head]
        if size or len(data):
            raw = inflate(data, size, "a transform-coded layer")
            if size:
                centred = (np.frombuffer(raw, dtype=np.uint8) ^ np.uint8(128)).view(np.int8)  # c - 128, exactly
                codes[head, : len(used[head]), :n] = centred.reshape(len(used[head]), n)
    basis, step = basis.float(), step.float()
    shift = torch.where(bits > 0, offset.float(), torch.zeros_like(step))  # (H, D)
    bias = torch.baddbmm(mean.float()[:, :, None], basis, shift[:, :, None])  # (H, D, 1)
    columns = torch.from_numpy(index)  # (H, width); padding points at component 0 with a zero code
    weight = basis.gather(2, columns[:, None, :].expand(h, basis.shape[1], width)) * step.gather(1, columns)[:, None]
    return torch.baddbmm(bias.transpose(1, 2), torch.from_numpy(codes).transpose(1, 2), weight.transpose(1, 2))


# ------------------------------------------------------------------------------------------------ stores

MODEL_BLOB_PREFIX = "kvbasis-model-"  # store blob naming the basis a store codes one model's entries with
_STORE_BASES: weakref.WeakKeyDictionary[Any, dict[str, KVBasis]] = weakref.WeakKeyDictionary()


def model_blob_key(model_id: str) -> str:
    return MODEL_BLOB_PREFIX + hashlib.sha256(model_id.encode()).hexdigest()[:40]


def store_basis(store: Any, model_id: str) -> KVBasis | None:
    """The basis ``store`` codes ``model_id``'s entries with (named by its ``kvbasis-model-`` blob), or None: every
    writer on one store (kvforge's engine, a vLLM connector, another process) then codes with the same basis."""
    cached = _STORE_BASES.get(store, {}).get(model_id) if _weak(store) else None
    if cached is not None:
        return cached
    data = store.get_blob(model_blob_key(model_id))
    if data is None or len(data) > 4096:
        return None
    try:
        fields = json.loads(data)
        digest = str(fields["digest"])
        if fields.get("model_id") != model_id or not re.fullmatch(r"[0-9a-f]{16,64}", digest):
            return None
        basis = BOOK.by_digest(digest, fetch=store.get_blob)
    except (ValueError, KeyError, TypeError, CorruptSegmentError) as exc:
        logger.warning("the store's KV basis pointer for %s is unusable (%s); ignored", model_id, exc)
        return None
    if basis is not None and _weak(store):
        _STORE_BASES.setdefault(store, {})[model_id] = basis
    return basis


def publish_basis(store: Any, basis: KVBasis) -> None:
    """Write ``basis`` into ``store`` and make it the one its writers code ``basis.model_id``'s entries with."""
    key = BLOB_PREFIX + basis.digest
    if store.get_blob(key) is None:
        store.put_blob(key, basis.to_bytes())
    pointer = {"model_id": basis.model_id, "digest": basis.digest}
    store.put_blob(model_blob_key(basis.model_id), json.dumps(pointer, sort_keys=True).encode())
    if _weak(store):
        _STORE_BASES.setdefault(store, {})[basis.model_id] = basis


def _weak(store: Any) -> bool:
    try:
        weakref.ref(store)
    except TypeError:
        return False
    return True


def basis_for_put(store: Any, segment: Any, quant: str | None) -> KVBasis | None:
    """For a store about to write ``segment`` under ``quant``: the basis to code it with (None unless ``quant`` is a
    kvtc name): the one the store names for the model, else this process's (calibrated, saved or fitted on this
    segment), which is then written into the store and named for the model, so any process reading the store can
    decode it and every process writing it codes alike."""
    if not quant or parse_transform(str(quant)) is None:
        return None
    basis = store_basis(store, segment.model_id)
    if basis is not None:
        return basis
    basis = BOOK.for_model(segment.model_id, sample=segment)
    publish_basis(store, basis)
    return basis
