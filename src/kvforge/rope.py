"""Exact RoPE re-rotation of cached keys: move a post-RoPE key from position p to p' without recomputing it (RAG chunk
reuse, the kvtc codec, vLLM document slots).

RoPE rotations compose, ``R(a) R(b) = R(a + b)``, so a key rotated at ``p`` moves to ``p'`` by
``k' = k * cos(d * theta) + rotate_half(k) * sin(d * theta)`` with ``d = p' - p`` (may be negative), done in fp32.
The ``attention_scaling`` factor of yarn-style RoPE multiplies both cos and sin, so it is already inside ``k``
and a delta rotation must not apply it again. Only position-linear RoPE composes: dynamic NTK and longrope (whose
frequencies depend on the sequence length) are refused, as are partial rotary and models without RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvforge.attention import rotate_half
from kvforge.compat import find_rotary
from kvforge.errors import UserError

#: rope types whose frequencies do not depend on the sequence length (HF ``rope_type`` names).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedRopeError(UserError):
    """The model's positional encoding cannot be moved by a delta rotation."""


@dataclass
class RopeSpec:
    """Per-layer RoPE inverse frequencies ``(D/2,)`` fp32 of a model; ``head_dim`` is the rotated key width."""

    inv_freq: list[Tensor]
    head_dim: int
    _tables: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        distinct: list[Tensor] = []
        for i, f in enumerate(self.inv_freq):  # share equal frequency tensors (cache key = storage)
            same = next((d for d in distinct if d.shape == f.shape and torch.equal(d, f)), None)
            if same is None:
                distinct.append(f)
            else:
                self.inv_freq[i] = same

    def rotate(self, keys: Tensor, delta: Tensor | int, layer_idx: int) -> Tensor:
        """``keys`` ``(..., S, D)`` post-RoPE moved by ``delta`` positions (int or ``(S,)``/broadcastable)."""
        if not isinstance(delta, int):
            return rotate_keys(keys, delta, self.inv_freq[layer_idx])
        # layers share few distinct frequency sets and one chunk moves by one delta: one (D/2,) cos/sin pair, kept
        freq = self.inv_freq[layer_idx]
        key = (delta, freq.data_ptr(), keys.device)
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) > 256:
                self._tables.clear()
            table = self._tables[key] = half_rotation_table(torch.tensor([delta]), freq, keys.device)
        return apply_half_rotation(keys, *table)

    def rotate_layers(self, keys: list[Tensor], delta: Tensor) -> list[Tensor]:
        """Every layer's ``keys[l]`` ``(H, S, D)`` moved by ``delta`` ``(S,)`` (one per entry; 0 = stays).

        The assembly of a RAG prompt: one rotation per layer for all of its chunks, the half-size cos/sin tables
        computed once per distinct frequency set and shared by the layers that use it (no per-chunk small ops).
        """
        moving = delta != 0
        if not bool(moving.any()):
            return keys
        tables: dict[int, tuple[Tensor, Tensor]] = {}
        out = []
        for li, k in enumerate(keys):
            freq = self.inv_freq[li]
            table = tables.get(freq.data_ptr())
            if table is None:
                table = tables[freq.data_ptr()] = half_rotation_table(delta, freq, k.device)
            out.append(apply_half_rotation(k, *table))
        return out


def rotation_table(delta: Tensor | int, num_tokens: int, inv_freq: Tensor, device: Any) -> tuple[Tensor, Tensor]:
    """fp32 ``(cos, sin)`` ``(..., S, D)`` of a rotation by ``delta`` (angles in fp64: exact for large deltas)."""
    d = torch.as_tensor(delta, device=device, dtype=torch.float64)
    if d.dim() == 0:
        d = d.expand(num_tokens)
    freqs = d[..., None] * inv_freq.to(device=device, dtype=torch.float64)  # (..., S, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


def half_rotation_table(delta: Tensor, inv_freq: Tensor, device: Any) -> tuple[Tensor, Tensor]:
    """fp32 ``(cos, sin)`` ``(S, D/2)`` of a rotation by ``delta`` ``(S,)`` (angles in fp64)."""
    freqs = delta.to(device=device, dtype=torch.float64)[:, None] * inv_freq.to(device=device, dtype=torch.float64)
    return freqs.cos().float(), freqs.sin().float()


def apply_half_rotation(keys: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``keys`` ``(..., S, D)`` rotated with half-size tables ``(S, D/2)``: ``(k1 c - k2 s, k2 c + k1 s)``, the
    same as :func:`apply_rotation` (``rotate_half(k) = (-k2, k1)``) with no concatenation; fp32, cast back."""
    k = keys.float()
    half = k.shape[-1] // 2
    k1, k2 = k[..., :half], k[..., half:]
    out = torch.empty_like(k)
    torch.mul(k1, cos, out=out[..., :half])
    out[..., :half].addcmul_(k2, sin, value=-1.0)
    torch.mul(k2, cos, out=out[..., half:])
    out[..., half:].addcmul_(k1, sin)
    return out.to(keys.dtype)


def rotate_each(keys: Tensor, delta: Tensor, inv_freq: Tensor) -> Tensor:
    """``keys`` ``(..., S, D)`` each moved by its own ``delta`` ``(..., S)`` (integers), in fp32, cast back: the same
    rotation as :func:`rotate_keys`, its angles computed once per distinct delta (fp64), not once per entry (many
    heads and layers of one segment share few positions)."""
    delta = delta.to(torch.long)
    low, high = (int(delta.min()), int(delta.max())) if delta.numel() else (0, 0)
    if high - low + 1 <= delta.numel():  # a table over the range, indexed
        cos, sin = half_rotation_table(torch.arange(low, high + 1, device=delta.device), inv_freq, keys.device)
        index = delta - low
    else:
        distinct, index = torch.unique(delta, return_inverse=True)
        cos, sin = half_rotation_table(distinct, inv_freq, keys.device)
    return apply_half_rotation(keys, cos[index], sin[index])


def apply_rotation(keys: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    k = keys.float()
    return (k * cos + rotate_half(k) * sin).to(keys.dtype)


def rotate_keys(keys: Tensor, delta: Tensor | int, inv_freq: Tensor) -> Tensor:
    """Rotate ``keys`` ``(..., S, D)`` by ``delta`` positions (scalar or ``(..., S)``), in fp32, cast back."""
    return apply_rotation(keys, *rotation_table(delta, keys.shape[-2], inv_freq, keys.device))


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def rope_spec(model: Any) -> RopeSpec:
    """Read the per-layer RoPE frequencies of ``model``; raise :class:`UnsupportedRopeError` when not composable."""
    config = _text_config(model)
    name = type(model).__name__
    rotary = find_rotary(model)
    if rotary is None:
        raise UnsupportedRopeError(f"{name} has no rotary embedding (absolute positions or ALiBi): chunks cannot move")
    num_layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer_types = getattr(config, "layer_types", None)
    rope_types = rotary.rope_type if isinstance(getattr(rotary, "rope_type", None), dict) else None
    inv_freq: list[Tensor] = []
    for i in range(num_layers):
        if rope_types is not None:  # per layer type (Gemma3: local/global theta)
            layer_type = layer_types[i]
            kind, freq = rope_types[layer_type], getattr(rotary, f"{layer_type}_inv_freq")
        else:
            kind, freq = getattr(rotary, "rope_type", "default"), rotary.inv_freq
        if kind not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedRopeError(
                f"{name} uses rope_type {kind!r}, whose frequencies depend on the sequence length; "
                f"only {', '.join(SUPPORTED_ROPE_TYPES)} can be re-rotated"
            )
        if 2 * freq.numel() != head_dim:
            raise UnsupportedRopeError(
                f"{name} rotates {2 * freq.numel()} of {head_dim} head dims (partial rotary): not handled"
            )
        inv_freq.append(freq.detach().float().cpu())
    return RopeSpec(inv_freq=inv_freq, head_dim=head_dim)


def rope_spec_from_config(config: Any) -> RopeSpec:
    """:func:`rope_spec` of the model ``config`` describes, without its weights (parameters on the meta device, the
    rotary buffers computed as loading would): for a process that serves the model with another engine."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config)
    return rope_spec(model)
