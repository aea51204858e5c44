"""How a vLLM server's connector tells other processes on its store what it keys blocks by.

The connector writes one small blob per served model (keyed by the model path vLLM reports as ``root`` in
``/v1/models``): the model fingerprint and the store block size. The router reads it, so it computes the same
block keys without loading the model, and a router pointed at another store than its vLLM server fails at start
with a message saying so.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvforge.reuse.base import digest

if TYPE_CHECKING:
    from kvforge.store.base import KVStore

BLOB_PREFIX = "vllm-served-"


@dataclass(frozen=True)
class ServedModel:
    """What a connector keys the blocks of ``model`` by."""

    model: str  # the path (or hub id) vLLM serves, as it reports it
    model_id: str  # kvforge fingerprint
    block_size: int  # tokens per stored block
    kv_block_size: int | None = None  # tokens per block of vLLM's own paged cache (None: an older announcement)


def blob_key(model: str) -> str:
    return BLOB_PREFIX + digest("kvforge-vllm-served-v1", model)[:40]


def announce(store: KVStore, served: ServedModel) -> None:
    """Write (or rewrite: several servers of one model write the same bytes) the descriptor of ``served``."""
    store.put_blob(blob_key(served.model), json.dumps(asdict(served), sort_keys=True).encode())


def find_served(store: KVStore, model: str) -> ServedModel | None:
    """The descriptor a connector wrote for ``model``, or None."""
    data = store.get_blob(blob_key(model))
    if data is None:
        return None
    try:
        fields = json.loads(data)
        kv_block = fields.get("kv_block_size")
        return ServedModel(
            model=str(fields["model"]), model_id=str(fields["model_id"]), block_size=int(fields["block_size"]),
            kv_block_size=None if kv_block is None else int(kv_block),
        )
    except (ValueError, KeyError, TypeError):
        return None
