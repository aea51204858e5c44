"""Store a document's KV cache once, then answer later questions by reusing it (exact prefix reuse).

    python examples/store_reuse.py [MODEL] [STORE_URL]   # STORE_URL: memory:// (default), file:///abs/dir, redis://...
"""

from __future__ import annotations

import sys

from kvforge import Document, Engine, Request, load_model
from kvforge.reuse import build_reuse
from kvforge.store import open_store


def main(model_name: str = "smollm2-135m", store_url: str = "memory://") -> None:
    model, tokenizer = load_model(model_name)
    engine = Engine(model, tokenizer)
    engine.reuse = build_reuse("prefix", open_store(store_url), engine.model_id)
    document = " ".join(f"Paragraph {i}: the lighthouse at cape {i} has {i + 3} lamps." for i in range(20))
    for question in ("How many lamps at cape 5?", "How many lamps at cape 9?"):
        gen = engine.run(Request(Document(document, question), max_new_tokens=12))
        print(f"{question} -> {gen.text!r} | reused {gen.reused_tokens} of {gen.prompt_tokens} tokens, "
              f"TTFT {gen.ttft_s:.3f}s")


if __name__ == "__main__":
    main(*sys.argv[1:3])
