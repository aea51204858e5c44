"""KVzip (Kim et al., 2025, arXiv 2505.23416): score entries by how much the model needs them to repeat the context.

After the context is prefilled, the model is asked to repeat it, as KVzip's code (and kvpress's KVzipPress) does: the
request "Repeat the previous context exactly." continues the user turn that holds the context, the template closes the
turn and opens the assistant's, and the context is teacher-forced as the answer, chunk by chunk (``replay_chunk``
context tokens per forward; a later chunk is asked for with "Repeat the part of the previous context exactly,
starting with" + the previous chunk's last 8 tokens). An entry's score is the max attention it receives from the
replay queries, per (layer, KV head, token): max over the queries and over the query heads of its GQA group, the
softmax taken over the sinks, the chunk being repeated and the replay's own keys (``normalise="chunk"``, as KVzip).
The scores are taken inside the replay's own attention (:class:`~kvforge.presses.hooks.ReplayAttention`); the replay
entries are removed afterwards (cost: one extra forward of the context on top of it, paid once per document: the
right trade for a query-agnostic cache that is stored and reused). Scores equal kvpress 0.5.5's to float32
rounding (<= 7e-6 of the layer's largest score, ``benchmarks/kvzip_crosscheck.py``).

As in the paper (and each switchable so its effect is measured):
- ``chat_template`` (True): the replay is a chat turn; False = the bare prompt + context (kvforge's earlier behaviour).
- ``replay_turn``: ``"continue"`` (default, above) or ``"new"``: the request as a later user turn of its own (for a
  context that closed its turn; kvforge's default before the kvpress comparison).
- ``normalise``: ``"chunk"`` (default) or ``"all"``: softmax over every key in the cache (header, other chunks).
- ``budget``: ``"global"`` (default) one top-k over every (layer, head, token) of the model (the paper's and kvpress's
  ranking: per-layer lengths differ, the model total is exact, memory is freed through the head-wise layout);
  ``"layer"`` one top-k over all KV heads of a layer (non-uniform head budgets, exact layer total; the default before
  it was measured worse); ``"head"`` per-head uniform.
- ``keep_header`` / ``keep_first``: the chat template header (system prompt, role tokens: found as the prompt's
  common prefix with the template's own rendering) and the first ``keep_first`` entries are always kept (they count
  in the budget). The header is never repeated (as KVzip), so with ``keep_header=False`` it scores 0 beyond the
  sinks and goes first, which is kvpress's behaviour.
- ``pool`` (kvforge, 0 = off): before the top-k, each entry's score becomes the max over a window of ``pool`` entries
  around it (odd; per KV head), so the tokens next to a surprising one (a needle's key words beside its value) are
  kept with it. Measured in docs/presses.md ("Score pooling") and docs/store.md (the best stored point).
- ``whole_words`` (kvforge, off): after ``pool``, each entry's score becomes the highest of its word's (a number's
  digits, a name's pieces: :func:`~kvforge.presses.layer.word_ids`), per KV head, so a head keeps a word whole or
  not at all: a model copying a value needs every piece of it in the heads it copies from.
- ``value_aware`` (KVzip+): score x the entry's projected value contribution ``||V_i W_O||_1`` (CriticalKV's
  :func:`~kvforge.presses.criticalkv.projected_value_norms`), normalised by its mean over the layer's entries so that
  layers compare under a global budget (the paper normalises by the residual stream's norm; the layer mean of the
  contributions plays that role here).

The context-independent head-level mode is :class:`kvforge.presses.kvzip_heads.KVzipHeadPress`.
Without a tokenizer (``compress_prefill(..., tokenizer=None)`` and no ``prompt_ids``) only the context is repeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvforge.presses.base import ScorerPress
from kvforge.presses.criticalkv import projected_value_norms
from kvforge.presses.layer import LayerContext, Needs, Selection, num_kept, topk_mask, word_max
from kvforge.presses.replay import NORMALISE, REPEAT_PROMPT, REPLAY_CHUNK, TURNS

BUDGETS = ("head", "layer", "global", "token", "tokens")
UNIFORM_BUDGETS = ("head", "token", "tokens")  # one count of entries on every layer and KV head (vLLM's paged cache)


class BudgetedSelection:
    """How a scorer press with a ``budget`` turns its scores into a selection (KVzip, KVzap): ``"head"`` keeps
    ``num_kept`` entries in every KV head, ``"layer"`` one top-k over a layer's heads, ``"global"`` one over every
    (layer, head, token) of the model; ``"token"`` keeps the same ``num_kept`` tokens in every KV head of a layer
    (a token's score: its highest over the layer's heads), ``"tokens"`` the same tokens in every layer and head (its
    highest over the model); ``pool`` is checked here too (0 off, else an odd window), and applied with
    ``whole_words`` by :meth:`pooled`."""

    budget: str
    pool: int
    compression_ratio: float
    whole_words: bool

    def check_selection(self) -> None:
        if self.pool < 0 or (self.pool > 1 and self.pool % 2 == 0):
            raise ValueError(f"pool must be 0 (off) or an odd window, got {self.pool}")
        if self.budget not in BUDGETS:
            raise ValueError(f"budget must be one of {BUDGETS}, got {self.budget!r}")

    def score(self, ctx: LayerContext) -> Tensor:
        raise NotImplementedError

    def pooled(self, scores: Tensor, ctx: LayerContext) -> Tensor:
        """``(B, H_kv, S)`` scores after ``pool`` then ``whole_words``."""
        scores = max_pool(scores, self.pool)
        if not self.whole_words:
            return scores
        if ctx.words is None:
            raise ValueError("whole_words needs the prompt's tokenizer (compress_prefill(..., tokenizer=...))")
        return word_max(scores, ctx.words)

    def compress(self, ctx: LayerContext) -> Selection:
        if self.budget == "head":
            return super().compress(ctx)  # type: ignore[misc,no-any-return]  # ScorerPress: top-k per head
        return self.compress_all([ctx])[0]

    def compress_all(self, contexts: list[LayerContext]) -> list[Selection]:
        everything = keep_all(contexts, self.compression_ratio)
        if everything is not None:  # nothing to remove: no scores needed (at ratio 0 no replay ran)
            return everything
        if self.budget == "head":
            return [self.compress(c) for c in contexts]
        if self.budget == "layer":
            return [top_entries([self.score(c)], [c], self.compression_ratio)[0] for c in contexts]
        if self.budget == "token":
            return [shared_tokens([self.score(c)], self.compression_ratio)[0] for c in contexts]
        if self.budget == "tokens":
            return shared_tokens([self.score(c) for c in contexts], self.compression_ratio)
        return top_entries([self.score(c) for c in contexts], contexts, self.compression_ratio)


@dataclass
class KVzipPress(BudgetedSelection, ScorerPress):
    """Context-reconstruction scoring with the paper's replay, budgets, protected header and KVzip+ option."""

    prompt: str = REPEAT_PROMPT
    prompt_ids: list[int] | None = field(default=None, repr=False)
    chat_template: bool = True
    replay_chunk: int = REPLAY_CHUNK
    budget: str = "global"
    keep_header: bool = True
    keep_first: int = 4
    value_aware: bool = False
    replay_turn: str = "continue"
    normalise: str = "chunk"
    pool: int = 0
    whole_words: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_selection()
        if self.replay_turn not in TURNS:
            raise ValueError(f"replay_turn must be one of {TURNS}, got {self.replay_turn!r}")
        if self.normalise not in NORMALISE:
            raise ValueError(f"normalise must be one of {NORMALISE}, got {self.normalise!r}")
        if self.replay_chunk < 0 or self.keep_first < 0:
            raise ValueError("replay_chunk and keep_first must be >= 0 (replay_chunk 0 = the whole context at once)")

    def needs(self) -> Needs:
        return Needs(reconstruction=True, replay=self, words=self.whole_words)

    def protected(self, ctx: LayerContext) -> Tensor:
        """``(B, S)`` True for entries always kept: the first ``keep_first`` and the template header."""
        return ctx.protected(self.keep_first, self.keep_header)

    def score(self, ctx: LayerContext) -> Tensor:
        if ctx.reconstruction_scores is None:
            raise ValueError("KVzip needs reconstruction scores (run it through compress_prefill)")
        scores = ctx.group_reduce(ctx.reconstruction_scores, "max")  # (B, H_kv, S)
        if self.value_aware:
            norms = projected_value_norms(ctx)
            scores = scores * (norms / norms.mean(dim=(1, 2), keepdim=True).clamp_min(1e-12))
        return self.pooled(scores, ctx).masked_fill(self.protected(ctx)[:, None, :], float("inf"))


def max_pool(scores: Tensor, window: int) -> Tensor:
    """``(B, H, S)`` scores -> the max over ``window`` neighbouring entries (odd; <= 1 leaves them as they are)."""
    if window <= 1:
        return scores
    b, h, s = scores.shape
    pooled = torch.nn.functional.max_pool1d(scores.reshape(b * h, 1, s).float(), window, stride=1, padding=window // 2)
    return pooled.reshape(b, h, s).to(scores.dtype)


def keep_all(contexts: list[LayerContext], compression_ratio: float) -> list[Selection] | None:
    """Selections keeping every entry when ``compression_ratio`` removes none of any context's, else None."""
    if any(num_kept(c.size, compression_ratio) < c.size for c in contexts):
        return None
    return [Selection.everything(c) for c in contexts]


def top_entries(scores: list[Tensor], contexts: list[LayerContext], compression_ratio: float) -> list[Selection]:
    """One top-k over every (layer, KV head, token) of ``scores`` ``[(B, H_kv, S)]``: the layers' budgets
    ``H_kv * num_kept(S, ratio)`` summed, spent where the scores are highest (per-layer and per-head lengths differ;
    every head keeps at least its best entry, counted in the budget)."""
    everything = keep_all(contexts, compression_ratio)
    if everything is not None:
        return everything
    b = scores[0].shape[0]
    total = sum(c.keys.shape[1] * num_kept(c.size, compression_ratio) for c in contexts)
    # every head keeps its best entry (a head with nothing left would attend to nothing); counts in the budget
    forced = [s.float().nan_to_num(float("-inf")).masked_fill(topk_mask(s, 1), float("inf")) for s in scores]
    flat = torch.cat([s.reshape(b, -1) for s in forced], dim=1)
    keep = topk_mask(flat, total)
    out, at = [], 0
    for s in scores:
        n = s[0].numel()
        out.append(Selection(keep=keep[:, at : at + n].reshape(s.shape)))
        at += n
    return out


def shared_tokens(scores: list[Tensor], compression_ratio: float) -> list[Selection]:
    """The same ``num_kept`` tokens kept in every KV head of every layer of ``scores`` ``[(B, H_kv, S)]`` (one prompt):
    the tokens whose highest score over those heads and layers is highest."""
    best = torch.stack([s.float().nan_to_num(float("-inf")).amax(dim=1) for s in scores]).amax(dim=0)  # (B, S)
    keep = topk_mask(best, num_kept(best.shape[-1], compression_ratio))
    return [Selection(keep=keep[:, None, :].expand(s.shape).clone()) for s in scores]
