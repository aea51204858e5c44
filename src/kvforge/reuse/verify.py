"""The agreement test that labels a semantic lookup right or wrong: the stored candidate's KV against a full prefill.

A sampled lookup is verified after its answer was sent (in the strategy's ``record``): the prompt asked is prefilled
in full and the candidate's stored KV is loaded, and each greedily continues ``num_tokens`` tokens. Reuse was right
when both continuations are the same tokens (up to the first end-of-sequence token, which must then come at the same
step in both): the answer from the stored KV starts exactly as the answer to the prompt asked. Greedy on both sides,
whatever the request's sampling, so the label does not depend on chance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvforge.cache import KVCache
from kvforge.decode import eos_ids
from kvforge.prefill import forward, prefill
from kvforge.reuse.base import cache_from_segments
from kvforge.types import KVSegment


@dataclass
class AgreementVerifier:
    """Next-``num_tokens`` greedy agreement between a candidate's stored KV and a full prefill of the prompt asked.

    Args:
        model: the engine's model (the one the stored KV was made with).
        tokenizer: its tokenizer (for the end-of-sequence ids).
        num_tokens: how many tokens must agree (1 = first-token agreement).
        chunk_size: prefill chunk size of the full prefill.
    """

    model: Any
    tokenizer: Any = None
    num_tokens: int = 8
    chunk_size: int | None = 512
    _eos: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")
        self._eos = set(eos_ids(self.model, self.tokenizer)) if self.tokenizer is not None else set()

    @torch.inference_mode()
    def continuation(self, cache: KVCache, logits: torch.Tensor) -> list[int]:
        """Greedy tokens from ``logits`` on ``cache`` (stops after an end-of-sequence token)."""
        out: list[int] = []
        step = torch.empty((1, 1), dtype=torch.long, device=logits.device)
        for i in range(self.num_tokens):
            token = int(logits.argmax(-1)[0])
            out.append(token)
            if token in self._eos or i + 1 == self.num_tokens:
                break
            step[0, 0] = token
            logits = forward(self.model, step, cache)
        return out

    @torch.inference_mode()
    def agree(self, asked_ids: Sequence[int], donor: KVSegment, tail: Sequence[int] = ()) -> bool:
        """Whether answering from ``donor``'s KV (then ``tail`` prefilled on top: context mode's question; none: the
        donor's last token recomputed, canonical mode) starts as answering ``asked_ids`` after a full prefill does."""
        full = KVCache.for_model(self.model)
        logits = prefill(self.model, list(asked_ids), full, chunk_size=self.chunk_size)
        expected = self.continuation(full, logits)
        del full
        donor_ids = list(donor.token_ids)
        windows = donor.meta.get("layer_windows")
        end = len(donor_ids) if tail else len(donor_ids) - 1
        cache = cache_from_segments([donor], donor_ids, end, windows, self.model.device)
        logits = prefill(self.model, list(tail) or donor_ids[-1:], cache, chunk_size=self.chunk_size)
        return self.continuation(cache, logits) == expected
