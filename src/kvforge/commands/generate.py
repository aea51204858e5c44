"""``kvforge generate`` (streamed answer on stdout, timings on stderr) and ``kvforge bench decode``."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from kvforge.commands._common import (
    add_model_args,
    check_store_url,
    input_file,
    load,
    positive_int,
    prefill_progress,
    ratio,
    read_text_file,
    temperature,
)
from kvforge.commands._reuse import add_semantic_args, check_semantic_args
from kvforge.errors import UserError
from kvforge.names import REUSE_NAMES

if TYPE_CHECKING:
    from kvforge.engine import Engine


def register(sub: Any, bench_sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text (stdout) with timings (stderr)")
    add_model_args(p)
    p.add_argument("--prompt", help="prompt text")
    p.add_argument(
        "--prompt-file", type=input_file, help="read the prompt from a file (appended after --prompt if both)"
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence at every step (baseline)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy, else at least 1e-5")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chunk-size", type=positive_int, default=512, help="prefill chunk size in tokens")
    p.add_argument("--window", type=positive_int, default=None, help="sliding-window cache: keep the last N tokens")
    p.add_argument("--num-sink", type=int, default=4, help="with --window: first tokens always kept")
    p.add_argument("--press", default=None, help="compression method, options as name:key=value "
                   "(see `kvforge presses`)")  # fmt: skip
    p.add_argument("--compression-ratio", type=ratio, default=0.5, help="fraction of KV entries removed")
    p.add_argument(
        "--kv-budget",
        type=positive_int,
        default=None,
        help="with --press: keep this many entries per layer and KV head of the prompt instead of a ratio",
    )
    p.add_argument(
        "--decode-budget",
        type=positive_int,
        default=None,
        help="keep at most this many entries per "
        "layer and KV head while generating (a decoding-time press; the prompt too without --press)",
    )
    p.add_argument(
        "--decode-interval",
        type=positive_int,
        default=16,
        help="with --decode-budget: cut every N steps (the cache holds at most budget + N - 1 entries between steps)",
    )
    p.add_argument(
        "--query-agnostic",
        action="store_true",
        help="compress the prompt before the question is known "
        "(with --reuse document: the compressed --prompt-file is stored, later questions reuse it)",
    )
    p.add_argument(
        "--quant",
        default=None,
        help="with --press and --reuse document: storage quantisation of the "
        "compressed document (none, int8, int4, int2; default: the store's)",
    )
    p.add_argument(
        "--store",
        default=None,
        help="KV store URL for --reuse (memory://, file:///dir, redis://host:port/db,"
        " comma-separated = tiers); default: the disk store in kvforge's cache folder",
    )
    p.add_argument("--reuse", choices=REUSE_NAMES, default=None, help="reuse stored KV of earlier prompts")
    p.add_argument(
        "--semantic-mode",
        choices=["canonical", "context"],
        default="canonical",
        help="canonical: answer a similar stored prompt; context: reuse the document (--prompt-file), "
        "prefill the question (--prompt) exactly",
    )
    add_semantic_args(p)
    p.set_defaults(func=run_generate)

    b = bench_sub.add_parser("decode", help="decode tokens/s: cached vs uncached vs transformers' generate")
    add_model_args(b)
    b.add_argument("--max-new-tokens", type=positive_int, default=200)
    b.add_argument("--prompt", default="Write a long story about a lighthouse keeper and the sea.")
    b.add_argument("--uncached-tokens", type=positive_int, default=None, help="steps for the slow baseline")
    b.add_argument("--repeats", type=positive_int, default=1)
    b.set_defaults(func=run_bench_decode)


def _prompt(args: argparse.Namespace) -> str:
    parts = []
    if args.prompt:
        parts.append(args.prompt)
    if args.prompt_file:
        parts.append(read_text_file(args.prompt_file))
    if not parts:
        raise UserError("give --prompt or --prompt-file")
    return "\n\n".join(parts)


def run_generate(args: argparse.Namespace) -> int:
    from kvforge.decode import SamplingParams, decode_uncached
    from kvforge.engine import Engine, TextStream

    text = _prompt(args)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    press = None
    if args.press:  # a wrong name or option fails before the model loads
        from kvforge.presses import build_press

        press = build_press(args.press, compression_ratio=args.compression_ratio, kv_budget=args.kv_budget)
    elif args.kv_budget is not None:
        raise UserError("--kv-budget sets a prompt press's budget: it needs --press")
    decoding = None
    if args.decode_budget is not None:
        from kvforge.presses import DecodingPress

        try:
            decoding = DecodingPress(budget=args.decode_budget, interval=args.decode_interval)
        except ValueError as e:
            raise UserError(f"--decode-budget: {e}") from e
    if args.quant is not None:
        from kvforge.store.quant import parse_scheme

        if not (args.press and args.reuse):
            raise UserError("--quant sets how a compressed document is stored: it needs --press and --reuse document")
        try:
            parse_scheme(args.quant)
        except ValueError as e:
            raise UserError(str(e)) from e
    store = None
    if args.reuse:  # combinations, the store URL and the store's server are checked before the model loads
        from kvforge.commands._reuse import check_reuse_args

        store = check_reuse_args(args)
    else:
        check_semantic_args(args)
        check_store_url(args.store)
    model, tokenizer = load(args)
    engine = Engine(model, tokenizer, chunk_size=args.chunk_size, window=args.window, num_sink=args.num_sink,
                    decoding_press=decoding)  # fmt: skip
    if press is not None:
        from kvforge.kvzap_train import ensure_trained

        ensure_trained(press, model, tokenizer)  # a learned press's scorer, trained once per model
    if args.reuse:
        from kvforge.commands._reuse import attach_reuse

        attach_reuse(engine, args, store)
    if args.no_cache:
        ids = engine.encode_chat(text, raw=args.raw)
        engine.check_length(len(ids), args.max_new_tokens)
        return _generate_uncached(engine, ids, args.max_new_tokens, decode_uncached)
    stream = TextStream(tokenizer, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    request = _request(args, text, press, on_token=stream)
    request.sampling, request.on_prefill = sampling, prefill_progress()
    gen = engine.run(request)
    sys.stdout.write("\n")
    sys.stdout.flush()
    extra = f" | press {args.press} ratio {args.compression_ratio}" if press is not None else ""
    if engine.reuse is not None:
        from kvforge.commands._reuse import describe_reuse

        extra += describe_reuse(gen)
    print(
        f"[kvforge] prompt {gen.prompt_tokens} tok | TTFT {gen.ttft_s:.3f}s | {len(gen.token_ids)} tok at "
        f"{gen.tokens_per_s:.1f} tok/s | cache {gen.cache_bytes / 2**20:.1f} MiB{extra}",
        file=sys.stderr,
    )
    engine.run_pending()  # a semantic lookup sampled for verification: checked now, its outcome stored for others
    return 0


def _request(args: argparse.Namespace, text: str, press: Any, on_token: Any) -> Any:
    """The request the flags describe: a document (--prompt-file) + question (--prompt) when it is compressed
    query-agnostic or reused as a document, else the whole prompt."""
    from kvforge.request import Document, Request

    both = bool(args.prompt and args.prompt_file)
    as_document = (args.query_agnostic and press is not None) or (
        both and args.reuse is not None and (args.reuse == "document" or args.semantic_mode == "context")
    )
    prompt: Any = text
    if as_document and both:
        prompt = Document(read_text_file(args.prompt_file), args.prompt)
    elif as_document:  # one of them only: its last line is the question
        context, _, question = text.rpartition("\n")
        prompt = Document(context, question)
    return Request(prompt, args.max_new_tokens, stop=args.stop, raw=args.raw, press=press,
                   query_aware=not args.query_agnostic, quant=args.quant, on_token=on_token)  # fmt: skip


def _generate_uncached(engine: Engine, ids: list[int], max_new_tokens: int, decode_uncached: Any) -> int:
    import time

    start = time.perf_counter()
    tokens, _ = decode_uncached(engine.model, ids, max_new_tokens, engine.eos_token_ids)
    elapsed = time.perf_counter() - start
    print(engine.tokenizer.decode(tokens, skip_special_tokens=True))
    print(
        f"[kvforge] no cache | prompt {len(ids)} tok | {len(tokens)} tok in {elapsed:.2f}s "
        f"({len(tokens) / elapsed:.1f} tok/s)",
        file=sys.stderr,
    )
    return 0


def run_bench_decode(args: argparse.Namespace) -> int:
    import json

    from kvforge.bench import bench_decode

    model, tokenizer = load(args)
    result = bench_decode(model, tokenizer, args.prompt, args.max_new_tokens, args.uncached_tokens, args.repeats)
    result["model"] = args.model
    print(json.dumps(result))
    return 0
