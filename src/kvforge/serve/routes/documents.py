"""``POST /v1/kv/documents``: compute and store documents' KV now, so later questions reuse it.

``prefix`` mode stores each document as the context part of a chat prompt (system + user header + document +
separator) through prefix reuse, or, with a ``press``, compressed query-agnostic through document reuse (keyed by
the press, its parameters and ``quant``): each document is a store-only request stepped by the engine with the
others. ``chunks`` mode stores each document as a RAG chunk, keyed by the id a chat request names it by in
``kvforge.chunk_ids`` (its text is stored with its KV), between two steps.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from kvforge.presses.base import Press
from kvforge.request import Request
from kvforge.reuse.base import PromptContext, digest, encode_ids
from kvforge.reuse.document import DocumentReuse, press_spec
from kvforge.reuse.rag import ChunkReuse, RagPrompt, build_prompt, chunk_key
from kvforge.serve import schemas as S
from kvforge.serve.errors import APIError, store_unavailable, stored_or_503
from kvforge.serve.state import Server, get_server
from kvforge.serve.translate import check_quant_name
from kvforge.types import Generation

router = APIRouter()


@router.post("/v1/kv/documents")
async def documents(request: HTTPRequest, server: Server = Depends(get_server)) -> Response:  # noqa: B008
    req = await server.parse(request, S.DocumentsRequest)
    server.translator.check_model(req.model)
    if req.mode == "chunks":
        data = await _store_chunks(server, request, req)
    else:
        data = await _store_documents(server, request, req)
    if data is None:
        return Response(status_code=499)
    return JSONResponse({"object": "list", "data": data})


async def _store_documents(server: Server, request: HTTPRequest, req: S.DocumentsRequest) -> list[Any] | None:
    features, options = server.features, server.options
    press: Press | None = None
    if req.press is not None or req.quant is not None or req.compression_ratio is not None:
        if req.press is None:
            raise APIError(400, "press, compression_ratio and quant store prefix documents compressed: they need "
                           "mode 'prefix' and a press", param="press")  # fmt: skip
        ratio = options.compression_ratio if req.compression_ratio is None else req.compression_ratio
        press = features.press(req.press, ratio, param="press")
        if req.quant is not None:
            check_quant_name(req.quant, "quant")
    kind = "document" if press is not None else "prefix"
    strategy = server.engine.reuse if kind == options.reuse_kind else None
    if strategy is None:  # storing needs the store: 503 when it is down
        strategy = await server.off_loop(lambda: features.reuse(kind, strict=True))
    requests = await server.off_loop(server.translator.documents, req, strategy, press)
    jobs = server.submit_all(requests)  # all or none: a 429 leaves nothing of this request queued or running
    for job in jobs:
        job.endpoint = "/v1/kv/documents"
    gens = await server.wait_all(request, jobs)
    if gens is None:
        return None
    lost = sum(g.reuse.lost_writes or 0 for g in gens if g is not None and g.reuse is not None)
    if lost:  # 503 unless every entry was kept: never a 200 that names what was not stored
        raise store_unavailable(
            f"the KV store did not keep {lost} of the entries to write (unavailable, full or read-only): nothing is "
            "guaranteed stored; retry later"
        )
    return [_entry(server, r, g, strategy) for r, g in zip(requests, gens, strict=True)]


def _entry(server: Server, request: Request, gen: Generation, strategy: Any) -> dict[str, Any]:
    assert request.encoded is not None
    ids = request.encoded.ids
    entry = {"object": "kv.document", "mode": "prefix", "tokens": len(ids)}
    press, context = request.press, request.encoded.context
    if press is None:
        return {"id": "kvdoc-" + digest("kvforge-doc-id", server.engine.model_id, encode_ids(ids))[:32], **entry}
    assert isinstance(strategy, DocumentReuse) and isinstance(context, PromptContext)
    key = strategy.key(ids, context)
    size = getattr(strategy.store, "stored_size", None)
    return {
        "id": key,
        **entry,
        "press": press_spec(press),
        "compression_ratio": press.ratio(),
        "quant": strategy.quant_of(context),
        "kept_entries": gen.info.get("cache_entries"),
        "stored_bytes": size(key) if size is not None else None,
    }


async def _store_chunks(server: Server, request: HTTPRequest, req: S.DocumentsRequest) -> list[Any] | None:
    engine = server.engine
    strategy: ChunkReuse = await server.off_loop(server.features.chunk_reuse)

    def prepare() -> RagPrompt:  # tokenising: off the model thread
        try:
            prompt = build_prompt(engine.tokenizer, list(req.documents), "?", req.system)
        except ValueError as e:
            raise APIError(400, str(e), param="documents", code="invalid_value") from e
        engine.check_length(len(prompt.ids()))
        return prompt

    prompt: RagPrompt = await server.off_loop(prepare)
    job = server.submit(None, fn=lambda j: stored_or_503(strategy.warm, prompt))  # 503 unless every chunk was kept
    job.endpoint = "/v1/kv/documents"
    if await server.wait(request, job) is None and not job.future.done():
        return None
    return [
        {"id": chunk_key(strategy.model_id, prompt.prefix_ids, chunk), "object": "kv.document", "mode": "chunks",
         "tokens": len(chunk)}
        for chunk in prompt.chunk_ids
    ]  # fmt: skip
