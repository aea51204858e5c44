"""Compress a long prompt's KV cache with a press, then generate on the compressed cache.

    python examples/compress_generate.py [MODEL]     # MODEL: built-in name (smollm2-135m), model folder or .gguf
"""

from __future__ import annotations

import sys

from kvforge.engine import Engine
from kvforge.model import load_model
from kvforge.presses import build_press


def main(model_name: str = "smollm2-135m") -> None:
    model, tokenizer = load_model(model_name)
    engine = Engine(model, tokenizer)
    document = " ".join(f"Line {i}: the harbour master logged ship number {i * 7}." for i in range(20))
    question = "Which ship number was logged on line 12?"
    full = engine.answer(document, question, max_new_tokens=16)
    press = build_press("snapkv", compression_ratio=0.5)
    small = engine.answer(document, question, press=press, max_new_tokens=16)
    print(f"full cache    : {full.info['cache_entries']:>7} entries -> {full.text!r}")
    print(f"snapkv at 0.5 : {small.info['cache_entries']:>7} entries -> {small.text!r}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
