"""TTFT of a new question on a stored document, through the server (in this process, FastAPI's TestClient).

The document (the first ``--doc-tokens`` tokens of the bundled Moby-Dick excerpt) is stored first, by
``POST /v1/kv/documents`` or by a first question; then each further question is sent as a chat completion with
``max_tokens=1``. One JSON line per question: ``cached_tokens``, ``prompt_tokens``, the server's TTFT (from the start
of the request's work to its first token) and the request's wall time. Only public APIs are used, so the same file
measures any kvforge revision (point ``PYTHONPATH`` at its ``src``).

    PYTHONPATH=src python benchmarks/prefix_question.py --model smollm2-135m --doc-tokens 3000 --store memory://
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
QUESTIONS = [
    "Summarise the passage in one sentence.",
    "Who is the narrator?",
    "Name one ship mentioned above.",
    "Is the sea described as calm?",
    "List two characters.",
]


def document(tokenizer, num_tokens: int) -> str:  # type: ignore[no-untyped-def]
    from importlib.resources import files

    text = (files("kvforge") / "data" / "haystack_gutenberg" / "moby_dick_excerpt.txt").read_text()
    ids = tokenizer(text, add_special_tokens=False).input_ids[:num_tokens]
    return str(tokenizer.decode(ids))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--doc-tokens", type=int, default=3000)
    parser.add_argument("--store", default=None, help="store URL (default: a fresh file:// folder)")
    parser.add_argument("--stored-by", choices=["documents", "question"], default="documents")
    parser.add_argument("--questions", type=int, default=3, help="questions after the document is stored")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--label", default="", help="free text copied into every line (e.g. the revision)")
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_question.jsonl")
    args = parser.parse_args(argv)

    import torch
    from fastapi.testclient import TestClient

    from kvforge.engine import Engine
    from kvforge.model import load_model
    from kvforge.serve import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    engine = Engine(model, tokenizer)
    doc = document(tokenizer, args.doc_tokens)
    store = args.store or f"file://{tempfile.mkdtemp(prefix='kvforge-prefix-question-')}"
    app = create_app(engine, model_name=args.model, store_url=store, reuse="prefix")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with TestClient(app) as client, args.out.open("a") as out:

        def ask(question: str) -> tuple[dict, float]:
            body = {
                "model": args.model,
                "messages": [{"role": "user", "content": f"{doc}\n\n{question}"}],
                "max_tokens": 1,
                "temperature": 0,
            }
            start = time.perf_counter()
            r = client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            return r.json(), time.perf_counter() - start

        if args.stored_by == "documents":
            client.post("/v1/kv/documents", json={"documents": [doc]}).raise_for_status()
        else:
            ask(QUESTIONS[0])  # its prompt (document + question) is stored
        for i, question in enumerate(QUESTIONS[1 : args.questions + 1], start=1):
            reply, wall = ask(question)
            row = {
                "bench": "prefix_question",
                "label": args.label,
                "model": args.model,
                "store": store.split("://")[0],
                "stored_by": args.stored_by,
                "question_idx": i,
                "doc_tokens": len(engine.encode_qa(doc, question)[0]),
                "prompt_tokens": reply["usage"]["prompt_tokens"],
                "cached_tokens": reply["usage"]["prompt_tokens_details"]["cached_tokens"],
                "ttft_s": reply["kvforge"]["ttft_s"],
                "wall_s": round(wall, 4),
                "threads": torch.get_num_threads(),
            }
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
