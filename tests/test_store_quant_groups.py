"""Group-wise int4/int2 storage (KIVI-style): packing, per-element error bounds, exact byte counts, the size bar."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from store_helpers import make_segment

from kvforge.errors import UserError
from kvforge.store import open_store, quant_roundtrip
from kvforge.store.codec import decode, encode, segments_equal
from kvforge.store.quant import GroupScheme, effective_group, pack_bits, parse_scheme, quantize_groups, unpack_bits

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("bits", [2, 4])
def test_packing_is_exact_and_dense(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (3, 5, 32), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits), codes)
    assert pack_bits(torch.tensor([1, 2, 3, 0]), 2).item() == 1 | 2 << 2 | 3 << 4  # low bits first


def _group_bound(x: torch.Tensor, ok: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Half a step per element, step = (max - min) / levels of its group (last axis), from the original values."""
    pad = -x.shape[-1] % group
    xf = torch.nn.functional.pad(x.float(), (0, pad))
    okp = torch.nn.functional.pad(ok, (0, pad), value=False)
    g, okg = xf.reshape(*xf.shape[:-1], -1, group), okp.reshape(*xf.shape[:-1], -1, group)
    hi = g.masked_fill(~okg, float("-inf")).amax(-1, keepdim=True)
    lo = g.masked_fill(~okg, float("inf")).amin(-1, keepdim=True)
    step = ((hi - lo) / ((1 << bits) - 1)).nan_to_num(0.0, 0.0, 0.0)  # a group of padding only: no bound needed
    return (step / 2).expand_as(g).reshape(xf.shape)[..., : x.shape[-1]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("quant", ["int4", "int2", "int4-g8", "int2-g4-r5"])
def test_error_within_half_a_step_of_each_group(quant: str, dtype: torch.dtype) -> None:
    """Ragged, head-wise (per-head positions) and padded (valid mask) layers; keys per channel, values per token."""
    seg = make_segment(dtype, lengths=(40, 23, 0, 3), head_dim=16, masked=True)
    seg.keys[1][:, :, 3] *= 20  # an outlier channel
    seg.keys[1][~seg.valid[1]] = 1e4  # padding must not widen the ranges
    seg.values[1][~seg.valid[1]] = -1e4
    scheme = parse_scheme(quant)
    assert isinstance(scheme, GroupScheme)
    out = decode(encode(seg, quant=quant))
    assert out.meta["quant"] == scheme.name
    for i in range(seg.num_layers):
        assert torch.equal(out.positions[i], seg.positions[i])
        m = seg.valid[i]
        ok = torch.ones(seg.keys[i].shape[:2], dtype=torch.bool) if m is None else m
        if m is not None:
            assert torch.equal(out.valid[i], m)
        n = seg.keys[i].shape[1]
        nq = max(0, n - scheme.residual)
        for name, x, y in (("k", seg.keys[i], out.keys[i]), ("v", seg.values[i], out.values[i])):
            assert y.dtype == dtype and y.shape == x.shape
            # the most recent tokens are kept bit-exact
            assert torch.equal(y[:, nq:], x[:, nq:])
            xq, yq = x[:, :nq], y[:, :nq]
            if xq.numel() == 0:
                continue
            if name == "k":  # per channel: groups along tokens
                xs, ys, oks = xq.transpose(1, 2), yq.transpose(1, 2), ok[:, None, :nq].expand(-1, x.shape[2], -1)
                g = effective_group(nq, scheme.group)
            else:  # per token: groups along channels
                xs, ys, oks = xq, yq, ok[:, :nq, None].expand(-1, -1, x.shape[2])
                g = effective_group(x.shape[2], scheme.group)
            bound = _group_bound(xs, oks, scheme.bits, g)
            # float16 rounding of the stored minimum/step, then the cast back to the cache dtype
            cast = 0.0 if dtype == torch.float32 else xs.float().abs() * (2**-8 if dtype == torch.bfloat16 else 2**-11)
            err = (ys.float() - xs.float()).abs().masked_fill(~oks, 0)
            slack = bound * 2e-3 + xs.float().abs() * 2e-3 + 1e-6
            assert bool((err <= bound + cast + slack).all()), f"layer {i} {name}: {(err - bound).max()}"


@pytest.mark.parametrize("bits", [4, 2])
def test_exact_byte_counts(bits: int) -> None:
    h, s, d, group = 3, 100, 64, 32
    seg = make_segment(torch.float16, lengths=(s,), num_heads=h, head_dim=d, masked=False)
    data = encode(seg, quant=f"int{bits}")
    t = safetensors.torch.load(data)  # a stored segment is a plain safetensors file
    k_groups = -(-s // group)  # keys: groups of 32 tokens per head and channel
    assert t["k.0"].dtype == torch.uint8 and t["k.0"].numel() == h * d * k_groups * group * bits // 8
    assert t["k.0.min"].numel() == t["k.0.step"].numel() == h * d * k_groups
    assert t["v.0"].numel() == h * s * d * bits // 8  # values: groups of 32 channels per head and token
    assert t["v.0.min"].numel() == t["v.0.step"].numel() == h * s * d // group
    assert t["k.0.min"].dtype == torch.float16 and "k.0.recent" not in t


def test_int4_meets_the_size_bar_on_a_realistic_shape() -> None:
    """3 KV heads x 64 dims x 1024 tokens x 4 layers: int4 <= 17% of fp32, <= 34% of fp16 (all bytes, header too)."""
    for dtype, bar in ((torch.float32, 0.17), (torch.float16, 0.34)):
        seg = make_segment(dtype, lengths=(1024,) * 4, num_heads=3, head_dim=64, masked=False)
        for quant in ("int4", "int4-g64"):
            assert len(encode(seg, quant=quant)) <= bar * seg.nbytes(), (dtype, quant)
        assert len(encode(seg, quant="int2")) < len(encode(seg, quant="int4")) < len(encode(seg, quant="int8"))


def test_huge_values_fall_back_to_float32_ranges() -> None:
    x = torch.tensor([[1e6, -1e6, 3.0, 5e5]])
    _, lo, step = quantize_groups(x, 4, 4)
    assert lo.dtype == torch.float32 and torch.isfinite(step).all()
    seg = make_segment(lengths=(8,), masked=False)
    seg.keys[0][0, 0, 0] = 1e9
    out = quant_roundtrip(seg, "int4")
    assert torch.isfinite(out.keys[0]).all() and abs(out.keys[0][0, 0, 0].item() - 1e9) < 1e9 / 15


def test_roundtrip_function_and_store_url() -> None:
    seg = make_segment(lengths=(40, 23, 0))
    assert segments_equal(quant_roundtrip(seg, None), seg)
    assert quant_roundtrip(seg, "int8").meta["quant"] == "int8-kivi"
    store = open_store("memory://?quant=int4-g64-r8")
    store.put("k1", seg)
    got = store.get("k1")
    assert got is not None and got.meta["quant"] == "int4-g64-r8"
    assert torch.equal(got.keys[0][:, -8:], seg.keys[0][:, -8:])


@pytest.mark.parametrize("bad", ["int3", "int4-g6", "int4-g0", "int4-x", "fp4"])
def test_unknown_or_invalid_scheme_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ValueError, match="int4"):
        encode(make_segment(), quant=bad)
    with pytest.raises(UserError, match="quantisation"):
        open_store(f"memory://?quant={bad}")
