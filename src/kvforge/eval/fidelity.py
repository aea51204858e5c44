"""Continuous fidelity of a compressed cache against the full one: they separate methods even on small models.

- ``answer_nll``: mean negative log-likelihood per token of the reference answer, teacher-forced on the cache;
- ``kl`` and ``top1_agreement``: mean KL(full || compressed) and agreement of the arg-max over the next-token
  distributions along that teacher-forced continuation (CriticalKV's output-perturbation view, arXiv:2502.03805);
- ``needle_kept``: for needle tasks, the fraction of needle tokens still in the cache, averaged over the compressible
  layers and KV heads.

The continuation is the reference answer (``", ".join(answers)`` for multi-answer metrics), at most
``max_tokens`` tokens; teacher forcing runs on top of the cache and is undone exactly (:class:`CacheSnapshot`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvforge.cache import CacheSnapshot, KVCache
from kvforge.eval.data import Example
from kvforge.prefill import forward


def reference_text(example: Example) -> str:
    """The text teacher-forced for fidelity: the first answer, or all answers for ``contains_all``."""
    if example.metric == "contains_all":
        return ", ".join(example.answers)
    return example.answers[0] if example.answers else ""


def continuation_ids(tokenizer: Any, example: Example, max_tokens: int = 64) -> list[int]:
    """Token ids of :func:`reference_text` (leading space when the answer prefix does not end in whitespace)."""
    text = reference_text(example)
    if example.answer_prefix and not example.answer_prefix[-1].isspace():
        text = " " + text
    return tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]


@torch.inference_mode()
def teacher_forced_logprobs(model: Any, cache: KVCache, last_logits: Tensor, ids: list[int]) -> Tensor:
    """Log-probabilities ``(T, V)`` of the next token at each of the T steps predicting ``ids`` on ``cache``.

    Step 0 uses ``last_logits`` ``(1, V)`` (the prompt's last token); the cache is left as it was.
    """
    steps = [last_logits[0].float()]
    if len(ids) > 1:
        snapshot = CacheSnapshot(cache)
        try:
            logits = forward(model, ids[:-1], cache, logits_to_keep=0)  # (1, T-1, V)
        finally:
            snapshot.restore()
        steps.extend(logits[0].float())
    return F.log_softmax(torch.stack(steps), dim=-1)


def fidelity_metrics(logprobs: Tensor, full_logprobs: Tensor, ids: list[int]) -> dict[str, float]:
    """``answer_nll`` of ``ids`` under ``logprobs`` ``(T, V)``, and ``kl`` / ``top1_agreement`` vs ``full_logprobs``."""
    target = torch.as_tensor(ids, device=logprobs.device)
    nll = -logprobs.gather(1, target[:, None]).mean()
    kl = (full_logprobs.exp() * (full_logprobs - logprobs)).sum(-1).clamp_min(0).mean()  # KL(full || this) per step
    agree = (logprobs.argmax(-1) == full_logprobs.argmax(-1)).float().mean()
    return {"answer_nll": float(nll), "kl": float(kl), "top1_agreement": float(agree)}


def needle_positions(tokenizer: Any, prompt_ids: list[int], needles: list[str]) -> list[int]:
    """Token indices of the prompt covering the needle texts (empty when they cannot be located).

    The prompt is decoded, the needles found in the text and mapped back through the fast tokenizer's offsets; when
    re-encoding does not reproduce ``prompt_ids`` exactly the mapping is refused rather than guessed.
    """
    text = tokenizer.decode(prompt_ids)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(prompt_ids):
        return []
    positions: set[int] = set()
    for needle in needles:
        start = text.find(needle)
        if start < 0:
            continue
        end = start + len(needle)
        positions.update(i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < end and b > start)
    return sorted(positions)


def needle_kept(cache: KVCache, positions: list[int]) -> float | None:
    """Fraction of ``positions`` held (and valid) per layer and KV head, averaged; layers with a native sliding
    window are left out (no press compresses them). None when there is nothing to measure."""
    if not positions:
        return None
    wanted = torch.as_tensor(positions)
    fractions: list[Tensor] = []
    for layer, native in zip(cache.layers, cache.native_windows, strict=True):
        if native is not None or layer.positions is None:
            continue
        _, _, held, valid = layer.view()  # (B, H_kv, S)
        hit = held[..., None] == wanted.to(held.device)  # (B, H_kv, S, N)
        if valid is not None:
            hit &= valid[..., None]
        fractions.append(hit.any(dim=2).float().mean(dim=-1).flatten())  # (B * H_kv,)
    return float(torch.cat(fractions).mean()) if fractions else None
