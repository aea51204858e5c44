"""Plain values that travel between the stages: a stored KV segment, what reuse did, and a generation result."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class KVSegment:
    """The KV cache of one token sequence, detached from any model: what the store saves and reuse loads.

    Per layer ``l``: ``keys[l]``/``values[l]`` are ``(H_kv, S_l, D)`` post-RoPE tensors, ``positions[l]`` the
    ``(H_kv, S_l)`` int64 RoPE position of every entry and ``valid[l]`` an optional ``(H_kv, S_l)`` bool mask
    (False = padding of a head-wise compressed layer). ``S_l`` may differ per layer (PyramidKV) and, through
    ``valid``, per head (AdaKV).

    Args:
        token_ids: the tokens whose KV this is (before any compression).
        keys, values, positions, valid: per-layer tensors, see above.
        next_position: position of the next token to process (= number of tokens processed).
        model_id: :func:`kvforge.model.model_fingerprint` of the model that made it.
        meta: free-form JSON-able facts (press applied, quantisation, ...).
    """

    token_ids: list[int]
    keys: list[Tensor]
    values: list[Tensor]
    positions: list[Tensor]
    valid: list[Tensor | None]
    next_position: int
    model_id: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.keys)
        if not (len(self.values) == len(self.positions) == len(self.valid) == n):
            raise ValueError("keys, values, positions and valid must have one entry per layer")
        for i, (k, v, p, m) in enumerate(zip(self.keys, self.values, self.positions, self.valid, strict=True)):
            if k.dim() != 3 or k.shape != (*v.shape[:2], k.shape[2]) or k.shape[:2] != v.shape[:2]:
                raise ValueError(f"layer {i}: keys {tuple(k.shape)} / values {tuple(v.shape)} must be (H_kv, S, D)")
            if tuple(p.shape) != tuple(k.shape[:2]):
                raise ValueError(f"layer {i}: positions {tuple(p.shape)} must be {tuple(k.shape[:2])}")
            if m is not None and tuple(m.shape) != tuple(k.shape[:2]):
                raise ValueError(f"layer {i}: valid {tuple(m.shape)} must be {tuple(k.shape[:2])}")

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        """Number of tokens the segment covers (before compression)."""
        return len(self.token_ids)

    def num_entries(self) -> int:
        """KV entries actually held (valid ones), summed over layers and heads."""
        total = 0
        for k, m in zip(self.keys, self.valid, strict=True):
            total += int(m.sum()) if m is not None else k.shape[0] * k.shape[1]
        return total

    def nbytes(self) -> int:
        """Bytes of the key/value tensors held (padding included)."""
        pairs = zip(self.keys, self.values, strict=True)
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in pairs)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> KVSegment:
        """A copy on another device and/or dtype (positions and masks keep theirs)."""
        return KVSegment(
            token_ids=list(self.token_ids),
            keys=[k.to(device=device, dtype=dtype) for k in self.keys],
            values=[v.to(device=device, dtype=dtype) for v in self.values],
            positions=[p.to(device=device) for p in self.positions],
            valid=[None if m is None else m.to(device=device) for m in self.valid],
            next_position=self.next_position,
            model_id=self.model_id,
            meta=dict(self.meta),
        )


@dataclass(frozen=True)
class DocumentFacts:
    """A stored document that document reuse loaded (:class:`kvforge.reuse.document.DocumentReuse`)."""

    compressed: bool  # stored compressed by a press
    press: str | None
    compression_ratio: float | None
    quant: str  # its storage code ("none": full precision)
    kept_entries: int
    bytes_loaded: int | None
    load_s: float


@dataclass(frozen=True)
class ChunkFacts:
    """What RAG chunk reuse did: its method and ratio, chunks found stored (hits) or computed now (misses)."""

    method: str
    recompute_ratio: float
    chunks: int
    chunk_hits: int
    chunk_misses: int
    recomputed_tokens: int = 0  # stored tokens run again
    fresh_tokens: int = 0  # tokens with no stored KV (separators, the question)


@dataclass(frozen=True)
class ReuseFacts:
    """What reuse did for one prompt: made by the strategy's plan (:meth:`kvforge.reuse.base.ReusePlan.facts`),
    completed by the engine (``plan_s``, what recording kept), read by the server, the CLI and the evaluation.

    A cache built on reuse carries the facts of its plan too (``KVCache.reuse``): what it holds is approximate or
    reused up to some token.
    """

    kind: str = "miss"  # "miss" | "prefix" | "semantic" | "chunks" | "given"
    reused_tokens: int = 0
    approximate: bool = False  # the model does not see exactly the prompt asked (a semantic donor)
    similarity: float | None = None
    donor_prompt: str | None = None
    reason: str | None = None  # why a miss
    document_key: str | None = None  # the document looked up (document reuse)
    document: DocumentFacts | None = None
    chunks: ChunkFacts | None = None
    details: Mapping[str, str | int | float | bool] = field(default_factory=dict)  # reported only (blocks, load_s)
    plan_s: float | None = None
    record_s: float | None = None
    stored_writes: int | None = None
    lost_writes: int | None = None  # entries the store did not keep

    def as_dict(self) -> dict[str, Any]:
        """The facts as one flat JSON object (result rows, logs)."""
        out: dict[str, Any] = {"kind": self.kind, "reused_tokens": self.reused_tokens, "approximate": self.approximate}
        if self.similarity is not None:
            out["similarity"] = round(float(self.similarity), 4)
        for name in ("donor_prompt", "reason", "document_key"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out |= dict(self.details)
        for part in (self.document, self.chunks):
            out |= {k: v for k, v in asdict(part).items() if v is not None} if part is not None else {}
        for name in ("plan_s", "record_s", "stored_writes", "lost_writes"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


@dataclass
class Generation:
    """What one generate call produced, and what it cost."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    finish_reason: str = "length"  # "length" | "stop" (EOS or stop string)
    reused_tokens: int = 0
    cache_bytes: int = 0
    reuse: ReuseFacts | None = None  # None: no reuse strategy ran
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput (tokens after the first over the decode time)."""
        n = max(len(self.token_ids) - 1, 0)
        return n / self.decode_s if self.decode_s > 0 and n else 0.0
