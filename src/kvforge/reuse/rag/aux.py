"""CacheClip token selection: an auxiliary model's last-layer attention from the question to the context.

The auxiliary model may use another tokenizer: both tokenise the same chunk texts, so scores move from auxiliary
tokens to main tokens through character offsets (a main token gets the highest score of the auxiliary tokens
overlapping its characters). Selection keeps the top ``r`` context tokens, then recomputes whole aligned windows
of ``window_size`` tokens holding more than ``window_threshold`` selected ones (local coherence).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

from kvforge.prefill import prefill_at
from kvforge.reuse.rag.assemble import ChunkSource, build_cache, truncated
from kvforge.reuse.rag.attend import AttentionCapture
from kvforge.reuse.rag.prompt import RagPrompt, build_prompt


def map_scores(
    text_len: int, src_offsets: list[tuple[int, int]], src_scores: Tensor, dst_offsets: list[tuple[int, int]]
) -> Tensor:
    """Scores of ``dst`` tokens from ``src`` tokens of the same text, through character spans ``(start, end)``.

    A destination token gets the max score of the source tokens overlapping its span; an empty span (a token
    without characters) takes the score of the character it sits on.
    """
    chars = torch.zeros(max(text_len, 1))
    for (a, b), s in zip(src_offsets, src_scores.tolist(), strict=True):
        if b > a:
            chars[a:b] = torch.clamp(chars[a:b], min=s)
    out = torch.zeros(len(dst_offsets))
    for j, (a, b) in enumerate(dst_offsets):
        if b > a:
            out[j] = chars[a:b].max()
        else:
            out[j] = chars[min(a, chars.numel() - 1)]
    return out


GROUPINGS = ("union", "windows", "none")


def check_grouping(grouping: str) -> None:
    if grouping not in GROUPINGS:
        raise ValueError(f"unknown grouping {grouping!r}; choose from {', '.join(GROUPINGS)}")


def select_top(
    scores: Tensor, ratio: float, window_size: int = 8, window_threshold: int = 5, grouping: str = "union"
) -> Tensor:
    """Bool ``(N,)``: the ``round(ratio * N)`` highest scores, grouped in aligned windows of ``window_size``.

    ``grouping``: ``"union"`` keeps every picked token and adds the whole windows with more than
    ``window_threshold`` picked (the recomputed share can exceed ``ratio``); ``"windows"`` recomputes only those
    whole windows and skips the others (CacheClip's rule as its paper states it: the share can fall below
    ``ratio``); ``"none"`` keeps the picked tokens alone.
    """
    check_grouping(grouping)
    n = scores.numel()
    k = min(n, round(ratio * n))
    selected = torch.zeros(n, dtype=torch.bool)
    if k == 0:
        return selected
    selected[scores.topk(k).indices] = True
    if window_size > 1 and grouping != "none":
        pad = (-n) % window_size
        counts = torch.cat([selected, selected.new_zeros(pad)]).view(-1, window_size).sum(-1)  # (num_windows,)
        whole = (counts > window_threshold).repeat_interleave(window_size)[:n]
        selected = whole if grouping == "windows" else selected | whole
    return selected


class AuxScorer:
    """Scores main-model context tokens with an auxiliary model (its own tokenizer, its own stored chunk KV).

    The auxiliary model reuses its precomputed chunks naively and only runs the separators and question; the
    question tokens' attention at its last layer, averaged over heads and question tokens, scores each context
    token (CacheClip). ``num_layers`` runs only the auxiliary model's first layers and reads the last of those (a
    layer subset of the model itself as the small auxiliary model).
    """

    def __init__(self, aux: ChunkSource, num_layers: int | None = None) -> None:
        if num_layers is not None and not 1 <= num_layers <= aux.num_layers:
            raise ValueError(f"aux_layers must be in 1..{aux.num_layers}, got {num_layers}")
        self.aux = aux
        self.num_layers = aux.num_layers if num_layers is None else num_layers

    def aux_prompt(self, prompt: RagPrompt) -> RagPrompt:
        return build_prompt(self.aux.tokenizer, prompt.chunk_texts, prompt.question, prompt.system, prompt.separator)

    def warm(self, prompt: RagPrompt) -> None:
        self.aux.chunks.warm(self.aux_prompt(prompt))

    @torch.inference_mode()
    def score(self, prompt: RagPrompt) -> Tensor:
        """``(N_ctx,)`` importance of the main prompt's context tokens, in prompt order."""
        if not prompt.chunk_texts or len(prompt.chunk_offsets) != len(prompt.chunk_ids):
            raise ValueError("auxiliary scoring needs the chunk texts and offsets (use build_prompt)")
        aux_prompt = self.aux_prompt(prompt)
        asm = self.aux.load(aux_prompt)
        layers = self.num_layers
        cache = build_cache(self.aux.model, asm, torch.zeros(asm.num_tokens, dtype=torch.bool), num_layers=layers)
        question_start = asm.num_tokens - len(aux_prompt.question_ids)
        capture = AttentionCapture(cache, layers - 1, int(asm.positions[question_start]))
        cache.attention_hook = capture
        fresh = asm.fresh_idx
        with truncated(self.aux.model, layers) if layers < self.aux.num_layers else nullcontext():
            prefill_at(self.aux.model, asm.ids[fresh], asm.positions[fresh], cache)
        by_pos = capture.scores_by_position(int(asm.positions.max()) + 1)
        aux_ctx = by_pos[asm.positions[asm.context_idx]]  # (N_ctx_aux,)
        out, start = [], 0
        for text, aux_ids, aux_off, main_off in zip(
            aux_prompt.chunk_texts, aux_prompt.chunk_ids, aux_prompt.chunk_offsets, prompt.chunk_offsets, strict=True
        ):
            part = aux_ctx[start : start + len(aux_ids)]
            start += len(aux_ids)
            out.append(map_scores(len(text), aux_off, part, main_off))
        return torch.cat(out)
