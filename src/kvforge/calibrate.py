"""Calibrating the kvtc codec of a model: an explicit step taken before a store codes the model's KV, never inside a
store write.

The basis (:class:`~kvforge.store.transform.KVBasis`: PCA per layer and KV head, keys before RoPE) comes from the KV
of ``num_tokens`` tokens of the bundled public-domain sample text. It is saved with the model's other artefacts in the
kvforge cache dir (``kv-basis/``, beside ``kvzap/`` and ``kvzip-heads/``), so a model is calibrated once per
machine, and named in a store (its ``kvbasis-model-`` blob) so that every writer of that store (kvforge's engine, a
vLLM connector, another process) codes alike. The engine takes this step when a request meets a store that codes
with kvtc (:meth:`kvforge.engine.Engine.add`); ``kvforge cache calibrate`` takes it ahead of time.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from kvforge.cache import KVCache
from kvforge.model import model_fingerprint
from kvforge.paths import bundled_data_dir
from kvforge.prefill import prefill
from kvforge.rope import UnsupportedRopeError, rope_spec
from kvforge.store import transform
from kvforge.store.transform import KVBasis, fit_basis, publish_basis, store_basis, unrotate

logger = logging.getLogger(__name__)


@torch.inference_mode()
def calibrate_basis(model: Any, tokenizer: Any, text: str | None = None, num_tokens: int = 4096,
                    rope: bool = True) -> KVBasis:  # fmt: skip
    """A basis for ``model`` from the KV of ``num_tokens`` tokens of ``text`` (default: the bundled public-domain
    sample), keys before RoPE when ``rope`` and the model's RoPE allows it."""
    bundled = text is None
    if text is None:
        books = sorted((bundled_data_dir() / "haystack_gutenberg").glob("*.txt"))
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in books)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:num_tokens]
    cache = KVCache.for_model(model)
    prefill(model, torch.tensor([ids], device=model.device), cache)
    freqs: list[Tensor | None] = [None] * cache.num_layers
    if rope:
        try:
            freqs = list(rope_spec(model).inv_freq)
        except UnsupportedRopeError as exc:  # no RoPE, partial or length-dependent RoPE: code the keys as stored
            logger.info("KV basis: keys coded after RoPE (%s)", exc)
    keys, values = [], []
    for layer, freq in zip(cache.layers, freqs, strict=True):
        k, v, p, _ = layer.view()
        k, v, p = k[0].float().cpu(), v[0].float().cpu(), p[0].cpu()
        keys.append([unrotate(k[h], p[h], freq) if freq is not None else k[h] for h in range(k.shape[0])])
        values.append(list(v))
    info = {"calibrated_on": "bundled sample" if bundled else "text", "tokens": len(ids), "rope": rope}
    return fit_basis(model_fingerprint(model, tokenizer), keys, values, freqs, info)


def prepare_basis(model: Any, tokenizer: Any, store: Any = None, model_id: str | None = None) -> KVBasis:
    """The model's basis: saved, else calibrated now (once per machine); named in ``store`` when it names none yet (a
    basis another writer named first stays the store's)."""
    model_id = model_id or model_fingerprint(model, tokenizer)
    basis = transform.BOOK.saved(model_id)
    if basis is None:
        logger.info("calibrating the KV basis of %s on the bundled sample text (once per model)", model_id)
        basis = transform.BOOK.add(calibrate_basis(model, tokenizer))
    if store is not None and store_basis(store, model_id) is None:
        publish_basis(store, basis)
    return basis
