"""A model folder's fingerprint without loading its weights (what a vLLM server with kvforge's connector keys by)."""

from __future__ import annotations

import json

import pytest

from kvforge.errors import UserError
from kvforge.model import folder_fingerprint, load_model, model_fingerprint
from kvforge.testing import tiny_model, tiny_tokenizer


def test_folder_fingerprint_equals_the_loaded_models(tiny_llama_dir):
    model, tokenizer = load_model(str(tiny_llama_dir), device="cpu")
    assert folder_fingerprint(tiny_llama_dir) == model_fingerprint(model, tokenizer)
    assert folder_fingerprint(tiny_llama_dir, "bfloat16").endswith(":bfloat16")


def test_other_weights_or_tokenizer_give_another_fingerprint(tiny_llama_dir, tmp_path):
    other = tmp_path / "other"
    tiny_model("llama", seed=5).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    assert folder_fingerprint(other) != folder_fingerprint(tiny_llama_dir)
    tok = tiny_tokenizer()
    tok.chat_template = "{{ messages[0]['content'] }}"
    assert folder_fingerprint(other, tokenizer=tok) != folder_fingerprint(other)


def test_a_folder_without_weights_or_architecture_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"config\.json"):
        folder_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UserError, match="not a model folder"):
        folder_fingerprint(tmp_path)


@pytest.mark.slow
def test_the_bundled_models_folder_has_its_fingerprint(smollm2):
    from kvforge.model import model_folder

    model, tokenizer = smollm2
    folder = model_folder("smollm2-135m")
    assert folder is not None and (folder / "model.safetensors").is_file()
    assert folder_fingerprint(folder) == model_fingerprint(model, tokenizer)
