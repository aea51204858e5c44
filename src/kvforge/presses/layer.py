"""What a press sees of one layer and what it decides: tensors only, no model, so the math tests alone.

A press looks at one layer's entries created by the current prefill (``LayerContext``) and returns a
:class:`Selection`: which entries each KV head keeps, and optionally new content for kept slots (SurrogateKV puts a
surrogate key/value in the slot of a merged chunk). :mod:`kvforge.presses.hooks` gathers the inputs (observation
window queries, lookahead draft queries, reconstruction scores) and :mod:`kvforge.presses.apply` installs the
selection in the cache; the press classes (:mod:`kvforge.presses.base`) build on this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


def num_kept(size: int, compression_ratio: float) -> int:
    """Entries kept out of ``size`` at ``compression_ratio`` (kvpress's ``int(S * (1 - r))``, at least 1)."""
    if size <= 0:
        return 0
    kept = math.floor(size * (1.0 - compression_ratio) + 1e-9)  # 1e-9: 10 * (1 - 0.7) must give 3, not 2
    return min(size, max(1, kept))


def check_ratio(compression_ratio: float) -> None:
    if not 0.0 <= compression_ratio < 1.0:
        raise ValueError(f"compression_ratio must be in [0, 1), got {compression_ratio}")


class HiddenScorer(Protocol):
    """Scores every prompt entry from the attention input of its layer while the prompt is prefilled (KVzap).

    ``bind`` runs once before the prefill (load, or train, what it needs for this model); the hooks then call it on
    every prefill forward with the layer's attention input; ``finish`` gets a layer's scores of every new entry once
    the prefill is done (their number known: KVzap adds its recency term there), and the press reads what it returns
    under ``key``.
    """

    key: str

    def bind(self, model: Any, tokenizer: Any) -> None: ...

    def __call__(self, layer_idx: int, hidden_states: Tensor) -> Tensor | None: ...  # (B, Q, hidden) -> (B, H_kv, Q)

    def finish(self, layer_idx: int, scores: Tensor) -> Tensor: ...  # (B, H_kv, S) -> (B, H_kv, S)


@dataclass
class Needs:
    """What a press needs the hooks to collect before it can score."""

    window_size: int = 0  # last prompt tokens whose queries are kept (observation window)
    lookahead: int = 0  # greedy draft tokens decoded with the full cache; their queries join the window
    reconstruction: bool = False  # KVzip: max attention received while the model repeats the context
    query_stats: bool = False  # Expected Attention: mean/covariance of the prompt's pre-RoPE queries
    scorers: tuple[HiddenScorer, ...] = ()  # learned scorers run on every prompt forward (KVzap)
    replay: Any = None  # reconstruction: whose replay settings (a KVzipPress; None = KVzip's defaults)
    words: bool = False  # the word of every new entry (whole_words), read from the prompt's tokenizer

    def merge(self, other: Needs) -> Needs:
        keys = {s.key for s in self.scorers}
        return Needs(
            max(self.window_size, other.window_size),
            max(self.lookahead, other.lookahead),
            self.reconstruction or other.reconstruction,
            self.query_stats or other.query_stats,
            self.scorers + tuple(s for s in other.scorers if s.key not in keys),
            self.replay if self.replay is not None else other.replay,
            self.words or other.words,
        )


@dataclass
class Selection:
    """A press's decision for one layer.

    Args:
        keep: ``(B, H_kv, S)`` bool, True = the entry stays.
        keys, values: optional ``(B, H_kv, S, D)`` replacement content (only kept slots are read).
    """

    keep: Tensor
    keys: Tensor | None = None
    values: Tensor | None = None

    @classmethod
    def everything(cls, ctx: LayerContext) -> Selection:
        """Keep every new entry of ``ctx``'s layer (a budget at least the layer's size, or no compression)."""
        return cls(keep=torch.ones(ctx.keys.shape[:3], dtype=torch.bool, device=ctx.keys.device))


@dataclass
class LayerContext:
    """Everything a press may use to compress one layer's new entries.

    Args:
        keys, values: ``(B, H_kv, S, D)`` post-RoPE entries created by this prefill (the part to compress).
        positions: ``(B, S)`` RoPE positions of those entries.
        layer_idx, num_layers: index among the compressed layers and their number (PyramidKV budgets).
        num_heads: query heads H (a multiple of H_kv).
        scaling: attention scale of the layer (``head_dim ** -0.5`` unless the model says otherwise).
        window_queries: ``(B, H, W, D)`` post-RoPE queries of the last W prompt tokens, ``window_positions`` ``(B, W)``.
        lookahead_queries: ``(B, H, E, D)`` queries of E greedy draft tokens (they see every prompt entry).
        reconstruction_scores: ``(B, H, S)`` max attention each entry received while the context was repeated.
        output_weight: ``(hidden, H * D)`` the layer's output projection (CriticalKV's ``W_O``).
        prefix_keys, prefix_positions, prefix_valid: ``(B, H_kv, P, D)``, ``(B, H_kv, P)``, ``(B, H_kv, P)`` or None:
            entries already cached before this prefill (kept as they are; they only enter softmax denominators).
        header_length: the first new entries that are the chat template's header (system prompt, role tokens).
        rope_angles: ``(D/2,)`` RoPE angle per position step of each frequency (Expected Attention), or None.
        model_layer: the layer's index in the model (``layer_idx`` counts compressed layers only).
        query_mean, query_cov: ``(B, H, D)``, ``(B, H, D, D)`` mean and covariance of the prompt's pre-RoPE queries
            (positions >= 4, the sinks excluded), or None.
        hidden_scores: ``{scorer key: (B, H_kv, S)}`` what each :class:`HiddenScorer` gave the new entries.
        words: ``(S,)`` the word each new entry belongs to (:func:`word_ids`; a number is one word), for a press
            whose needs ask for them (``Needs.words``); None otherwise or when the prompt's tokenizer is not known.
    """

    keys: Tensor
    values: Tensor
    positions: Tensor
    layer_idx: int = 0
    num_layers: int = 1
    num_heads: int | None = None
    scaling: float | None = None
    window_queries: Tensor | None = None
    window_positions: Tensor | None = None
    lookahead_queries: Tensor | None = None
    reconstruction_scores: Tensor | None = None
    output_weight: Tensor | None = None
    prefix_keys: Tensor | None = None
    prefix_positions: Tensor | None = None
    prefix_valid: Tensor | None = None
    header_length: int = 0
    rope_angles: Tensor | None = None
    query_mean: Tensor | None = None
    model_layer: int | None = None
    query_cov: Tensor | None = None
    hidden_scores: dict[str, Tensor] | None = None
    words: Tensor | None = None

    @property
    def size(self) -> int:
        return self.keys.shape[2]

    @property
    def heads(self) -> int:
        return self.num_heads if self.num_heads is not None else self.keys.shape[1]

    @property
    def group_size(self) -> int:
        return self.heads // self.keys.shape[1]

    def protected(self, keep_first: int, keep_header: bool = True) -> Tensor:
        """``(B, S)`` True for the entries a replay-scored press always keeps: the first ``keep_first`` entries (sinks)
        after the chat template header (system prompt, role tokens), which KVzip's replay never repeats."""
        n = keep_first + (self.header_length if keep_header else 0)
        return torch.arange(self.size, device=self.keys.device)[None].expand(self.keys.shape[0], -1) < n

    def attention(self, queries: Tensor, query_positions: Tensor | None) -> Tensor:
        """Softmax attention ``(B, H, Q, S)`` of ``queries`` ``(B, H, Q, D)`` to the new entries.

        Causal by position (None = the queries see everything); the prefix entries enter the normalisation.
        Only Q x (P + S) logits are built: Q is a window, never the whole prompt.
        """
        scale = self.scaling if self.scaling is not None else queries.shape[-1] ** -0.5
        logits = self._logits(queries, self.keys, self.positions[:, None, :], None, query_positions, scale)
        probs = logits.softmax(dim=-1)
        if self.prefix_keys is not None and self.prefix_keys.shape[2] > 0:
            # renormalise over prefix + new entries: p_new * Z_new / (Z_new + Z_prefix)
            pre = self._logits(
                queries, self.prefix_keys, self.prefix_positions, self.prefix_valid, query_positions, scale
            )
            lse_new, lse_pre = logits.logsumexp(-1, keepdim=True), pre.logsumexp(-1, keepdim=True)
            probs = probs * (lse_new - torch.logaddexp(lse_new, lse_pre)).exp()
        return probs.nan_to_num_(0.0)

    @staticmethod
    def _logits(
        queries: Tensor,
        keys: Tensor,
        positions: Tensor | None,
        valid: Tensor | None,
        query_positions: Tensor | None,
        scale: float,
    ) -> Tensor:
        """Masked logits ``(B, H, Q, K)`` of queries ``(B, H, Q, D)`` on keys ``(B, H_kv, K, D)``, no key copies."""
        b, h, q, d = queries.shape
        h_kv = keys.shape[1]
        grouped = queries.reshape(b, h_kv, (h // h_kv) * q, d)
        logits = (grouped @ keys.transpose(-1, -2).to(queries.dtype)).float().mul_(scale)
        logits = logits.view(b, h_kv, h // h_kv, q, -1)  # (B, H_kv, g, Q, K)
        if query_positions is not None and positions is not None:  # positions (B, 1 or H_kv, K)
            hidden = positions[:, :, None, None, :] > query_positions[:, None, None, :, None]
            logits.masked_fill_(hidden, float("-inf"))
        if valid is not None:
            logits.masked_fill_(~valid[:, :, None, None, :], float("-inf"))
        return logits.view(b, h, q, -1)

    def observed_attention(self, window_size: int) -> Tensor:
        """``(B, H, S)``: mean attention of the last ``window_size`` window queries, plus the lookahead queries' mean.

        Each term is a mean of attention distributions, so window and lookahead weigh the same.
        """
        b, _, s, _ = self.keys.shape
        total = torch.zeros(b, self.heads, s, device=self.keys.device)
        if self.window_queries is not None and window_size > 0:
            assert self.window_positions is not None
            w = min(window_size, self.window_queries.shape[2])
            q, qp = self.window_queries[:, :, -w:], self.window_positions[:, -w:]
            total += self.attention(q, qp).mean(dim=2)
        if self.lookahead_queries is not None and self.lookahead_queries.shape[2] > 0:
            total += self.attention(self.lookahead_queries, None).mean(dim=2)
        return total

    def window_mask(self, window_size: int) -> Tensor:
        """``(B, S)`` True for the entries of the last ``window_size`` prompt tokens (the observation window)."""
        if self.window_positions is None or window_size <= 0:
            return torch.zeros(self.positions.shape, dtype=torch.bool, device=self.positions.device)
        w = min(window_size, self.window_positions.shape[1])
        first = self.window_positions[:, -w:].min(dim=1, keepdim=True).values  # (B, 1)
        return self.positions >= first

    def group_reduce(self, scores: Tensor, how: str = "sum") -> Tensor:
        """``(B, H, S)`` per query head -> ``(B, H_kv, S)`` per KV head (GQA groups are consecutive heads)."""
        b, h, s = scores.shape
        grouped = scores.view(b, h // self.group_size, self.group_size, s)
        if how == "max":
            return grouped.amax(dim=2)
        return grouped.mean(dim=2) if how == "mean" else grouped.sum(dim=2)


def pool_tokens(scores: Tensor, kernel_size: int) -> Tensor:
    """Average-pool ``(B, H, S)`` scores along the token axis (SnapKV's clustering; odd kernel keeps the length)."""
    if kernel_size <= 1:
        return scores
    b, h, s = scores.shape
    pad = kernel_size // 2
    pooled = F.avg_pool1d(scores.reshape(b * h, 1, s), kernel_size, stride=1, padding=pad)
    return pooled[..., :s].reshape(b, h, s)


def topk_mask(scores: Tensor, k: int) -> Tensor:
    """Bool mask with exactly ``k`` True per row of ``scores`` ``(..., S)``: the highest scores."""
    mask = torch.zeros_like(scores, dtype=torch.bool)
    if k <= 0:
        return mask
    idx = scores.float().nan_to_num(float("-inf")).topk(min(k, scores.shape[-1]), dim=-1).indices
    return mask.scatter_(-1, idx, True)


def topk_mask_varying(scores: Tensor, k: Tensor) -> Tensor:
    """Bool mask keeping the ``k[..., None]`` highest of each row of ``scores`` ``(..., S)`` (k differs per row)."""
    order = scores.float().nan_to_num(float("-inf")).argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order).contiguous())
    return ranks < k[..., None]


class Compressing(Protocol):
    """A press as :func:`kvforge.presses.apply.compress_prefill` uses it (:class:`kvforge.presses.base.Press`)."""

    @property
    def name(self) -> str: ...

    def needs(self) -> Needs: ...

    def ratio(self) -> float: ...

    def compress_all(self, contexts: list[LayerContext]) -> list[Selection]: ...

    def config(self) -> dict[str, object]: ...


MAX_WORD = 16  # tokens: a longer run (a hash, a URL) is cut into words of this many


def word_ids(tokenizer: Any, ids: list[int]) -> Tensor:
    """``(S,)`` ascending word index of every token of ``ids``: a word is a run of tokens that continue one another
    with letters or digits (``" 8" "7" "8"`` is one word, so is ``" Neil"``; ``"."``, ``"-"`` and a token that opens
    with a space start new ones), at most :data:`MAX_WORD` tokens. A SentencePiece piece that opens a word (``"▁Ne"``)
    decodes alone without its space; its marker is read instead."""
    texts = [
        " " + t if str(p).startswith("\u2581") and not t[:1].isspace() else t
        for p, t in zip(tokenizer.convert_ids_to_tokens(ids), (tokenizer.decode([i]) for i in ids), strict=True)
    ]
    out, word, length, prev = [], -1, 0, ""
    for text in texts:
        joins = (
            bool(text)
            and bool(prev)
            and text[0].isalnum()
            and (prev[-1].isalnum() or prev.isspace())
            and length < MAX_WORD
        )
        if not joins:
            word, length = word + 1, 0
        out.append(word)
        length += 1
        prev = text
    return torch.tensor(out, dtype=torch.long)


def word_max(scores: Tensor, words: Tensor) -> Tensor:
    """``(B, H, S)`` scores -> every entry takes the highest score of its word (``words`` ``(S,)``, ascending)."""
    idx = words.to(scores.device)[None, None].expand_as(scores)
    best = scores.new_full((*scores.shape[:2], int(words.max()) + 1), float("-inf"))
    best = best.scatter_reduce(2, idx, scores, reduce="amax", include_self=True)
    return best.gather(2, idx)
