"""``kvforge generate`` (streamed answer on stdout, timings on stderr) and ``kvforge bench decode``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvforge.commands._common import (
    add_model_args,
    check_store_url,
    input_file,
    load,
    non_negative_float,
    positive_int,
    prefill_progress,
    ratio,
    read_text_file,
)
from kvforge.errors import UserError
from kvforge.names import REUSE_NAMES


def register(sub: Any, bench_sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text (stdout) with timings (stderr)")
    add_model_args(p)
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--prompt-file", type=input_file,
                   help="read the prompt from a file (appended after --prompt if both)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence at every step (baseline)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chunk-size", type=positive_int, default=512, help="prefill chunk size in tokens")
    p.add_argument("--window", type=positive_int, default=None, help="sliding-window cache: keep the last N tokens")
    p.add_argument("--num-sink", type=int, default=4, help="with --window: first tokens always kept")
    p.add_argument("--press", default=None, help="compression method (see `kvforge presses`)")
    p.add_argument("--compression-ratio", type=ratio, default=0.5, help="fraction of KV entries removed")
    p.add_argument("--query-agnostic", action="store_true", help="compress the prompt before the question is known "
                   "(with --reuse prefix: the compressed --prompt-file is stored, later questions reuse it)")
    p.add_argument("--quant", default=None, help="with --press and --reuse: storage quantisation of the compressed "
                   "document (none, int8, int4, int2; default: the store's)")
    p.add_argument("--store", default=None, help="KV store URL for --reuse (memory://, file:///dir, redis://host:port/db,"
                   " comma-separated = tiers); default: the disk store in kvforge's cache folder")
    p.add_argument("--reuse", choices=REUSE_NAMES, default=None, help="reuse stored KV of earlier prompts")
    p.add_argument("--semantic-mode", choices=["canonical", "context"], default="canonical",
                   help="canonical: answer a similar stored prompt; context: reuse the document (--prompt-file), "
                   "prefill the question (--prompt) exactly")
    add_semantic_args(p)
    p.set_defaults(func=run_generate)

    b = bench_sub.add_parser("decode", help="decode tokens/s: cached vs uncached vs transformers' generate")
    add_model_args(b)
    b.add_argument("--max-new-tokens", type=positive_int, default=200)
    b.add_argument("--prompt", default="Write a long story about a lighthouse keeper and the sea.")
    b.add_argument("--uncached-tokens", type=positive_int, default=None, help="steps for the slow baseline")
    b.add_argument("--repeats", type=positive_int, default=1)
    b.set_defaults(func=run_bench_decode)


def add_semantic_args(p: Any) -> None:
    """Semantic reuse's policy options (``kvforge generate`` and ``kvforge serve``)."""
    p.add_argument("--max-error", type=float, default=None, help="semantic reuse: the tolerated share of wrong "
                   "candidates served (default 0.01; the threshold is learned per entry, docs/reuse.md)")
    p.add_argument("--threshold", type=float, default=None, help="semantic reuse: a fixed minimum cosine similarity "
                   "instead of --max-error")
    p.add_argument("--verify-ratio", type=float, default=None, help="semantic reuse: share of lookups also answered "
                   "the other way after the answer, to learn from (default 0.05; 0 = never)")


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

        press = build_press(args.press, compression_ratio=args.compression_ratio)
    if args.quant is not None:
        from kvforge.store.quant import parse_scheme

        if not (args.press and args.reuse):
            raise UserError("--quant sets how a compressed document is stored: it needs --press and --reuse prefix")
        try:
            parse_scheme(args.quant)
        except ValueError as e:
            raise UserError(str(e)) from e
    store = None
    if args.reuse:  # combinations, the store URL and the store's server are checked before the model loads
        from kvforge.commands.bench_reuse import attach_reuse, check_reuse_args

        store = check_reuse_args(args)
    else:
        from kvforge.commands.bench_reuse import check_semantic_args

        check_semantic_args(args)
        check_store_url(args.store)
    model, tokenizer = load(args)
    engine = Engine(model, tokenizer, chunk_size=args.chunk_size, window=args.window, num_sink=args.num_sink)
    engine.on_prefill_chunk = prefill_progress()
    if args.reuse:
        attach_reuse(engine, args, store)
    ids = engine.encode_chat(text, raw=args.raw)
    engine.check_length(len(ids), args.max_new_tokens)
    if args.no_cache:
        return _generate_uncached(engine, ids, args.max_new_tokens, decode_uncached)
    stream = TextStream(tokenizer, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    if engine.reuse is not None and press is not None:  # checked: query-agnostic, a document and a question
        gen = engine.answer(read_text_file(args.prompt_file), args.prompt, press=press, query_aware=False,
                            max_new_tokens=args.max_new_tokens, sampling=sampling, stop=args.stop, quant=args.quant,
                            on_token=stream)
    elif engine.reuse is not None and args.semantic_mode == "context" and args.prompt and args.prompt_file:
        gen = engine.answer(read_text_file(args.prompt_file), args.prompt, max_new_tokens=args.max_new_tokens,
                            sampling=sampling, stop=args.stop)
        sys.stdout.write(gen.text)
    elif engine.reuse is not None:
        gen = engine.generate(text, args.max_new_tokens, sampling=sampling, stop=args.stop, raw=args.raw,
                              on_token=stream)
    elif args.query_agnostic and press is not None:
        # the document (--prompt-file) is compressed before the question (--prompt) is seen; with one of them only,
        # its last line is the question
        if args.prompt and args.prompt_file:
            context, question = read_text_file(args.prompt_file), args.prompt
        else:
            context, _, question = text.rpartition("\n")
        gen = engine.answer(context, question, press=press, query_aware=False, max_new_tokens=args.max_new_tokens,
                            sampling=sampling, stop=args.stop)
        sys.stdout.write(gen.text)
    else:
        gen = engine.generate(ids, args.max_new_tokens, sampling=sampling, stop=args.stop, press=press,
                              on_token=stream)
    sys.stdout.write("\n")
    sys.stdout.flush()
    extra = f" | press {args.press} ratio {args.compression_ratio}" if press is not None else ""
    if engine.reuse is not None:
        from kvforge.commands.bench_reuse import describe_reuse

        extra += describe_reuse(gen)
    print(
        f"[kvforge] prompt {gen.prompt_tokens} tok | TTFT {gen.ttft_s:.3f}s | {len(gen.token_ids)} tok at "
        f"{gen.tokens_per_s:.1f} tok/s | cache {gen.cache_bytes / 2**20:.1f} MiB{extra}",
        file=sys.stderr,
    )
    return 0


def _generate_uncached(engine: Any, ids: list[int], max_new_tokens: int, decode_uncached: Any) -> int:
    import time

    start = time.perf_counter()
    tokens, _ = decode_uncached(engine.model, ids, max_new_tokens, engine.eos_token_ids)
    elapsed = time.perf_counter() - start
    print(engine.tokenizer.decode(tokens, skip_special_tokens=True))
    print(f"[kvforge] no cache | prompt {len(ids)} tok | {len(tokens)} tok in {elapsed:.2f}s "
          f"({len(tokens) / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0


def run_bench_decode(args: argparse.Namespace) -> int:
    import json

    from kvforge.bench import bench_decode

    model, tokenizer = load(args)
    result = bench_decode(model, tokenizer, args.prompt, args.max_new_tokens, args.uncached_tokens, args.repeats)
    result["model"] = args.model
    print(json.dumps(result))
    return 0
