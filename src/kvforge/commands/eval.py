"""``kvforge eval``: score methods x compression ratios on a JSONL file or a built-in task; write results + report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvforge.commands._common import input_file
from kvforge.errors import UserError
from kvforge.names import RAG_STRATEGY_NAMES

if TYPE_CHECKING:
    from kvforge.engine import Engine


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def haystack_file(text: str) -> Path:
    """An existing file, optionally ``#row_id`` (one row of a JSONL collection): checked while parsing."""
    file, sep, row = text.rpartition("#") if "#" in Path(text).name else (text, "", "")
    return Path(str(input_file(file)) + sep + row)


def register(sub: Any, bench_sub: Any) -> None:
    p = sub.add_parser("eval", help="evaluate KV-cache methods x budgets on a JSONL file or a built-in task")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", type=input_file, help="JSONL examples (see docs/eval.md for the format)")
    src.add_argument("--task", help="built-in task(s), comma-separated and interleaved: needle, needle-narrative, "
                     "needle-multi-narrative, needle-docs (RAG), "
                     "ruler, ruler-mk|mv|mq|vt|cwe, longbench-qa, longbench-summ, longbench, leval, squad, musique, "
                     "hub:<name>")  # fmt: skip
    p.add_argument("--model", required=True, help="smollm2-135m | gemma3-270m | a model folder | a .gguf file")
    p.add_argument("--methods", type=_names, default=["full", "snapkv"], help="comma-separated press names, "
                   "options as name:key=value (kvzip:pool=3; `kvforge presses`)")  # fmt: skip
    p.add_argument("--compression-ratios", type=_floats, default=[0.5, 0.75, 0.9], help="fractions removed")
    p.add_argument("--query-agnostic", action="store_true", help="compress the context alone, question on top")
    p.add_argument("--out", type=Path, required=True, help="output folder (a re-run resumes it)")
    p.add_argument("--limit", type=int, help="first N examples only")
    p.add_argument("--fidelity", action="store_true", help="add answer NLL, KL, top-1 agreement, needle kept")
    p.add_argument("--max-new-tokens", type=int, help="cap on every example's answer length")
    p.add_argument("--data-dir", type=Path, help="shared evaluation data (default: kvforge.paths.default_data_dir())")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated tasks")
    p.add_argument("--lengths", type=_ints, default=[1024, 2048, 4096], help="needle/RULER context sizes (tokens)")
    p.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths in [0, 1]")
    p.add_argument("--num-samples", type=int, default=1, help="needle/RULER samples per length x depth")
    p.add_argument(
        "--haystack",
        type=haystack_file,
        action="append",
        help="haystack text/JSONL file (repeatable; books.jsonl#ID reads the JSONL row whose id is ID)",
    )
    p.add_argument("--max-context", type=int, help="converted tasks: cut the middle of longer contexts (tokens)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda when available)")
    p.add_argument("--dtype", help="float32, bfloat16, float16")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk size (tokens)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--rag",
        type=_names,
        help=f"RAG strategies instead of presses, from {','.join(RAG_STRATEGY_NAMES[1:])} "
        "(examples' chunks are reused; see docs/rag.md)",
    )
    p.add_argument("--recompute-ratios", type=_floats, default=[0.2], help="RAG: share of context tokens recomputed")
    p.add_argument("--aux-model", help="RAG: an extra CacheClip auxiliary model (the model itself always runs)")
    p.add_argument(
        "--separate-prefill",
        action="store_true",
        help="prefill every method separately (default: "
        "one prefill per example, compressed by each method; same rows, TTFT from per-stage clocks)",
    )
    p.add_argument(
        "--store-once",
        action="store_true",
        help="store once, ask many: each document compressed "
        "(query-agnostic) and stored once per method x ratio x --quants, every question answered from the "
        "store by a fresh engine (rows stored-<method>+<quant>)",
    )
    p.add_argument(
        "--quants",
        type=_names,
        default=["none", "int8", "int4"],
        help="--store-once: storage codecs (none, int8, int4, int2, kvtc, kvtc-b<bits>, kvtc-o<outlier percent>)",
    )
    p.add_argument("--store", default=None, help="--store-once: where documents are stored (default memory://; with "
                   "file:///dir a later run, another process, loads what an earlier one stored)")
    p.add_argument("--semantic", type=_names, help="semantic-reuse rows instead of presses, one per policy: default "
                   "(bounded error 0.01), verifier (the default with the learned verifier), paper (fixed 0.7, "
                   "no guards), max-error=X, threshold=X; with --task "
                   "semantic / semantic-long (docs/reuse.md)")
    p.add_argument("--report-only", action="store_true", help="rebuild summary, plots and report from results.jsonl")
    p.set_defaults(func=run, check=_check)


def load_engine(args: argparse.Namespace) -> Any:
    """The engine for ``--model`` (a separate function so tests can swap in a tiny one)."""
    from kvforge.commands._common import load
    from kvforge.engine import Engine

    model, tokenizer = load(args)
    return Engine(model, tokenizer, chunk_size=args.chunk_size)


def _check(args: argparse.Namespace) -> None:
    if args.limit is not None and args.limit < 1:
        raise UserError("--limit must be >= 1")
    if any(not 0.0 < r < 1.0 for r in args.compression_ratios) or not args.compression_ratios:
        raise UserError(f"--compression-ratios must lie in (0, 1), got {args.compression_ratios}")
    if not args.methods:
        raise UserError("--methods is empty")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be >= 1")
    if args.store is not None:
        if not args.store_once:
            raise UserError("--store applies to --store-once")
        from kvforge.commands._common import check_store_url

        check_store_url(args.store)
    if getattr(args, "semantic", None):
        _check_semantic(args)
    if args.rag:
        _check_rag(args)
    elif args.aux_model:
        raise UserError("--aux-model only applies to --rag cacheclip")


def _check_semantic(args: argparse.Namespace) -> None:
    """Semantic policies, before any model loads; options for other row kinds are refused, not ignored."""
    from kvforge.eval.semantic import check_spec

    for spec in args.semantic:
        try:
            check_spec(spec)
        except ValueError as e:
            raise UserError(str(e)) from e
    for flag, value in (("--rag", args.rag), ("--store-once", args.store_once), ("--query-agnostic",
                                                                                  args.query_agnostic)):  # fmt: skip
        if value:
            raise UserError(f"--semantic does not combine with {flag}")


def _check_rag(args: argparse.Namespace) -> None:
    """RAG options, before any model loads; options that only apply to presses are refused, not ignored."""
    from kvforge.names import check_rag_strategy

    for name in args.rag:
        check_rag_strategy(name)
    if not args.recompute_ratios or any(not 0.0 <= r <= 1.0 for r in args.recompute_ratios):
        raise UserError(f"--recompute-ratios must lie in [0, 1], got {args.recompute_ratios}")
    if args.query_agnostic:
        raise UserError("--query-agnostic applies to presses, not to --rag")
    if args.aux_model and "cacheclip" not in args.rag:
        raise UserError("--aux-model only applies to --rag cacheclip")


def examples_for(args: argparse.Namespace, tokenizer: Any) -> list[Any]:
    """The examples of ``--data`` or ``--task`` (task lengths measured with ``tokenizer``), limited."""
    from kvforge.eval.data import read_examples
    from kvforge.eval.tasks import TaskConfig, build_task
    from kvforge.eval.tasks.base import interleave
    from kvforge.paths import default_data_dir

    if args.data is not None:
        return read_examples(args.data, limit=args.limit)
    try:
        config = TaskConfig(
            data_dir=args.data_dir or default_data_dir(),
            tokenizer=tokenizer,
            seed=args.seed,
            lengths=tuple(args.lengths),
            depths=tuple(args.depths),
            num_samples=args.num_samples,
            haystack=tuple(args.haystack) if args.haystack else None,
            max_context_size=args.max_context,
        )
    except ValueError as e:
        raise UserError(str(e)) from e
    examples = interleave([build_task(name, config) for name in _names(args.task)])
    return examples[: args.limit] if args.limit else examples


def run(args: argparse.Namespace) -> int:
    from kvforge.eval.data import read_examples
    from kvforge.eval.runner import FULL, EvalRunner, press_trial, press_trials
    from kvforge.eval.tasks import check_task_data
    from kvforge.paths import default_data_dir

    _check(args)
    mode = "query-agnostic" if args.query_agnostic or args.store_once else "query-aware"
    if args.store_once:
        mode = "store-once (query-agnostic)"
    if getattr(args, "semantic", None):
        mode = "semantic reuse"
    if args.report_only:
        return _report(args, mode)
    if args.data is not None:
        read_examples(args.data, limit=args.limit)  # a malformed file fails before the model loads
    else:
        check_task_data(_names(args.task), args.data_dir or default_data_dir())  # before the model loads
    query_aware = not args.query_agnostic
    trials = None if args.rag else press_trials(args.methods, args.compression_ratios, query_aware=query_aware)
    if args.store_once:
        if args.rag:
            raise UserError("--store-once stores compressed documents: it does not combine with --rag")
        from kvforge.eval.stored import stored_trials

        try:
            trials = [press_trial(FULL, 0.0, query_aware=False)]
            trials += stored_trials(args.methods, args.compression_ratios, args.quants, args.store or "memory://")
        except ValueError as e:
            raise UserError(str(e)) from e
    if getattr(args, "semantic", None):
        from kvforge.eval.semantic import semantic_trials

        trials = semantic_trials(args.semantic)
    engine = load_engine(args)  # names, options and data were checked above: a mistake costs no model load
    if args.rag:
        trials = _rag_trials(args, engine)
    examples = examples_for(args, engine.tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    _record_examples(examples, args.out / "examples.jsonl")
    runner = EvalRunner(
        engine, trials, args.out, run_info=run_settings(args, engine, mode), provenance=_provenance(),
        with_fidelity=args.fidelity, max_new_tokens=args.max_new_tokens, share_prefill=not args.separate_prefill,
    )  # fmt: skip
    runner.run(examples, progress=not args.no_progress)
    if getattr(args, "semantic", None):
        _semantic_pairs(args)
    return _report(args, mode)


def _semantic_pairs(args: argparse.Namespace) -> None:
    """Hit and false-hit rates of each policy on the labelled pairs (shared data when present, shipped pairs)."""
    import json

    from kvforge.eval.semantic import default_embedder
    from kvforge.eval.semantic_report import pair_rates
    from kvforge.paths import cache_dir, default_data_dir

    embedder = default_embedder()
    rates = pair_rates(args.semantic, args.data_dir or default_data_dir(), embedder, cache_dir() / "semantic")
    (args.out / "semantic_pairs.json").write_text(json.dumps(rates, indent=2) + "\n")


def run_settings(args: argparse.Namespace, engine: Engine, mode: str) -> dict[str, Any]:
    """Every setting that changes the rows of a run (``run.json``'s ``settings``: a resume must match them). Methods,
    ratios and ``--limit`` are not among them: rows are keyed by example, method and ratio, so a resume may add some.
    ``--fidelity``, ``--max-new-tokens`` and ``--separate-prefill`` are added by the runner."""

    def path(p: Any) -> str | None:
        return None if p is None else str(Path(p).resolve())

    return {
        "model": args.model,
        "model_id": engine.model_id,  # the weights, tokenizer and dtype (kvforge.model.model_fingerprint)
        "device": str(engine.model.device),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "mode": mode,
        "chunk_size": args.chunk_size,
        "data": path(args.data),
        "task": args.task,
        "seed": args.seed if args.task else None,
        "lengths": list(args.lengths) if args.task else None,
        "depths": list(args.depths) if args.task else None,
        "num_samples": args.num_samples if args.task else None,
        "haystack": [path(h) for h in args.haystack] if args.haystack else None,
        "max_context": args.max_context,
    }


def _provenance() -> dict[str, Any]:
    """Who made the rows: versions, git sha, the command line (one entry per run that adds rows)."""
    from kvforge.provenance import versions

    return versions() | {"command": _command()}


def _command() -> str:
    from kvforge.redact import redact_argv

    is_cli = bool(sys.argv) and Path(sys.argv[0]).name in ("kvforge", "__main__.py", "cli.py")
    return "kvforge " + redact_argv(sys.argv[1:]) if is_cli else ""  # no secret in saved results


def _rag_trials(args: argparse.Namespace, engine: Engine) -> list[Any]:
    """RAG strategies as trials (ratio column = recompute ratio), CacheClip also with ``--aux-model``."""
    from kvforge.eval.runner import chunk_trials
    from kvforge.reuse.rag import ChunkReuse

    aux = {}
    if args.aux_model:
        from kvforge.model import load_model

        aux[args.aux_model] = ChunkReuse(*load_model(args.aux_model, device=args.device, dtype=args.dtype))
    return chunk_trials(args.rag, args.recompute_ratios, aux)


def _record_examples(examples: list[Any], path: Path) -> None:
    """Keep the exact examples run in ``path`` (a re-run adds the ones not there yet)."""
    from kvforge.eval.data import read_examples, write_examples

    old = read_examples(path) if path.is_file() and path.stat().st_size else []
    known = {e.id for e in old}
    write_examples(old + [e for e in examples if e.id not in known], path)


def _report(args: argparse.Namespace, mode: str) -> int:
    from kvforge.eval.report import write_all
    from kvforge.eval.runner import load_rows

    rows = load_rows(args.out / "results.jsonl")
    if not rows:
        raise UserError(f"no results in {args.out}/results.jsonl")
    from kvforge.eval.runner import read_run_info

    info = read_run_info(args.out)
    settings = info["settings"]
    # the commands that made the rows; a run.json of kvforge 0.1.0 has none, and --report-only made no row
    commands = [r["command"] for r in info["runs"] if r.get("command")] or ([] if args.report_only else [_command()])
    summary = write_all(args.out, rows, settings.get("model", args.model), settings.get("mode", mode),
                        [c for c in commands if c])  # fmt: skip
    from kvforge.eval.semantic_report import write_semantic_report

    if write_semantic_report(args.out, rows, [c for c in commands if c]) is not None:
        print(f"wrote {args.out}/semantic.md (Table-1 rows, false-hit rates, TTFT by length)")
    has_all = any(r["task"] == "all" for r in summary["rows"])
    for row in summary["rows"]:
        if not has_all or row["task"] == "all":
            num = lambda v, scale=1.0: "-" if v is None else f"{scale * v:.1f}"  # noqa: E731
            print(f"{row['task']:>14} {row['method']:>22} ratio={row['compression_ratio']:.2f} n={row['n']} "
                  f"score={num(row['score'])} normalized={num(row['normalized'])} "
                  f"ttft_ms={num(row['ttft_s'], 1000)}")  # fmt: skip
    print(f"wrote {args.out}/results.jsonl, summary.json, summary.csv, report.md and plots")
    return 0
