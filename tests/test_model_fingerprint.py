"""model_fingerprint from file digests (cached by path, size, mtime) or the hub commit, tensors hashed only when
asked or when the weights no longer match the files."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

import kvforge.model as model_mod
from kvforge.digests import file_sha256, folder_digest
from kvforge.model import load_model, model_fingerprint, weights_digest
from kvforge.testing import tiny_model, tiny_tokenizer


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVFORGE_HASH_TENSORS", raising=False)


@pytest.fixture()
def counted(monkeypatch):
    """Counts the calls of weights_digest (tensor hashing)."""
    calls = []

    def counting(model):
        calls.append(1)
        return weights_digest(model)

    monkeypatch.setattr(model_mod, "weights_digest", counting)
    return calls


def test_a_loaded_folder_is_fingerprinted_from_its_files(tiny_llama_dir, counted):
    model, tok = load_model(str(tiny_llama_dir), device="cpu")
    fp = model_fingerprint(model, tok)
    assert counted == [] and fp.split(":")[1] == folder_digest(tiny_llama_dir)[:16]
    by_tensors = model_fingerprint(model, tok, hash_tensors=True)
    assert counted == [1] and by_tensors.split(":")[1] == weights_digest(model)[:16] != fp.split(":")[1]
    assert model_fingerprint(model, tok) == fp  # the option is part of the cached answer


def test_hash_tensors_from_the_environment(tiny_llama_dir, counted, monkeypatch):
    model, tok = load_model(str(tiny_llama_dir), device="cpu")
    monkeypatch.setenv("KVFORGE_HASH_TENSORS", "1")
    model_fingerprint(model, tok)
    assert counted == [1]


def test_changed_weights_fall_back_to_hashing_tensors(tiny_llama_dir, counted):
    model, tok = load_model(str(tiny_llama_dir), device="cpu")
    fp = model_fingerprint(model, tok)
    model.to(torch.bfloat16)
    bf16 = model_fingerprint(model, tok)
    assert counted == [1] and bf16 != fp and bf16.endswith(":bfloat16")
    model.to(torch.float32)
    with torch.no_grad():
        next(model.parameters()).mul_(1.5)
    assert model_fingerprint(model, tok).split(":")[1] not in (fp.split(":")[1], bf16.split(":")[1])


def test_new_weight_files_give_a_new_fingerprint(tiny_llama_dir, tmp_path, counted):
    folder = tmp_path / "model"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    model, tok = load_model(str(folder), device="cpu")
    before = model_fingerprint(model, tok)
    tiny_model("llama", seed=3).save_pretrained(folder)  # same names and sizes, other weights
    model, tok = load_model(str(folder), device="cpu")
    assert model_fingerprint(model, tok) != before and counted == []


def test_file_digests_are_cached_by_path_size_and_mtime(tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"a" * 1000)
    real = hashlib.sha256(b"a" * 1000).hexdigest()
    assert file_sha256(path) == real
    (entry,) = (tmp_path / "cache" / "digests").iterdir()
    entry.write_text(json.dumps(json.loads(entry.read_text()) | {"sha256": "from-the-cache"}))
    assert file_sha256(path) == "from-the-cache"  # not read again
    path.write_bytes(b"b" * 1000)  # same size, new content
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert file_sha256(path) == hashlib.sha256(b"b" * 1000).hexdigest()


def test_a_hub_model_is_fingerprinted_by_its_commit(monkeypatch, counted):
    tiny, tok = tiny_model("llama"), tiny_tokenizer()

    def fake_from_pretrained(source, dtype):
        assert source == "org/tiny"
        return tiny, tok

    monkeypatch.setattr(model_mod, "_from_pretrained", fake_from_pretrained)
    tiny.config._commit_hash = "0123abcd"
    model, _ = load_model("org/tiny", device="cpu")
    expected = hashlib.sha256(b"hub:org/tiny@0123abcd").hexdigest()[:16]
    assert model_fingerprint(model, tok).split(":")[1] == expected and counted == []
    other = tiny_model("llama")
    other.config._commit_hash = None  # commit unknown: the tensors are hashed
    monkeypatch.setattr(model_mod, "_from_pretrained", lambda source, dtype: (other, tok))
    model_fingerprint(load_model("org/tiny", device="cpu")[0], tok)
    assert counted == [1]
