"""KVCache: per-layer keys/values in buffers grown in blocks, with positions, per-head validity and sliding windows.

The cache is a ``transformers.Cache``: kvforge's own forwards (:mod:`kvforge.prefill`) announce their positions and
run :mod:`kvforge.attention`, which
builds each layer's mask from the positions held here. That is what lets layers hold different lengths
(PyramidKV), heads hold different entries (AdaKV, padded and masked), entries sit at arbitrary positions (RAG
chunks re-rotated, selective recomputation) and the cache be shortened (compression, sliding window) while decoding
keeps the true RoPE positions: the next position is the number of tokens processed, not the cache length.

``model.generate(past_key_values=cache)`` outside kvforge calls runs the model's own attention with transformers'
masks: exact whenever those masks can describe the cache (every layer of a kind holds as many entries, no head-wise
padding, no sinks; compressed entries are fine: they all precede the new tokens), a clear error otherwise; inside
``with kvforge.hf.attach(model):`` (or ``with press(model):``) every forward on a KVCache is kvforge's, any cache.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from kvforge.compat import Cache, dynamic_cache, dynamic_cache_layers
from kvforge.types import KVSegment, ReuseFacts

DEFAULT_BLOCK_SIZE = 256


class KVLayer:
    """One layer's cache: ``keys``/``values`` ``(B, H_kv, capacity, D)``, ``positions`` ``(B, H_kv, capacity)``.

    Only the first ``length`` slots are in use. ``valid`` (same shape as positions) is None while every slot is a
    real entry; head-wise compression packs heads to the longest one and marks the padding False.

    Args:
        window: keep only entries within ``window`` positions of the newest query (plus sinks); None = keep all.
        num_sink: with a window, entries at positions < num_sink are always kept (attention sinks).
        block_size: buffers grow by whole blocks, so decoding reallocates once per block at most (never per token).
    """

    def __init__(self, window: int | None = None, num_sink: int = 0, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if num_sink < 0:
            raise ValueError(f"num_sink must be >= 0, got {num_sink}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.window = window
        self.num_sink = num_sink
        self.block_size = block_size
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.positions: Tensor | None = None
        self.valid: Tensor | None = None
        self.length = 0
        self.is_headwise = False  # True when heads hold different positions (then masks are built per head)
        # entries 0..length-1 hold positions run_start, run_start+1, ... in every row and head (None: not known to):
        # then a forward whose queries come right after them attends plain causally (no mask, the causal kernels)
        self.run_start: int | None = None
        self.num_new = 0  # entries appended by the current forward (they attend causally among themselves)
        self.num_reallocations = 0
        # a forward writing into reserved slots sees only the first num_visible entries (None: all of them)
        self.num_visible: int | None = None
        # the slots that forward's queries were written to, when the layer is in position order (else None)
        self.query_slots: Tensor | None = None

    # ----------------------------------------------------------------------------------------------- storage
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _allocate(self, like_keys: Tensor, like_values: Tensor, capacity: int) -> None:
        b, h = like_keys.shape[:2]
        keys = like_keys.new_empty((b, h, capacity, like_keys.shape[3]))
        values = like_values.new_empty((b, h, capacity, like_values.shape[3]))
        positions = torch.empty((b, h, capacity), dtype=torch.long, device=like_keys.device)
        valid = None if self.valid is None else torch.zeros((b, h, capacity), dtype=torch.bool, device=keys.device)
        if self.length:
            assert self.keys is not None and self.values is not None and self.positions is not None
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
            positions[:, :, : self.length] = self.positions[:, :, : self.length]
            if valid is not None and self.valid is not None:
                valid[:, :, : self.length] = self.valid[:, :, : self.length]
            self.num_reallocations += 1
        self.keys, self.values, self.positions, self.valid = keys, values, positions, valid

    def reserve(self, num_tokens: int, like_keys: Tensor, like_values: Tensor) -> None:
        """Make room for ``num_tokens`` entries in total (rounded up to whole blocks)."""
        if num_tokens > self.capacity:
            self._allocate(like_keys, like_values, math.ceil(num_tokens / self.block_size) * self.block_size)

    def append(
        self,
        keys: Tensor,
        values: Tensor,
        positions: Tensor,
        first_position: int | None = None,
        contiguous: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """Write new entries after the used slots; returns views of all entries (for attention).

        Args:
            keys, values: ``(B, H_kv, S, D)``.
            positions: ``(B, S)`` positions of the new tokens (shared by all heads).
            first_position: ``positions.min()`` if the caller knows it (saves a device sync per layer).
            contiguous: the caller knows ``positions`` is ``first_position + arange(S)`` in every row (keeps the
                layer on the plain causal path when it continues a contiguous run).
        """
        if first_position is None:
            first_position = int(positions.min())
        if self.window is not None:
            self._drop_outside_window(first_position)
        self.run_start = self._next_run_start(first_position, contiguous)
        s = keys.shape[2]
        if self.keys is not None and (self.keys.dtype != keys.dtype or self.keys.shape[:2] != keys.shape[:2]):
            raise ValueError(
                f"cache holds {tuple(self.keys.shape[:2])} {self.keys.dtype} entries, got {tuple(keys.shape[:2])} "
                f"{keys.dtype}"
            )
        self.reserve(self.length + s, keys, values)
        assert self.keys is not None and self.values is not None and self.positions is not None
        end = self.length + s
        self.keys[:, :, self.length : end] = keys
        self.values[:, :, self.length : end] = values
        self.positions[:, :, self.length : end] = positions[:, None, :]
        if self.valid is not None:
            self.valid[:, :, self.length : end] = True
        self.length = end
        self.num_new = s
        return self.keys[:, :, :end], self.values[:, :, :end]

    def write(self, keys: Tensor, values: Tensor, positions: Tensor, slots: Tensor, num_visible: int | None
              ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Write new entries into reserved ``slots`` ``(S,)`` (indices of used slots) instead of appending; returns
        views of the first ``num_visible`` entries (None: all) for attention, which this forward alone then sees.

        RAG recomputation: the cache holds every prompt token in prompt order, the ones to run as placeholders at
        :data:`HIDDEN` (masked), so no entry moves and a query chunk attends to a prefix of the layer.
        """
        if self.keys is None or self.values is None or self.positions is None:
            raise ValueError("no reserved slots to write into")
        self.keys.index_copy_(2, slots, keys)
        self.values.index_copy_(2, slots, values)
        self.positions[:, :, slots] = positions[:, None, :]
        self.num_new, self.run_start = 0, None
        self.num_visible = num_visible
        self.query_slots = slots if num_visible is not None else None
        n = self.length if num_visible is None else num_visible
        return self.keys[:, :, :n], self.values[:, :, :n]

    def written(self) -> None:
        """Every reserved slot is written: a layer whose entries are one run of positions attends plain causally."""
        self.run_start = _run_start(self.view()[2]) if self.valid is None and self.length else None

    def _next_run_start(self, first_position: int, contiguous: bool) -> int | None:
        """``run_start`` after appending a contiguous block (or not) that starts at ``first_position``."""
        if not contiguous or self.valid is not None:
            return None
        if self.length == 0:
            return first_position
        if self.run_start is not None and self.run_start + self.length == first_position:
            return self.run_start
        return None

    def _drop_outside_window(self, first_new_position: int) -> None:
        """Compact away entries no future query can see; done once a block of them has built up (amortised)."""
        if self.window is None or self.length <= self.num_sink + self.window + self.block_size:
            return
        assert self.positions is not None
        pos = self.positions[:, :, : self.length]
        keep = (pos > first_new_position - self.window) | (pos < self.num_sink)
        if self.valid is not None:
            keep &= self.valid[:, :, : self.length]
        self._keep(keep)

    def keep(self, keep: Tensor) -> None:
        """Keep the entries where ``keep`` ``(B, H_kv, length)`` is True, in order, packed to the front (heads that
        keep different counts are padded to the longest, the padding masked)."""
        self._keep(keep)

    def _keep(self, keep: Tensor) -> None:
        """Keep the entries where ``keep`` ``(B, H_kv, length)`` is True, in order, packed to the front."""
        assert self.keys is not None and self.values is not None and self.positions is not None
        counts = keep.sum(-1)
        if bool((counts == counts.flatten()[0]).all()):
            n = int(counts.flatten()[0])
            idx = keep.float().argsort(dim=-1, descending=True, stable=True)[..., :n]  # kept indices, in order
            idx, _ = idx.sort(dim=-1)
            self.replace(
                self.keys[:, :, : self.length].gather(2, idx[..., None].expand(-1, -1, -1, self.keys.shape[3])),
                self.values[:, :, : self.length].gather(2, idx[..., None].expand(-1, -1, -1, self.values.shape[3])),
                self.positions[:, :, : self.length].gather(2, idx),
                None if self.valid is None else self.valid[:, :, : self.length].gather(2, idx),
            )
        else:
            self.replace_masked(
                self.keys[:, :, : self.length],
                self.values[:, :, : self.length],
                self.positions[:, :, : self.length],
                keep,
            )

    # ----------------------------------------------------------------------------------------------- editing
    def replace(self, keys: Tensor, values: Tensor, positions: Tensor, valid: Tensor | None = None) -> None:
        """Replace the whole content, e.g. by a compressed selection.

        Args:
            keys, values: ``(B, H_kv, S', D)``.
            positions: ``(B, H_kv, S')`` or ``(B, S')`` int64.
            valid: optional ``(B, H_kv, S')`` bool; False marks padding of a head-wise selection.
        """
        self.replace_parts([keys], [values], [positions], valid)

    def replace_parts(
        self, keys: Sequence[Tensor], values: Sequence[Tensor], positions: Sequence[Tensor], valid: Tensor | None = None
    ) -> None:
        """:meth:`replace` with the content given in parts along the sequence (stored blocks, in order): each part is
        copied once, into the new buffer, instead of joined first and copied again."""
        b, h, _, d = keys[0].shape
        s = sum(k.shape[2] for k in keys)
        positions = [p[:, None, :].expand(b, h, p.shape[-1]) if p.dim() == 2 else p for p in positions]
        for k, v, p in zip(keys, values, positions, strict=True):
            if (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d):
                raise ValueError(f"key parts {tuple(k.shape)} and {tuple(keys[0].shape)} differ beyond their length")
            if tuple(p.shape) != tuple(k.shape[:3]):
                raise ValueError(f"positions must be {tuple(k.shape[:3])}, got {tuple(p.shape)}")
            if v.shape[:3] != k.shape[:3]:
                raise ValueError(f"values {tuple(v.shape)} do not match keys {tuple(k.shape)}")
        if valid is not None and tuple(valid.shape) != (b, h, s):
            raise ValueError(f"positions/valid must be {(b, h, s)}, got {tuple(valid.shape)}")
        if valid is not None and bool(valid.all()):
            valid = None
        capacity = max(self.capacity, math.ceil(max(s, 1) / self.block_size) * self.block_size)
        new_keys = keys[0].new_empty((b, h, capacity, d))
        new_values = values[0].new_empty((b, h, capacity, values[0].shape[3]))
        new_positions = torch.empty((b, h, capacity), dtype=torch.long, device=keys[0].device)
        start = 0
        for k, v, p in zip(keys, values, positions, strict=True):
            end = start + k.shape[2]
            new_keys[:, :, start:end] = k
            new_values[:, :, start:end] = v
            new_positions[:, :, start:end] = p
            start = end
        self.keys, self.values, self.positions = new_keys, new_values, new_positions
        if valid is None:
            self.valid = None
        else:
            self.valid = torch.zeros((b, h, capacity), dtype=torch.bool, device=keys[0].device)
            self.valid[:, :, :s] = valid
        self.length = s
        self.num_new = 0
        held = new_positions[:, :, :s]
        self.is_headwise = bool(h > 1 and not (held == held[:, :1]).all()) or valid is not None
        self.run_start = None if self.valid is not None else _run_start(held)

    def replace_masked(self, keys: Tensor, values: Tensor, positions: Tensor, keep: Tensor) -> None:
        """Keep a different set of entries per head: pack each head's kept entries to the front, pad to the longest.

        Memory held is ``max_h kept_h`` entries per head, not the full length (kvpress only masks).
        """
        b, h, s, d = keys.shape
        if positions.dim() == 2:
            positions = positions[:, None, :].expand(b, h, s)
        counts = keep.sum(-1)  # (B, H_kv)
        width = int(counts.max()) if counts.numel() else 0
        order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)[..., :width]  # kept first, in position order
        slot = torch.arange(width, device=keys.device)
        valid = slot[None, None, :] < counts[..., None]
        # padding slots hold zeros (keys, values and positions): they are masked, and a stored head-wise layer is
        # written without them (its bytes then read back equal to this cache's)
        self.replace(
            keys.gather(2, order[..., None].expand(-1, -1, -1, d)).masked_fill_(~valid[..., None], 0),
            values.gather(2, order[..., None].expand(-1, -1, -1, values.shape[3])).masked_fill_(~valid[..., None], 0),
            positions.gather(2, order).masked_fill_(~valid, 0),
            valid,
        )

    def clear(self) -> None:
        self.keys = self.values = self.positions = self.valid = None
        self.length = 0
        self.num_new = 0
        self.is_headwise = False
        self.run_start = None

    # ----------------------------------------------------------------------------------------------- reading
    def view(self) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``(keys, values, positions, valid)`` of the used slots (views, no copy)."""
        if self.keys is None or self.values is None or self.positions is None:
            raise ValueError("empty cache layer")
        n = self.length if self.num_visible is None else self.num_visible
        valid = None if self.valid is None else self.valid[:, :, :n]
        return self.keys[:, :, :n], self.values[:, :, :n], self.positions[:, :, :n], valid

    def visible_positions(self, query_position: int, batch: int = 0, head: int = 0) -> list[int]:
        """Positions a query at ``query_position`` attends to (after window and validity), for one head."""
        if self.positions is None:
            return []
        pos = self.positions[batch, head, : self.length]
        ok = pos <= query_position
        if self.valid is not None:
            ok &= self.valid[batch, head, : self.length]
        if self.window is not None:
            ok &= (query_position - pos < self.window) | (pos < self.num_sink)
        return pos[ok].tolist()

    def num_entries(self) -> int:
        """Valid entries held, summed over batch and heads."""
        if self.keys is None:
            return 0
        if self.valid is not None:
            return int(self.valid[:, :, : self.length].sum())
        return self.keys.shape[0] * self.keys.shape[1] * self.length

    def nbytes(self) -> int:
        """Bytes of the used key/value slots (padding of head-wise layers included: it is really held)."""
        if self.keys is None or self.values is None:
            return 0
        per_slot = (
            self.keys.shape[0]
            * self.keys.shape[1]
            * (self.keys.shape[3] * self.keys.element_size() + self.values.shape[3] * self.values.element_size())
        )
        return per_slot * self.length

    def attention_mask(
        self, query_positions: Tensor, num_query_heads: int | None = None, span: slice | None = None
    ) -> Tensor | None:
        """Boolean mask ``(B, 1 or H_kv, Q, K)`` for this layer's entries, or None when every entry is visible.

        An entry is visible to a query when its position is <= the query's, it is valid, and (with a window) it is
        within ``window`` positions or a sink. The mask is per KV head (a GQA group shares it);
        ``num_query_heads`` given, a head-wise mask is repeated to ``(B, H, Q, K)`` (for code that wants that);
        ``span`` given, the mask covers only those entries (K = their count).
        """
        _, _, pos, valid = self.view()
        if span is not None:
            pos, valid = pos[..., span], None if valid is None else valid[..., span]
        q = query_positions  # (B, Q)
        if self.num_new == q.shape[1] and self.num_new == 1 and valid is None and self.window is None:
            return None  # one decoding query sees every entry
        k_pos = pos[:, :1, :] if not self.is_headwise and valid is None else pos  # (B, 1 or H_kv, K)
        allowed = k_pos[:, :, None, :] <= q[:, None, :, None]  # (B, h, Q, K)
        if self.window is not None:
            near = (q[:, None, :, None] - k_pos[:, :, None, :]) < self.window
            allowed &= near | (k_pos[:, :, None, :] < self.num_sink)
        if valid is not None:
            allowed &= valid[:, :, None, :]
        if num_query_heads is not None and 1 < allowed.shape[1] != num_query_heads:
            allowed = allowed.repeat_interleave(num_query_heads // allowed.shape[1], dim=1)
        return allowed

    def window_query_slots(self) -> Tensor | None:
        """The slots ``(Q,)`` of this forward's queries (ascending) when this is a sliding-window layer written
        through reserved slots in position order, with no sinks, validity mask or head-wise entries, else None: a
        query then sees at most the ``window`` entries up to its own slot (when the cache's positions are strictly
        increasing, :attr:`Reserved.strict`, which the caller checks)."""
        if self.query_slots is None or self.window is None or self.num_sink or self.valid is not None:
            return None
        return None if self.is_headwise else self.query_slots

    def sorted_query_slots(self) -> Tensor | None:
        """The slots ``(Q,)`` this forward's queries were written to when every query sees exactly the entries up to
        its own slot (a reserved write into a layer in position order, no window, no validity mask), else None."""
        if self.query_slots is None or self.valid is not None or self.window is not None or self.is_headwise:
            return None
        return self.query_slots

    def is_plain_causal(self, query_positions: Tensor) -> bool:
        """True when this forward's queries are the last entries and see every earlier one: plain causal attention
        with the queries as the last rows (lower-right), no mask needed.

        Either the queries are the only entries (a first chunk), or the entries are one contiguous run of positions
        that the queries continue (a later chunk of a plain cache, a prefix reused from a store) and no window
        hides any of them.
        """
        if self.valid is not None or self.num_new != query_positions.shape[1]:
            return False
        if self.length == self.num_new and self.window is None:
            return True
        return self.run_start is not None and (self.window is None or self.length <= self.window)


HIDDEN = 2**62  # the position of a reserved slot not written yet: after every query, so never attended to


@dataclass
class Reserved:
    """Slots of a cache reserved for the tokens a RAG plan runs (:func:`kvforge.prefill.prefill_at` fills them).

    ``slots`` ``(S,)``: entry indices, in the order the tokens run; ``positions`` ``(S,)``: their positions.
    ``in_order``: every layer's entries are in position order, so a query chunk needs only a prefix of them.
    ``strict``: in strictly increasing order (one entry per position), so an entry ``window`` or more slots before a
    query's is ``window`` or more positions before it: a sliding-window layer's query needs only a band of them.
    """

    slots: Tensor
    positions: Tensor
    in_order: bool
    strict: bool = False


def _cut(k: Tensor, v: Tensor, p: Tensor, end: int, headwise: bool) -> tuple[Tensor, Tensor, Tensor]:
    """A segment's entries ``(H_kv, S, D)`` at positions ``< end``: a slice when they lead, else a gather."""
    keep = p[0] < end  # (S,)
    count = int(keep.sum())
    if count == keep.numel():
        return k, v, p
    if headwise:
        raise ValueError("a head-wise compressed segment cannot be cut")
    if bool(keep[:count].all()):  # positions ascending: a slice, no gather copy
        return k[:, :count], v[:, :count], p[:, :count]
    return k[:, keep], v[:, keep], p[:, keep]


def _run_start(positions: Tensor) -> int | None:
    """``p0`` when ``positions`` ``(B, H, S)`` is ``p0, p0 + 1, ...`` in every row and head, else None."""
    s = positions.shape[-1]
    if s == 0:
        return None
    p0 = int(positions.flatten()[0])
    run = torch.arange(p0, p0 + s, device=positions.device)
    return p0 if bool((positions == run).all()) else None


class KVReady(Exception):
    """Raised by :meth:`KVCache.update` once layer ``KVCache.stop_after`` is written: the forward in flight needed only
    the entries up to that layer (CacheBlend's check pass), so that layer's attention and everything after it are
    skipped. :func:`kvforge.prefill.forward` ends the forward normally on it."""


class AttentionHook(Protocol):
    """A declared way to change attention for one cache (RAG: APE's merge, auxiliary-model score capture).

    :func:`kvforge.attention.kvforge_attention` calls it, with the mask it built from the cache positions, instead of
    its own softmax; it returns the attention output ``(B, Q, H, D)``. Set it as ``cache.attention_hook``.
    """

    def __call__(
        self, module: Any, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, is_causal: bool,
        scaling: float | None, softcap: float | None,
    ) -> Tensor: ...  # fmt: skip


class KVCache(Cache):
    """The KV cache of one batch of sequences, all layers, plus the count of tokens processed.

    A ``transformers.Cache``: ``model.generate(input_ids, past_key_values=cache)`` continues it (``input_ids`` = every
    token, those already processed first, as with any HF cache); see the module docstring for which attention runs.

    Args:
        num_layers: decoder layers.
        layer_windows: per-layer native sliding window (Gemma3, Mistral); None entries = full attention.
        window, num_sink: an optional sliding-window cache on the full-attention layers (StreamingLLM-style): keep
            the first ``num_sink`` tokens and the last ``window`` ones, so memory stays bounded for endless generation.
            Attention sees exactly ``num_sink + window`` entries; the ones that fell out are compacted away once a
            block of them has built up, before a forward's tokens are appended, so a layer holds at most
            ``num_sink + window + block_size + s`` entries after a forward of ``s`` tokens.
        block_size: growth step of the buffers (and the sliding window's compaction slack).
    """

    def __init__(
        self,
        num_layers: int,
        *,
        layer_windows: Sequence[int | None] | None = None,
        window: int | None = None,
        num_sink: int = 0,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        if layer_windows is not None and len(layer_windows) != num_layers:
            raise ValueError(f"layer_windows has {len(layer_windows)} entries for {num_layers} layers")
        native = list(layer_windows) if layer_windows is not None else [None] * num_layers
        self.window = window
        self.num_sink = num_sink
        layers = [
            KVLayer(window=w, num_sink=0, block_size=block_size)
            if w is not None
            else KVLayer(window=window, num_sink=num_sink if window is not None else 0, block_size=block_size)
            for w in native
        ]
        super().__init__(layers=layers)  # type: ignore[arg-type]
        self.layers: list[KVLayer] = layers
        self.native_windows = native
        self.next_position = 0  # position of the next token: tokens processed so far
        self.query_positions: Tensor | None = None  # (B, Q) positions of the forward in flight
        self._first_position = 0
        self._contiguous = False  # the forward in flight has positions first, first + 1, ... in every row
        self.token_ids: list[int] = []  # tokens processed, in order (single-sequence caches)
        # reserved slots (RAG): the plan's, ``write_slots`` of the forward in flight, and how many entries it sees
        self.reserved: Reserved | None = None
        self.write_slots: Tensor | None = None
        self.num_visible: int | None = None
        self.info: dict[str, Any] = {}  # facts about how the cache was built (press), for reports
        self.reuse: ReuseFacts | None = None  # the reuse it was loaded from (kind, reused tokens, approximate)
        self.attention_hook: AttentionHook | None = None  # replaces the softmax in kvforge_attention (RAG)
        # a decoding-time budget (kvforge.presses.decoding.BudgetPolicy): sees attention, cuts layers when forwards end
        self.policy: Any = None
        self._hf_layer: int | None = None  # last layer appended by a forward of the model's own attention
        self.stop_after: int | None = None  # forwards end once this layer's entries are written (KVReady)

    @classmethod
    def for_model(cls, model: Any, **kwargs: Any) -> KVCache:
        """An empty cache shaped for ``model`` (reads its layer count and native sliding windows)."""
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        return cls(config.num_hidden_layers, layer_windows=native_layer_windows(config), **kwargs)

    # ------------------------------------------------------------------------ transformers' Cache interface
    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        """Append the new keys/values of ``layer_idx`` and return all of that layer's entries."""
        if self.query_positions is None or self._hf_layer is not None:
            return self._update_hf(key_states, value_states, layer_idx)
        if self.write_slots is not None:
            out = self.layers[layer_idx].write(
                key_states, value_states, self.query_positions, self.write_slots, self.num_visible
            )
        else:
            out = self.layers[layer_idx].append(
                key_states, value_states, self.query_positions, self._first_position, self._contiguous
            )
        if layer_idx == self.stop_after:
            raise KVReady
        return out

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens processed (NOT entries held): what models use to place the next positions."""
        return self.next_position

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for transformers' masks: the held entries read as the last ones before the
        queries (true for every held entry: all precede the next position), sliding layers at their real positions."""
        layer = self.layers[layer_idx]
        if layer.window is not None and self.query_positions is None:  # drop now: this forward's appends must not
            with torch.inference_mode():
                for other in self.layers:
                    if other.window is not None:
                        other._drop_outside_window(self.next_position)
        return layer.length + query_length, self.next_position - layer.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        """Layers with a native sliding window (transformers sizes their masks apart)."""
        return [w is not None for w in self.native_windows]

    def _unsupported(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "KVCache holds one sequence per row and no beam/crop bookkeeping: use greedy or sampled generate with "
            "num_beams=1 and num_return_sequences=1, or convert with cache.to_dynamic()"
        )

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported

    def hf_attention_problem(self) -> str | None:
        """Why the model's own attention (with transformers' masks) cannot run on this cache, or None when it can."""
        lengths: dict[bool, int] = {}
        for i, (layer, native) in enumerate(zip(self.layers, self.native_windows, strict=True)):
            if layer.window is not None and native is None:
                return f"a sliding-window cache (layer {i}: window {layer.window}, {layer.num_sink} sinks)"
            if layer.valid is not None:
                return f"head-wise compressed entries (layer {i}: heads hold different counts)"
            if (other := lengths.setdefault(native is not None, layer.length)) != layer.length:
                return f"layers of different lengths (layer {i} holds {layer.length}, an earlier one {other})"
            if native is not None and layer.length:
                _, _, pos, _ = layer.view()
                first = self.next_position - layer.length
                if not bool((pos == torch.arange(first, self.next_position, device=pos.device)).all()):
                    return f"re-positioned entries in sliding-window layer {i}"
        return None

    def _update_hf(self, keys: Tensor, values: Tensor, layer_idx: int) -> tuple[Tensor, Tensor]:
        """An append from a forward of the model's own attention (``model.generate(past_key_values=cache)``).

        Positions continue from ``next_position``; the forward ends with the last layer's append. Its tokens are not
        known here, so ``token_ids`` is not extended.
        """
        if self._hf_layer is not None and layer_idx <= self._hf_layer:
            self.abort()  # the previous forward stopped half-way: drop its entries
        if self.query_positions is None:
            problem = self.hf_attention_problem()
            if problem is not None:
                raise ValueError(
                    f"this KVCache holds {problem}: the model's own attention cannot mask it; run generate inside "
                    "`with kvforge.hf.attach(model):` (or `with press(model):`) so kvforge's attention reads it"
                )
            b, s = keys.shape[0], keys.shape[2]
            held = next((layer.keys.shape[0] for layer in self.layers if layer.keys is not None), b)
            if held != b:
                raise ValueError(
                    f"this KVCache holds {held} sequence(s), the forward brings {b} rows (generate with num_beams=1 "
                    "and num_return_sequences=1)"
                )
            self.begin(torch.arange(self.next_position, self.next_position + s, device=keys.device)[None].expand(b, -1))
        assert self.query_positions is not None
        self._hf_layer = layer_idx
        with torch.inference_mode():  # kvforge's buffers are inference tensors (written in place)
            out = self.layers[layer_idx].append(keys, values, self.query_positions, self._first_position)
        if layer_idx == self.num_layers - 1:
            self.next_position = self._first_position + keys.shape[2]
            self.query_positions, self._hf_layer = None, None
            for layer in self.layers:
                layer.num_new = 0
            if self.policy is not None:
                self.policy.after_forward(self)  # the returned views stay valid: a cut installs new buffers
        return out

    # ------------------------------------------------------------------------ forward bookkeeping
    def begin(self, position_ids: Tensor) -> None:
        """Announce the positions ``(B, Q)`` of the forward about to run."""
        self.query_positions = position_ids
        self._first_position = int(position_ids.min())
        self._contiguous = _is_contiguous(position_ids, self._first_position)

    def end(self, input_ids: Tensor) -> None:
        """Close the forward: advance the processed count, remember the tokens."""
        assert self.query_positions is not None
        self.next_position = int(self.query_positions.max()) + 1
        if input_ids.shape[0] == 1:
            self.token_ids.extend(input_ids[0].tolist())
        self.query_positions = None
        for layer in self.layers:
            layer.num_new = 0
            layer.num_visible = None
            layer.query_slots = None
        if self.policy is not None:
            self.policy.after_forward(self)

    def abort(self) -> None:
        """Undo a forward that failed half-way: drop what it appended (entries written into reserved slots stay:
        the RAG plan that reserved them fails as a whole)."""
        for layer in self.layers:
            layer.length -= layer.num_new
            layer.num_new = 0
            layer.num_visible = None
            layer.query_slots = None
        self.query_positions = None
        self._hf_layer = None

    def reserve(self, num_tokens: int, like: tuple[Tensor, Tensor] | None = None) -> None:
        """Preallocate room for ``num_tokens`` entries in every (non-empty) layer."""
        for layer in self.layers:
            if layer.keys is not None and layer.values is not None:
                layer.reserve(num_tokens, layer.keys, layer.values)

    # ------------------------------------------------------------------------ accounting
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def lengths(self) -> list[int]:
        return [layer.length for layer in self.layers]

    def num_entries(self) -> int:
        return sum(layer.num_entries() for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes of key/value entries held by all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    # ------------------------------------------------------------------------ segments
    def to_segment(
        self,
        model_id: str = "",
        token_ids: list[int] | None = None,
        batch: int = 0,
        *,
        start: int | None = None,
        end: int | None = None,
    ) -> KVSegment:
        """Copy this cache (one batch row) out as a :class:`KVSegment`: the one cache -> segment conversion.

        ``start``/``end``: only the entries at positions ``[start, end)`` (a prefix block, a RAG chunk after its shared
        prefix); the segment's ``next_position`` is then ``end``. Slicing needs every head of a layer to hold the same
        positions: a head-wise compressed cache raises ValueError.
        """
        sliced = start is not None or end is not None
        lo, hi = start or 0, self.next_position if end is None else end
        keys, values, positions, valid = [], [], [], []
        for layer in self.layers:
            k, v, p, m = layer.view()
            k, v, p, m = k[batch], v[batch], p[batch], None if m is None else m[batch]
            if sliced:
                if m is not None or layer.is_headwise:
                    raise ValueError("head-wise compressed caches cannot be cut into position ranges")
                sel = (p[0] >= lo) & (p[0] < hi)  # (S,) heads share positions
                k, v, p = k[:, sel], v[:, sel], p[:, sel]
            keys.append(k.clone())
            values.append(v.clone())
            positions.append(p.clone())
            valid.append(None if m is None else m.clone())
        return KVSegment(
            token_ids=list(self.token_ids if token_ids is None else token_ids),
            keys=keys,
            values=values,
            positions=positions,
            valid=valid,
            next_position=hi if sliced else self.next_position,
            model_id=model_id,
            meta={} if sliced else dict(self.info),
        )

    @classmethod
    def from_segment(cls, segment: KVSegment, model: Any = None, **kwargs: Any) -> KVCache:
        """A cache holding ``segment``'s entries (batch 1), ready to prefill more tokens on top."""
        cache = cls.from_segments([segment], model, **kwargs)
        cache.info = dict(segment.meta)
        return cache

    @classmethod
    def from_segments(
        cls,
        segments: Sequence[KVSegment],
        model: Any = None,
        *,
        end: int | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> KVCache:
        """A cache holding the entries of ``segments`` (in position order) at positions ``< end`` (default: all):
        the one segment -> cache conversion. Tokens and ``next_position`` follow the segments, cut at ``end``."""
        first = segments[0]
        if device is None and model is not None:
            device = getattr(model, "device", None)  # a cache for a model holds its entries where the model runs
        cache = cls.for_model(model, **kwargs) if model is not None else cls(first.num_layers, **kwargs)
        if cache.num_layers != first.num_layers:
            raise ValueError(f"segment has {first.num_layers} layers, model has {cache.num_layers}")
        token_ids = [t for s in segments for t in s.token_ids]
        if end is not None:  # a cut: the segments cover the prompt from position 0
            token_ids = token_ids[:end]
        end = segments[-1].next_position if end is None else end
        for i, layer in enumerate(cache.layers):
            masks = [s.valid[i] for s in segments]
            if len(segments) > 1 and any(x is not None for x in masks):
                raise ValueError("head-wise compressed segments cannot be joined")
            parts = [_cut(s.keys[i], s.values[i], s.positions[i], end, masks[0] is not None) for s in segments]
            parts = [part for part in parts if part[0].shape[1]] or parts[:1]  # blocks wholly past ``end`` drop out
            k, v, p = ([part[j][None].to(device) for part in parts] for j in range(3))
            layer.replace_parts(k, v, p, None if masks[0] is None else masks[0][None].to(device))
        cache.next_position = end
        cache.token_ids = token_ids
        return cache

    # ------------------------------------------------------------------------ transformers' DynamicCache
    def to_dynamic(self) -> Any:
        """This cache as a ``transformers.DynamicCache`` (copies), for code that expects one.

        Only an uncompressed cache converts exactly (a DynamicCache has no positions: entry i is position i of the
        last ``len`` tokens); a compressed, head-wise or re-positioned cache is refused instead of silently changing
        what the model attends to.
        """
        data = []
        for i, layer in enumerate(self.layers):
            if layer.keys is None:
                raise ValueError("empty cache: nothing to convert")
            k, v, pos, valid = layer.view()
            expected = torch.arange(self.next_position - layer.length, self.next_position, device=pos.device)
            if valid is not None or not bool((pos == expected).all()):
                raise ValueError(
                    f"layer {i} holds compressed or re-positioned entries: a DynamicCache cannot represent them "
                    "(keep the KVCache, or convert before compressing)"
                )
            data.append((k.clone(), v.clone()))
        return dynamic_cache(data)

    @classmethod
    def from_dynamic(cls, dynamic: Any, model: Any = None, **kwargs: Any) -> KVCache:
        """A KVCache holding a ``transformers.DynamicCache``'s entries (copies), positions continuing after them."""
        layers = dynamic_cache_layers(dynamic)
        cache = cls.for_model(model, **kwargs) if model is not None else cls(len(layers), **kwargs)
        if cache.num_layers != len(layers):
            raise ValueError(f"DynamicCache has {len(layers)} layers, the model has {cache.num_layers}")
        total = dynamic.get_seq_length()
        for i, (ours, (keys, values)) in enumerate(zip(cache.layers, layers, strict=True)):
            if keys is None or not isinstance(keys, Tensor) or keys.dim() != 4:
                raise ValueError(f"DynamicCache layer {i} is empty")
            total = max(total, dynamic.get_seq_length(i))
            held = keys.shape[2]
            positions = torch.arange(total - held, total, device=keys.device)[None].expand(keys.shape[0], -1)
            ours.replace(keys.clone(), values.clone(), positions)
        cache.next_position = total
        return cache


def _is_contiguous(position_ids: Tensor, first: int) -> bool:
    """True when every row of ``position_ids`` ``(B, Q)`` is ``first, first + 1, ...`` (one sync per forward)."""
    if position_ids.numel() == 1:
        return True
    run = torch.arange(first, first + position_ids.shape[1], device=position_ids.device)
    return bool((position_ids == run).all())


class CacheSnapshot:
    """Remember a cache's content so extra forwards (lookahead drafts, reconstruction) can be undone exactly.

    Appends write past ``length`` or into new buffers, never over held slots, so keeping references is enough.
    """

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.layers = [
            (layer.keys, layer.values, layer.positions, layer.valid, layer.length, layer.is_headwise, layer.run_start)
            for layer in cache.layers
        ]
        self.next_position = cache.next_position
        self.num_tokens = len(cache.token_ids)

    def restore(self) -> None:
        for layer, (k, v, p, m, n, hw, run) in zip(self.cache.layers, self.layers, strict=True):
            layer.keys, layer.values, layer.positions, layer.valid = k, v, p, m
            layer.length, layer.is_headwise, layer.num_new, layer.run_start = n, hw, 0, run
        self.cache.next_position = self.next_position
        del self.cache.token_ids[self.num_tokens :]
        self.cache.query_positions = None


def mismatch_with_model(cache: KVCache, model: Any) -> str | None:
    """Why ``cache`` cannot be this model's KV (layer count, KV heads, head dim, dtype), or None when it fits.

    Stored segments carry the model's fingerprint, but a segment written by someone who can write the store could
    still hold KV of another shape: it is checked against the model's own config before any forward uses it.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if cache.num_layers != config.num_hidden_layers:
        return f"{cache.num_layers} layers, the model has {config.num_hidden_layers}"
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    for i, layer in enumerate(cache.layers):
        if layer.keys is None or layer.values is None:
            continue
        if layer.keys.shape[1] != kv_heads or layer.values.shape[1] != kv_heads:
            return f"layer {i} holds {layer.keys.shape[1]} KV heads, the model has {kv_heads}"
        if layer.keys.shape[3] != head_dim:
            return f"layer {i} holds head dim {layer.keys.shape[3]}, the model has {head_dim}"
        if layer.keys.dtype != dtype or layer.values.dtype != dtype:
            return f"layer {i} holds {layer.keys.dtype} entries, the model runs in {dtype}"
    return None


def native_layer_windows(config: Any) -> list[int | None]:
    """Per-layer sliding window of a model config (None for full-attention layers)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return [None] * n
    if layer_types is not None:
        return [window if t == "sliding_attention" else None for t in layer_types[:n]]
    if getattr(config, "use_sliding_window", True) is False:
        return [None] * n
    return [window] * n
