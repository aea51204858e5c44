"""Answer questions over retrieved documents, reusing each document's stored KV (RAG chunk reuse with CacheClip).

python examples/rag_chunks.py [MODEL] [STORE_URL]   # STORE_URL: memory:// (default), file:///abs/dir, redis://...
"""

from __future__ import annotations

import sys

from kvforge import Chunks, Engine, Request, load_model
from kvforge.reuse.rag import ChunkReuse
from kvforge.store import open_store


def main(model_name: str = "smollm2-135m", store_url: str = "memory://") -> None:
    model, tokenizer = load_model(model_name)
    engine = Engine(model, tokenizer)
    engine.reuse = ChunkReuse(model, tokenizer, open_store(store_url), engine.model_id, "cacheclip", 0.2)
    docs = [f"Lighthouse {i} stands on cape {i} and has {i + 3} lamps." for i in range(6)]
    # the second question gets the documents in another order: every chunk is still found stored
    for question, order in (("How many lamps on cape 2?", docs), ("How many lamps on cape 4?", docs[::-1])):
        gen = engine.run(Request(Chunks(order, question), max_new_tokens=12))
        assert gen.reuse is not None and gen.reuse.chunks is not None
        chunks = gen.reuse.chunks
        print(
            f"{question} -> {gen.text!r} | reused {gen.reused_tokens} of {gen.prompt_tokens} tokens, "
            f"recomputed {chunks.recomputed_tokens}, chunk misses {chunks.chunk_misses}, TTFT {gen.ttft_s:.3f}s"
        )


if __name__ == "__main__":
    main(*sys.argv[1:3])
