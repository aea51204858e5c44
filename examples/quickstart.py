"""The front page's example: a document compressed once (query-agnostic), stored, and reused by every question.

    python examples/quickstart.py [MODEL] [STORE_URL]   # STORE_URL: memory:// (default), file:///abs/dir, redis://...
"""

from __future__ import annotations

import sys

from kvforge import Document, Engine, Request, load_model
from kvforge.presses import build_press
from kvforge.reuse import DocumentReuse
from kvforge.store import open_store


def main(model_name: str = "smollm2-135m", store_url: str = "memory://") -> None:
    model, tokenizer = load_model(model_name)  # bundled weights, offline
    engine = Engine(model, tokenizer)
    engine.reuse = DocumentReuse(open_store(store_url), engine.model_id)  # any process sharing the store reuses it
    press = build_press("kvzip", compression_ratio=0.75)  # keep 25% of the document's KV
    doc = " ".join(f"Room {i} of the museum holds {i * 3} paintings." for i in range(40))
    for question in ("How many paintings in room 7?", "How many paintings in room 12?"):
        gen = engine.run(Request(Document(doc, question), press=press, query_aware=False, max_new_tokens=16))
        print(f"{gen.text!r} | TTFT {gen.ttft_s:.2f}s, {gen.reused_tokens} of {gen.prompt_tokens} tokens reused")


if __name__ == "__main__":
    main(*sys.argv[1:3])
