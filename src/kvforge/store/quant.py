"""Symmetric int8 quantisation of stored K/V tensors, with fp32 scales per channel or per token.

Per channel (one scale per head and head-dim channel, over all tokens) suits keys, whose outlier channels are fixed;
per token (one scale per head and token) suits values (KIVI, arXiv:2402.02750, quantises keys per channel and values
per token: mode ``int8-kivi``). Round-trip error is at most half a scale step per element (before the final cast back
to the original dtype).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from kvforge.store.transform import TransformScheme, parse_transform

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


# -------------------------------------------------------------------------------------  group-wise int4 / int2
# KIVI-style asymmetric group quantisation with real bit packing: ``int4`` (two codes per byte) and ``int2`` (four).
# Keys are quantised per channel (groups of ``g`` consecutive tokens of one head and channel), values per token (groups
# of ``g`` consecutive channels of one head and token). Names: ``int4``, ``int2``, optionally ``-g<size>`` (group size,
# a multiple of 4, default 32) and ``-r<tokens>`` (the most recent tokens kept in full precision, default 0), e.g.
# ``int4-g64-r128``. Each group stores a minimum and a step (float16, or float32 if float16 cannot hold them); every
# element is reconstructed within half a step of its original value.
_GROUP_RE = re.compile(r"^int(?P<bits>[24])(?:-g(?P<g>\d+))?(?:-r(?P<r>\d+))?$")
DEFAULT_GROUP = 32


@dataclass(frozen=True)
class GroupScheme:
    """A parsed group-wise scheme name."""

    bits: int
    group: int = DEFAULT_GROUP
    residual: int = 0

    @property
    def name(self) -> str:
        return f"int{self.bits}" + (f"-g{self.group}" if self.group != DEFAULT_GROUP else "") + (
            f"-r{self.residual}" if self.residual else "")  # fmt: skip


def parse_scheme(quant: str | None) -> str | GroupScheme | TransformScheme | None:
    """``None`` / an int8 mode name / a :class:`GroupScheme` / a :class:`~kvforge.store.transform.TransformScheme`
    (``kvtc...``); ``ValueError`` with the choices for an unknown name."""
    if quant in (None, "", "none"):
        return None
    if quant == "int8":
        return "int8-kivi"
    if quant in QUANT_MODES:
        return quant
    transform = parse_transform(str(quant))
    if transform is not None:
        return transform
    m = _GROUP_RE.match(str(quant))
    if m is None:
        raise ValueError(
            f"unknown quantisation {quant!r}; choose from none, int8, {', '.join(sorted(QUANT_MODES))}, int4, int2 "
            "(int4/int2 take -g<group size> and -r<recent tokens kept in full precision>, e.g. int4-g64-r128), kvtc "
            "(transform coding: -b<bits per element>, default 2, or -k<bits>-v<bits>; -o<percent of entries kept at 16 "
            "bits>, default 2; e.g. kvtc-b1.5, kvtc-o0)"
        )
    group = int(m["g"] or DEFAULT_GROUP)
    if group < 4 or group % 4:
        raise ValueError(f"quantisation {quant!r}: the group size must be a positive multiple of 4, got {group}")
    return GroupScheme(int(m["bits"]), group, int(m["r"] or 0))


def canonical_quant(quant: str | None) -> str | None:
    """The canonical name of a quantisation (``int8`` -> ``int8-kivi``, ``int4-g32`` -> ``int4``, ``kvtc-b2`` ->
    ``kvtc``), None for full precision; ``ValueError`` for an unknown name."""
    scheme = parse_scheme(quant)
    return scheme.name if isinstance(scheme, GroupScheme | TransformScheme) else scheme


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack unsigned codes ``< 2**bits`` (last dim a multiple of ``8 // bits``) into uint8, low bits first."""
    per = 8 // bits
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = c[..., 0].clone()
    for j in range(1, per):
        out |= c[..., j] << (bits * j)
    return out


def unpack_bits(packed: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`pack_bits`: uint8 codes, last dim ``8 // bits`` times longer."""
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


def effective_group(length: int, group: int) -> int:
    """The group actually used along an axis of ``length``: ``group``, or less (a multiple of 4) for short axes."""
    return max(4, min(group, -(-length // 4) * 4))


def quantize_groups(x: Tensor, bits: int, group: int, valid: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Quantise ``x`` ``(..., L)`` in groups of ``group`` along its last axis (padded up to a multiple of it).

    Returns ``(packed uint8 (..., Lp * bits / 8), minimum (..., Lp / group), step (..., Lp / group))``; ``valid``
    (same shape as ``x``) excludes padding entries from the ranges.
    """
    levels = (1 << bits) - 1
    xf = x.float()
    length = xf.shape[-1]
    pad = -length % group
    ok = torch.ones_like(xf, dtype=torch.bool) if valid is None else valid.bool().expand_as(xf)
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
        ok = torch.nn.functional.pad(ok, (0, pad), value=False)
    g = xf.reshape(*xf.shape[:-1], xf.shape[-1] // group, group)
    okg = ok.reshape(g.shape)
    lo = g.masked_fill(~okg, float("inf")).amin(-1)
    hi = g.masked_fill(~okg, float("-inf")).amax(-1)
    empty = ~okg.any(-1)
    lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    sdtype = torch.float16 if bool(torch.isfinite(torch.stack([lo, hi]).half()).all()) else torch.float32
    lo_s = lo.to(sdtype)
    lo_s = torch.where(lo_s.float() > lo, torch.nextafter(lo_s, torch.tensor(float("-inf"), dtype=sdtype)), lo_s)
    step = ((hi - lo_s.float()) / levels).to(sdtype)
    # rounding the step down would leave the maximum out of range: round it up instead
    need = (hi - lo_s.float()) / levels
    step = torch.where(step.float() < need, torch.nextafter(step, torch.tensor(float("inf"), dtype=sdtype)), step)
    step = torch.where(step.float() > 0, step, torch.ones_like(step))
    q = (g - lo_s.float()[..., None]).div_(step.float()[..., None]).round_().clamp_(0, levels)
    q = q.masked_fill(~okg, 0).reshape(*xf.shape)
    return pack_bits(q, bits), lo_s, step


def dequantize_groups(packed: Tensor, lo: Tensor, step: Tensor, bits: int, length: int, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`quantize_groups`: ``(..., length)`` in ``dtype``."""
    q = unpack_bits(packed, bits).float()
    g = q.reshape(*q.shape[:-1], lo.shape[-1], q.shape[-1] // max(1, lo.shape[-1]))
    x = g.mul_(step.float()[..., None]).add_(lo.float()[..., None]).reshape(q.shape)
    return x[..., :length].to(dtype)
