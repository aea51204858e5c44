"""Prefix block chains: every block's key and header carry the hash of its whole chain, checked on load.

Block ``i`` of a prompt covers tokens ``[i*B, min((i+1)*B, n))``. Its chain digest is

    d_i = sha256(d_{i-1} || uint32-LE(block tokens)),   d_{-1} = sha256("kvforge-prefix-v2", model fingerprint, B)

(length-prefixed parts, :func:`kvforge.reuse.base.digest`), so ``d_i`` names the model, the block size and every
token from the prompt's start to the block's end. The store key is ``prefix-v2-<d_i>``; the header (segment meta)
holds ``chain = d_i``, ``parent = d_{i-1}`` and ``block_start``. A block is accepted only when its meta names the
parent the reader expects, its chain hash is the hash of that parent and its own tokens, and that hash is the one the
reader asked for: a block copied from another prompt's chain (same tokens and positions, other blocks before it)
fails the parent check, whatever key it was copied under.

Branches: a block's header also holds ``next``, the tokens of the block that followed it in the prompt that wrote it
(its first child). Children added later by other prompts are listed in a small blob per parent (``branches``; the
chain root's list is ``roots``): newest first, at most ``MAX_BRANCHES``, each ``[digest, tokens]``. Both are hints:
whatever a hint names is verified like any block when loaded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from kvforge.names import STORE_KEY_PATTERN
from kvforge.reuse.base import digest, encode_ids
from kvforge.types import KVSegment

FORMAT = "prefix-v2"
KEY_PREFIX = "prefix-v2-"
BRANCHES_PREFIX = "prefix-v2-branches-"  # + parent digest: children of a stored block
ROOTS_PREFIX = "prefix-v2-roots-"  # + root digest: first blocks of prompts (no block owns this list)
MAX_BRANCHES = 32


def chain_root(model_id: str, block_size: int) -> str:
    """``d_{-1}``: the digest every chain of this model and block size starts from."""
    return digest("kvforge-prefix-v2", model_id, str(block_size))


def next_digest(parent: str, token_ids: Sequence[int]) -> str:
    """The chain digest of a block holding ``token_ids`` after the block whose digest is ``parent``."""
    return digest(parent, encode_ids(token_ids))


_KEY_RE = re.compile(STORE_KEY_PATTERN)  # a chain named in a stored list is input: it must make a valid key


def block_key(chain: str) -> str:
    return KEY_PREFIX + chain


def list_key(parent: str, is_root: bool) -> str:
    """The blob listing the children of ``parent`` (the chain root's list has its own prefix)."""
    return (ROOTS_PREFIX if is_root else BRANCHES_PREFIX) + parent


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def block_meta(
    chain: str, parent: str, start: int, layer_windows: Sequence[int | None], next_ids: Sequence[int]
) -> dict[str, Any]:
    """The header facts of a block (stored in ``KVSegment.meta``)."""
    return {
        "format": FORMAT,
        "chain": chain,
        "parent": parent,
        "block_start": start,
        "layer_windows": list(layer_windows),
        "next": [int(t) for t in next_ids],
    }


def block_problem(
    segment: KVSegment, *, model_id: str, parent: str, start: int, chain: str, block_size: int
) -> str | None:
    """Why ``segment`` is not the block ``chain`` after ``parent`` starting at token ``start`` (None: it is)."""
    meta = segment.meta
    num = len(segment.token_ids)
    if segment.model_id != model_id:
        return f"made by model {segment.model_id!r}"
    if meta.get("format") != FORMAT:
        return f"not a {FORMAT} block (format {meta.get('format')!r})"
    if meta.get("parent") != parent:
        return "it belongs to another chain (the blocks before it differ)"
    try:
        own = next_digest(parent, segment.token_ids)
    except (TypeError, ValueError):
        return "its token ids are invalid"
    if meta.get("chain") != own:
        return "its chain hash does not match its tokens"
    if own != chain:
        return "it holds other tokens than its key names"
    if meta.get("block_start") != start or segment.next_position != start + num or not 0 < num <= block_size:
        return "its position in the prompt differs"
    for p in segment.positions:
        if p.numel() and (int(p.min()) < start or int(p.max()) >= start + num):
            return "its entries lie outside its tokens' positions"
    return None


def encode_list(parent: str, entries: Sequence[tuple[str, list[int]]]) -> bytes:
    return json.dumps({"format": FORMAT, "parent": parent, "children": [[d, t] for d, t in entries]}).encode()


def decode_list(parent: str, raw: bytes | None) -> list[tuple[str, list[int]]]:
    """The entries of a children list; anything unexpected reads as an empty list (the list is only a hint)."""
    if raw is None:
        return []
    try:
        data = json.loads(raw)
        if data.get("format") != FORMAT or data.get("parent") != parent:
            return []
        return [
            (str(d), [int(t) for t in tokens])
            for d, tokens in data["children"]
            if isinstance(d, str) and _KEY_RE.match(block_key(d)) and isinstance(tokens, list)
        ]
    except (ValueError, TypeError, KeyError, AttributeError):
        return []


def entries_below(segment: KVSegment, end: int) -> list[int]:
    """Per layer, how many of the segment's entries lie at positions ``< end``."""
    return [int((p[0] < end).sum()) if p.numel() else 0 for p in segment.positions]
