"""``kvforge route``: semantic prompt normalisation in front of a vLLM server running kvforge's KV connector."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from kvforge.commands._common import (
    add_http_args,
    check_api_key,
    check_port_free,
    check_store_url,
    connection_options,
)
from kvforge.errors import UserError


def register(sub: Any, bench_sub: Any) -> None:
    p = sub.add_parser(
        "route",
        help="OpenAI-compatible router in front of vLLM: paraphrased prompts rewritten to stored ones (semantic reuse)",
    )
    p.add_argument("--upstream", required=True, help="the vLLM server, e.g. http://127.0.0.1:8000")
    p.add_argument("--store", default=None, help="the store URL the vLLM connector writes (default: kvforge's)")
    p.add_argument("--model", default=None, help="model the upstream serves (default: the first of its /v1/models)")
    p.add_argument("--threshold", type=float, default=None, help="cosine similarity for a hit (default: kvforge's)")
    p.add_argument(
        "--press",
        default=None,
        help="serve chats on documents stored compressed by this press (e.g. kvzip, kvzap; default: only requests "
        "naming kvforge.press); POST /v1/kv/documents stores them",
    )
    p.add_argument("--compression-ratio", type=float, default=0.75, help="fraction of a document's entries removed")
    p.add_argument("--quant", default=None, help="how documents are stored: int8, int4, kvtc, kvtc-b2.2, ...")
    add_http_args(p, port=8200)
    p.add_argument(
        "--upstream-api-key",
        default=os.environ.get("KVFORGE_UPSTREAM_API_KEY"),
        help="key sent to the upstream (default: $KVFORGE_UPSTREAM_API_KEY; none = the client's own header)",
    )
    p.add_argument("--upstream-wait", type=float, default=300.0, help="seconds to wait for the upstream to answer")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")
    p.add_argument("--record-wait", type=float, default=10.0, help="seconds to wait for a missed prompt's blocks")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run_route)


def _served_model(upstream: str, wanted: str | None, wait_s: float, api_key: str | None) -> tuple[str, int | None]:
    """(the model path the upstream serves: its ``/v1/models`` ``root``, its context), waiting for it to start; a
    vLLM release outside the tested range is refused."""
    import httpx

    from kvforge.redact import redact_text, redact_url

    shown = redact_url(upstream)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + wait_s
    announced = False
    while True:
        try:
            answer = httpx.get(f"{upstream.rstrip('/')}/v1/models", headers=headers, timeout=5.0)
            answer.raise_for_status()
            models = answer.json()["data"]
            break
        except (httpx.HTTPError, KeyError, ValueError) as e:
            if time.monotonic() > deadline:
                raise UserError(
                    f"upstream {shown} does not answer /v1/models ({redact_text(str(e))}); is vLLM running there?"
                ) from None
            if not announced:
                print(f"kvforge route: waiting for {shown} (up to {wait_s:g} s, --upstream-wait)", flush=True)
                announced = True
            time.sleep(2.0)
    _check_version(upstream, headers)
    for model in models:
        if wanted is None or wanted in (model.get("id"), model.get("root")):
            length = model.get("max_model_len")
            return str(model.get("root") or model["id"]), length if isinstance(length, int) else None
    names = ", ".join(str(m.get("id")) for m in models)
    raise UserError(f"upstream {shown} does not serve {wanted!r}; it serves: {names}")


def _check_version(upstream: str, headers: dict[str, str]) -> None:
    import httpx

    from kvforge.vllm.settings import check_vllm_version

    try:
        version = httpx.get(f"{upstream.rstrip('/')}/version", headers=headers, timeout=5.0).json()["version"]
    except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
        raise UserError(f"upstream {upstream} does not answer /version ({e}); is it vLLM?") from None
    check_vllm_version(str(version), f"upstream {upstream} runs vLLM")


def run_route(args: argparse.Namespace) -> int:
    check_api_key(args.api_key)
    connections = connection_options(args)  # uvicorn's: read timeouts, connection cap
    check_store_url(args.store)
    if args.press is not None or args.quant is not None:  # names checked before any model or server
        from kvforge.store.base import check_quant
        from kvforge.vllm.client import uniform_press

        if args.press is not None:
            uniform_press(args.press, args.compression_ratio)
        if args.quant is not None:
            try:
                check_quant(args.quant)
            except ValueError as e:
                raise UserError(f"--quant: {e}") from None
    check_port_free(args.host, args.port)
    if args.threshold is not None and not -1.0 <= args.threshold <= 1.0:
        raise UserError(f"--threshold is a cosine similarity in [-1, 1], got {args.threshold}")
    try:
        import uvicorn

        from kvforge.route import create_router_app
    except ImportError as e:
        raise UserError(f"the router needs the serve extra: pip install 'kvforge[serve,semantic]' ({e})") from e
    from kvforge.paths import default_store_url
    from kvforge.redact import redact_url
    from kvforge.route import build_documents, build_normalizer
    from kvforge.store import open_store

    store_url = args.store or default_store_url()
    store = open_store(store_url)
    model, max_model_len = _served_model(args.upstream, args.model, args.upstream_wait, args.upstream_api_key)
    normalizer = build_normalizer(store, model, threshold=args.threshold, store_url=redact_url(store_url))
    documents = build_documents(store, model, args.press, args.compression_ratio, args.quant, max_model_len)
    app = create_router_app(
        normalizer,
        args.upstream,
        upstream_api_key=args.upstream_api_key,
        api_key=args.api_key,
        timeout_s=args.timeout,
        max_body_bytes=args.max_body_bytes,
        record_wait_s=args.record_wait,
        documents=documents,
    )
    print(f"kvforge route: http://{args.host}:{args.port}/v1 -> {redact_url(args.upstream)} ({model})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, **connections)
    return 0
