"""SurrogateKV (Kim et al., "Semantic-Preserving KV Cache Compression via Attention Stabilization"): merge, not drop.

The new entries minus a recent suffix (``recent_size`` = 8) are cut into chunks of ``chunk_size`` (32). Token score
s_t (eq. 1) = attention from the recent suffix queries, pooled over the token axis, averaged over heads; chunk
score u_i (eq. 2) = mean s_t over the chunk. Victim chunks are taken in ascending u until the removed count reaches
the target (eq. 3) and each victim is replaced by ONE surrogate key/value in the slot of its last token (so it keeps
that token's position; decoding positions are unaffected): NULL (zeros), LOCAL (the chunk mean) or GLOBAL (the
mean over all victims, eq. 4). Surrogates count in the budget.

Departures: (1) exact budget: the target is ``S - num_kept(S, r)`` over all new entries (same count as every other
press at ratio r), and instead of overshooting eq. 3 by up to ``chunk_size - 2`` entries, the last victim merges
only its lowest-scored tokens (as many as needed); if merging every chunk is not enough (extreme ratios), surrogates
and then the oldest suffix entries are dropped. (2) Keys are merged post-RoPE, as they sit in the cache.
Extensions (kvforge): ``value_aware`` multiplies attention by CriticalKV's projected value norm before pooling
(``surrogatekv-critical``); ``headwise`` lets every KV head pick its own victims against a shared layer budget
(AdaKV-style, ``surrogatekv-ada``); ``lookahead`` adds draft-token queries to the recent suffix's;
``token_scores="kvzip"`` takes s_t from KVzip's context replay instead of the recent suffix (max attention received
while the model repeats the context, max over each GQA group): a query-agnostic SurrogateKV (``surrogatekv-kvzip``).
The replay never repeats the chat template header, so it scores the header 0 beyond the sinks; as KVzip does, the
header and the first ``keep_first`` entries are then protected (their chunks are never merged), else the system prompt
and role tokens are the first victims (measured on a 1k needle at 50% kept: the answer became unrelated text).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvforge.presses.base import Press
from kvforge.presses.criticalkv import projected_value_norms
from kvforge.presses.layer import LayerContext, Needs, Selection, check_ratio, num_kept, pool_tokens

SURROGATES = ("null", "local", "global")


def choose_victims(
    token_scores: Tensor, num_removed: int, chunk_size: int, recent_size: int
) -> list[tuple[int, Tensor]]:
    """Victims for one batch row: ``[(row, member slots), ...]``, each group merged into its last slot.

    ``token_scores`` is ``(rows, S)`` (rows = 1 shared by all heads, or one per KV head); groups are removed in
    ascending chunk score until exactly ``num_removed`` entries (summed over rows) are gone, or every chunk is merged.
    """
    s = token_scores.shape[1]
    past = max(0, s - recent_size)
    bounds = [(a, min(a + chunk_size, past)) for a in range(0, past, chunk_size)]
    if not bounds or num_removed <= 0:
        return []
    u = torch.stack([token_scores[:, a:e].mean(dim=1) for a, e in bounds], dim=1)  # (rows, M), eq. 2
    victims: list[tuple[int, Tensor]] = []
    removed = 0
    for unit in u.flatten().argsort(stable=True).tolist():
        if removed >= num_removed:
            break
        row, i = divmod(unit, len(bounds))
        a, e = bounds[i]
        if e - a <= 1:
            continue
        if removed + (e - a - 1) <= num_removed:
            members = torch.arange(a, e, device=token_scores.device)
        else:  # partial victim: merge only its lowest-scored tokens, exactly as many as still needed
            k = num_removed - removed + 1
            members = a + token_scores[row, a:e].topk(k, largest=False).indices.sort().values
        victims.append((row, members))
        removed += len(members) - 1
    return victims


@dataclass
class SurrogateKVPress(Press):
    """SurrogateKV with a NULL / LOCAL / GLOBAL surrogate per victim chunk (exact per-layer budget)."""

    compression_ratio: float = 0.0
    surrogate: str = "global"
    chunk_size: int = 32
    recent_size: int = 8
    kernel_size: int = 5
    lookahead: int = 0
    value_aware: bool = False
    headwise: bool = False
    epsilon: float = 1e-4
    scores: str = "attention"
    keep_first: int = 4  # scores="kvzip": the first entries (and the template header) are never merged

    def __post_init__(self) -> None:
        check_ratio(self.compression_ratio)
        if self.scores not in ("attention", "kvzip"):
            raise ValueError(f"scores must be 'attention' or 'kvzip', got {self.scores!r}")
        if self.surrogate not in SURROGATES:
            raise ValueError(f"surrogate must be one of {SURROGATES}, got {self.surrogate!r}")
        if min(self.chunk_size - 1, self.recent_size, self.kernel_size) < 1 or min(self.lookahead, self.keep_first) < 0:
            raise ValueError("chunk_size must be >= 2, recent_size and kernel_size >= 1, lookahead and keep_first >= 0")

    @property
    def name(self) -> str:
        return f"SurrogateKVPress[{self.surrogate}]"

    def needs(self) -> Needs:
        return Needs(window_size=self.recent_size, lookahead=self.lookahead, reconstruction=self.scores == "kvzip")

    def token_scores(self, ctx: LayerContext) -> Tensor:
        """``(B, rows, S)`` s_t of eq. 1 (rows = 1, or H_kv when ``headwise``)."""
        if self.scores == "kvzip":
            if ctx.reconstruction_scores is None:
                raise ValueError("SurrogateKV with KVzip scores needs reconstruction scores (run compress_prefill)")
            grouped = ctx.group_reduce(ctx.reconstruction_scores, "max")  # (B, H_kv, S), every head of a group
            attn = grouped.repeat_interleave(ctx.group_size, dim=1)  # (B, H, S) as the attention path gives
        else:
            attn = ctx.observed_attention(self.recent_size)  # (B, H, S)
        if self.value_aware:
            attn = (ctx.group_reduce(attn, "mean") + self.epsilon) * projected_value_norms(ctx)  # (B, H_kv, S)
        pooled = pool_tokens(attn, self.kernel_size)
        if self.headwise:
            out = pooled if self.value_aware else ctx.group_reduce(pooled, "mean")
        else:
            out = pooled.mean(dim=1, keepdim=True)
        if self.scores == "kvzip":  # the header is never replayed (scored 0): protect it and the sinks, as KVzip
            out = out.masked_fill(ctx.protected(self.keep_first)[:, None, :], float("inf"))
        return out

    def compress(self, ctx: LayerContext) -> Selection:
        b, h_kv, s, _ = ctx.keys.shape
        keep = torch.ones(b, h_kv, s, dtype=torch.bool, device=ctx.keys.device)
        num_removed = s - num_kept(s, self.compression_ratio)
        if num_removed <= 0:
            return Selection(keep=keep)
        scores = self.token_scores(ctx)
        rows = scores.shape[1]
        keys, values = ctx.keys.clone(), ctx.values.clone()
        for bi in range(b):
            victims = choose_victims(scores[bi], num_removed * rows, self.chunk_size, self.recent_size)
            self._merge(bi, victims, keep, keys, values, ctx)
            removed = int((~keep[bi, :1] if rows == 1 else ~keep[bi]).sum())
            self._drop_rest(bi, num_removed * rows - removed, scores[bi], keep)
        return Selection(keep=keep, keys=keys, values=values)

    def _merge(
        self,
        bi: int,
        victims: list[tuple[int, Tensor]],
        keep: Tensor,
        keys: Tensor,
        values: Tensor,
        ctx: LayerContext,
    ) -> None:
        """Mark victims removed and write their surrogates (into the slot of each group's last member)."""
        h_kv = keys.shape[1]
        heads_of = (lambda r: list(range(h_kv))) if not self.headwise else (lambda r: [r])
        if self.surrogate == "global":  # eq. 4: one mean over all victims (per KV head)
            members_by_head: dict[int, list[Tensor]] = {}
            for row, members in victims:
                for hd in heads_of(row):
                    members_by_head.setdefault(hd, []).append(members)
            global_mean = {
                hd: (ctx.keys[bi, hd, torch.cat(m)].mean(0), ctx.values[bi, hd, torch.cat(m)].mean(0))
                for hd, m in members_by_head.items()
            }
        for row, members in victims:
            slot = int(members[-1])
            for hd in heads_of(row):
                keep[bi, hd, members[:-1]] = False
                if self.surrogate == "null":
                    keys[bi, hd, slot], values[bi, hd, slot] = 0.0, 0.0
                elif self.surrogate == "local":
                    keys[bi, hd, slot] = ctx.keys[bi, hd, members].mean(0)
                    values[bi, hd, slot] = ctx.values[bi, hd, members].mean(0)
                else:
                    keys[bi, hd, slot], values[bi, hd, slot] = global_mean[hd]

    def _drop_rest(self, bi: int, missing: int, scores: Tensor, keep: Tensor) -> None:
        """Extreme ratios: drop surrogates and leftovers by score, then the oldest suffix entries (exact budget)."""
        if missing <= 0:
            return
        rows, s = scores.shape
        h_kv = keep.shape[1]
        kept = keep[bi] if rows > 1 else keep[bi, :1]  # (rows, S); shared mode: all heads equal
        order = scores.float().clone()
        finite = order.isfinite()
        top = float(order[finite].max()) if bool(finite.any()) else 0.0
        order = order.masked_fill(~finite, top + 2.0 + s)  # protected entries (inf) go after the suffix, finite
        suffix = torch.arange(s, device=scores.device) >= max(0, s - self.recent_size)
        order[:, suffix] = top + 1.0 + torch.arange(int(suffix.sum()), device=scores.device).float()
        order = order.masked_fill(~kept, float("inf")).flatten()
        drop = order.topk(missing, largest=False).indices
        flat = kept.clone().flatten()
        flat[drop] = False
        if rows > 1:
            keep[bi] = flat.view(rows, s)
        else:
            keep[bi] = flat.view(1, s).expand(h_kv, s)
