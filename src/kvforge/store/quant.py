"""Symmetric int8 quantisation of stored K/V tensors, with fp32 scales per channel or per token.

Per channel (one scale per head and head-dim channel, over all tokens) suits keys, whose outlier channels are fixed;
per token (one scale per head and token) suits values (KIVI, arXiv:2402.02750, quantises keys per channel and values
per token: mode ``int8-kivi``). Round-trip error is at most half a scale step per element (before the final cast back
to the original dtype).
"""

from __future__ import annotations

import torch
from torch import Tensor

# mode -> (axis for keys, axis for values)
QUANT_MODES = {
    "int8-channel": ("channel", "channel"),
    "int8-token": ("token", "token"),
    "int8-kivi": ("channel", "token"),
}


def quantize(x: Tensor, axis: str, valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Quantise ``x`` ``(H_kv, S, D)`` to int8; returns ``(q, scale)`` with ``x ~= q * scale``.

    Args:
        axis: ``"channel"`` (scale ``(H_kv, 1, D)``, absmax over tokens) or ``"token"`` (scale ``(H_kv, S, 1)``).
        valid: optional ``(H_kv, S)`` mask; padding entries do not influence the scales and are stored as 0.
    """
    xf = x.float()
    if valid is not None:
        xf = xf.masked_fill(~valid.bool()[..., None], 0.0)
    dim = 1 if axis == "channel" else 2
    if axis not in ("channel", "token"):
        raise ValueError(f"axis must be 'channel' or 'token', got {axis!r}")
    if xf.shape[dim] == 0:
        shape = list(xf.shape)
        shape[dim] = 1
        return torch.zeros(xf.shape, dtype=torch.int8), torch.ones(shape, dtype=torch.float32)
    scale = xf.abs().amax(dim=dim, keepdim=True).div_(127.0)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero rows: any scale works
    q = xf.div(scale).round_().clamp_(-127, 127).to(torch.int8)  # in place: fewer temporaries
    return q, scale


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``q * scale`` back in ``dtype``."""
    return q.float().mul_(scale).to(dtype)
