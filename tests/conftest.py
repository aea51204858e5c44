"""Shared fixtures: tiny random models of every architecture, the character tokenizer, the bundled real model."""

from __future__ import annotations

import os

import pytest
import torch

from kvforge.testing import ARCHS, tiny_model, tiny_tokenizer

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session", params=sorted(ARCHS))
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture()
def model(arch: str):
    """A fresh tiny model per test (tests may switch its attention implementation)."""
    return tiny_model(arch)


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct (real weights, offline); skipped when its package is not installed."""
    from kvforge.errors import UserError
    from kvforge.model import load_model

    try:
        return load_model("smollm2-135m", device="cpu")
    except UserError as e:
        pytest.skip(f"smollm2-135m not available: {e}")
