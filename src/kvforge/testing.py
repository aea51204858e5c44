"""Tiny random-initialised models and a character tokenizer, built in code: nothing is downloaded.

Shared by the tests, the docs and the benchmarks.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvforge import compat

TINY: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

ARCHS: dict[str, tuple[type, type]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}

_ARCH_OVERRIDES: dict[str, dict[str, Any]] = {
    # Mistral: no sliding window by default in the tiny config (it would need > 2k tokens to matter).
    "mistral": dict(sliding_window=None),
    # Gemma3: a sliding-window layer then a full one, window small enough for tests to cross it.
    "gemma3": dict(
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}


def tiny_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A 2-3 layer random model of architecture ``arch`` (one of :data:`ARCHS`), in eval mode, fp32."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(ARCHS)}")
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(**(TINY | _ARCH_OVERRIDES.get(arch, {}) | overrides))
    compat.set_attn_implementation(config, "sdpa")
    model = model_cls(config).eval()
    # Random init gives near-uniform attention; scale q/k so attention is peaked and scores are informative.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer (printable ASCII and newline, ids 3..98), with a tiny chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    return fast


def split_words(cache: Any, words: torch.Tensor, start: int) -> list[list[int]]:
    """Per (layer, KV head) of a compressed ``cache``: the words (``words`` ``(S,)``, as
    :func:`kvforge.presses.layer.word_ids` gives them) of the entries from ``start`` on that the head keeps only
    partly."""
    body = words[start:]
    sizes = torch.bincount(body)
    out = []
    for layer in cache.layers:
        _, _, pos, valid = layer.view()
        pos, valid = pos.cpu(), None if valid is None else valid.cpu()
        for h in range(pos.shape[1]):
            kept = torch.zeros(len(words), dtype=torch.bool)
            kept[pos[0, h] if valid is None else pos[0, h][valid[0, h]]] = True
            counts = torch.bincount(body[kept[start:]], minlength=len(sizes))
            out.append([w for w in body.unique().tolist() if 0 < counts[w] < sizes[w]])
    return out
