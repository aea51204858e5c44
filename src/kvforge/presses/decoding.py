"""Decoding-time compression: keep a cache within a token budget while it generates (kvpress's DecodingPress idea).

A prompt press compresses the prompt once; a long answer then grows the cache without bound. :class:`DecodingPress`
is a policy the :class:`~kvforge.cache.KVCache` itself applies, so it works in whatever loop runs the forwards
(kvforge's engine, a batched server step, ``model.generate`` inside ``kvforge.hf.attach``): while attention runs,
the policy keeps, per entry, the largest attention it has received from recent queries (:meth:`BudgetPolicy.observe`,
called by kvforge's attention: every query of a decoding step, the last ``window`` queries of a prefill chunk; the
running score decays by ``decay`` per observed forward, so an entry must keep being looked at); when a forward ends
and a layer holds ``budget + interval`` entries or more in some KV head, every head of it is cut back to its
``budget`` best entries (:meth:`BudgetPolicy.after_forward`), the first ``num_sink`` positions and the ``recent``
newest entries always kept. So a layer never holds more than ``budget + interval - 1`` entries between forwards and
``budget + interval - 1 + step`` during one (``step`` = tokens of that forward: 1 while decoding).

Layers with a native sliding window are left alone (already bounded). Entries that attention never saw (the model's
own attention, outside kvforge) rank by recency. kvforge's extra forwards inside a press (KVzip's replay, lookahead
drafts) run with the policy paused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class DecodingPress:
    """Keep every layer's KV heads within ``budget`` entries while generating (a cache policy, see module doc).

    Args:
        budget: entries per KV head a layer is cut back to.
        interval: extra entries a head may hold before the layer is cut (compress every ``interval`` decoding steps;
            1 = every step).
        num_sink: first positions always kept (attention sinks).
        recent: newest entries always kept (they have had no later queries to score them yet); default
            ``min(32, budget // 4)``.
        window: queries of a prefill chunk whose attention is observed (the chunk's last ones).
        decay: running-score decay per observed forward (1 = max over every query so far).
    """

    budget: int = 1024
    interval: int = 16
    num_sink: int = 4
    recent: int | None = None
    window: int = 16
    decay: float = 0.9

    def __post_init__(self) -> None:
        if self.budget < 1 or self.interval < 1 or self.window < 1:
            raise ValueError("budget, interval and window must be >= 1")
        if self.recent is None:
            self.recent = min(32, self.budget // 4)
        if self.num_sink < 0 or self.recent < 0 or self.num_sink + self.recent >= self.budget:
            raise ValueError(f"num_sink ({self.num_sink}) + recent ({self.recent}) must be >= 0 and < budget")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    @property
    def name(self) -> str:
        return "decoding"

    def config(self) -> dict[str, object]:
        return {"type": type(self).__name__, **{k: getattr(self, k) for k in self.__dataclass_fields__}}

    def attach(self, cache: Any) -> BudgetPolicy:
        """Make ``cache`` apply this press from its next forward on; returns the policy (``cache.policy``)."""
        policy = BudgetPolicy(self, cache.num_layers)
        cache.policy = policy
        return policy


@dataclass
class BudgetPolicy:
    """The per-cache state of a :class:`DecodingPress`: running attention scores per layer, aligned with its slots."""

    press: DecodingPress
    num_layers: int
    scores: list[Tensor | None] = field(default_factory=list)
    paused: int = 0
    num_compressions: int = 0
    max_held: int = 0  # the most entries any layer's head held at the end of a forward, before being cut

    def __post_init__(self) -> None:
        self.scores = [None] * self.num_layers

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Forwards inside the block neither feed scores nor trigger compression (a press's replay or drafts)."""
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    # ------------------------------------------------------------------------------------------ observe
    def observe(
        self, layer: Any, layer_idx: int, query: Tensor, key: Tensor, mask: Tensor | None, scaling: float | None,
        is_causal: bool,
    ) -> None:  # fmt: skip
        """Fold the attention of this forward's last queries (``query`` ``(B, H, Q, D)``, ``key`` ``(B, H_kv, K, D)``,
        ``mask`` ``(B, 1 or H_kv, Q, K)`` or None, lower-right causal when ``is_causal``) into the layer's scores."""
        if self.paused or layer.window is not None:
            return
        b, h, q, d = query.shape
        h_kv, k_len = key.shape[1], key.shape[2]
        w = min(q, self.press.window)
        scale = scaling if scaling is not None else d**-0.5
        grouped = query[:, :, -w:].reshape(b, h_kv, (h // h_kv) * w, d)
        logits = (grouped @ key.transpose(-1, -2)).float().mul_(scale).view(b, h_kv, h // h_kv, w, k_len)
        if mask is not None:
            sub = mask[..., -w:, :]
            logits.masked_fill_(~sub.view(b, sub.shape[1], 1, w, k_len), float("-inf"))
        elif is_causal and q > 1:
            causal = torch.ones(w, k_len, dtype=torch.bool, device=key.device).tril(k_len - w)
            logits.masked_fill_(~causal, float("-inf"))
        got = logits.softmax(dim=-1).nan_to_num_(0.0).amax(dim=(2, 3))  # (B, H_kv, K)
        held = self._aligned(layer_idx, k_len, got.device)
        self.scores[layer_idx] = torch.maximum(held.mul_(self.press.decay), got)

    def _aligned(self, layer_idx: int, length: int, device: Any) -> Tensor:
        """The layer's scores for its ``length`` slots: new slots score 0; a cache changed behind the policy's back
        (a press installed, a snapshot restored) starts again from 0."""
        held = self.scores[layer_idx]
        if held is None or held.shape[-1] > length:
            return torch.zeros(1, 1, length, device=device)
        extra = length - held.shape[-1]
        return torch.nn.functional.pad(held, (0, extra)) if extra else held

    # ------------------------------------------------------------------------------------------ compress
    def after_forward(self, cache: Any) -> None:
        """Cut every layer that holds ``budget + interval`` entries or more in a head back to ``budget`` per head."""
        if self.paused:
            return
        limit = self.press.budget + self.press.interval
        for idx, layer in enumerate(cache.layers):
            if layer.window is not None or layer.keys is None:
                continue
            counts = layer.valid[:, :, : layer.length].sum(-1) if layer.valid is not None else None
            most = int(counts.max()) if counts is not None else layer.length
            self.max_held = max(self.max_held, most)
            if most >= limit:
                self._cut(idx, layer)

    @torch.inference_mode()
    def _cut(self, idx: int, layer: Any) -> None:
        keys, _, positions, valid = layer.view()
        b, h_kv, s = positions.shape
        score = self._aligned(idx, s, keys.device).float().expand(b, h_kv, s).clone()
        newest = positions.masked_fill(~valid, -1) if valid is not None else positions
        rank = newest.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # 0 = newest of the head
        score = torch.where(positions < self.press.num_sink, math.inf, score)
        score = torch.where(rank < (self.press.recent or 0), math.inf, score)
        if valid is not None:
            score = score.masked_fill(~valid, -math.inf)
        keep = torch.zeros_like(positions, dtype=torch.bool)
        top = score.topk(min(self.press.budget, s), dim=-1).indices
        keep.scatter_(-1, top, True)
        if valid is not None:
            keep &= valid
        order = keep.to(torch.int8).argsort(dim=-1, descending=True, stable=True)  # kept slots first, in order
        kept_scores = self._aligned(idx, s, keys.device).expand(b, h_kv, s).gather(-1, order)
        layer.keep(keep)
        self.scores[idx] = kept_scores[..., : layer.length].clone()
        self.num_compressions += 1


@contextmanager
def paused(cache: Any) -> Iterator[None]:
    """Pause ``cache``'s decoding policy, if it has one, for the block."""
    policy = getattr(cache, "policy", None)
    if policy is None:
        yield
        return
    with policy.pause():
        yield


def attach(press: DecodingPress | None, cache: Any) -> None:
    """Attach ``press`` to ``cache`` unless it is None or the cache already applies a policy."""
    if press is not None and getattr(cache, "policy", None) is None:
        press.attach(cache)
