"""Shared fixtures: tiny random models of every architecture, the character tokenizer, the bundled real model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvforge.testing import ARCHS, tiny_model, tiny_tokenizer

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# the first use of a kvzap press trains its scorer (kvforge.kvzap_train.ensure_trained): on tiny models, a small one
os.environ.setdefault("KVFORGE_KVZAP_WINDOW", "128")
os.environ.setdefault("KVFORGE_KVZAP_WINDOWS", "3")


@pytest.fixture(scope="session", params=sorted(ARCHS))
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture()
def kvzap_scorers() -> None:
    """KVzap presses read a scorer trained once per model (an explicit step): the tiny models' ones, in the cache dir
    the test sees (seconds, once per folder)."""
    from kvforge.kvzap_train import ensure_trained
    from kvforge.presses import build_press

    for arch in sorted(ARCHS):
        for name in ("kvzap", "kvzap-mlp"):
            ensure_trained(build_press(name, 0.5), tiny_model(arch), tiny_tokenizer())


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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Llama and the character tokenizer saved as a model folder (read-only: tests load it)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors run much faster on one thread than on two contended ones (use with ``usefixtures``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------- vLLM engines
@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama vLLM's CPU attention accepts (head size 32), saved with the character tokenizer."""
    path = tmp_path_factory.mktemp("tiny-vllm-llama")
    tiny_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=3).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vllm_in_process():
    """One process, a small KV pool: engines start in seconds and tests see their logs."""
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
