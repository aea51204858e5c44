"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kvforge.errors import UserError, redis_unavailable


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def temperature(text: str) -> float:
    """A sampling temperature: 0 (greedy) or at least 1e-5 (:func:`kvforge.sampling.check_temperature`)."""
    from kvforge.sampling import check_temperature

    try:
        return check_temperature(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def ratio(text: str) -> float:
    """A fraction in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def input_file(text: str) -> Path:
    """An existing, readable file (argparse type): a missing one fails when the arguments are parsed, before any
    heavy import or model load."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"file not found: {text}")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"not a file: {text}")
    try:
        with path.open("rb"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {e.strerror or e}") from None
    return path


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="built-in name, model folder or .gguf file")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 CPU, bf16 CUDA)")


def check_names(args: argparse.Namespace) -> None:
    """Check every name in ``args`` (press, methods, task, RAG strategies, dtype, model) against
    :mod:`kvforge.names`: a typo fails in a fraction of a second with "did you mean", before torch is imported.
    The command's own option check (``args.check``, set by the subcommand; no torch) runs before the model's, so that
    a wrong press, task or option is named even when the model is a placeholder."""
    from kvforge import names

    def as_list(value: Any) -> list[str]:
        if not value:
            return []
        return [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else list(value)

    def check_all(checks: tuple[tuple[str, Any], ...]) -> None:
        for attr, check in checks:
            for value in as_list(getattr(args, attr, None)):
                check(value)

    check_all(
        (
            ("press", names.check_press),
            ("methods", names.check_press),
            ("task", names.check_task),
            ("rag", names.check_rag_strategy),
            ("dtype", names.check_dtype),
        )
    )
    if callable(command_check := getattr(args, "check", None)):
        command_check(args)
    check_all((("model", names.check_model), ("aux_model", names.check_model)))


def preflight(args: argparse.Namespace) -> None:
    """Checks that need the network or the disk but no torch, run before a command imports anything heavy: the
    store is reachable, a hub model id is cached locally or the hub can be reached. Each fails in seconds, one line."""
    store = getattr(args, "store", None)
    if isinstance(store, str) and store:
        probe_store(store)
    model = getattr(args, "model", None)
    if isinstance(model, str) and model:
        from kvforge import names

        if names.check_model(model) == "hub":
            probe_hub_model(model)


def probe_store(url: str, timeout_s: float = 2.0) -> None:
    """A single Redis store's server must answer within ``timeout_s`` (a tiered store skips an unreachable tier).

    Only reachability is probed here (client options and credentials are checked when the store opens): a server
    that answers, even "authentication required", is reachable."""
    from urllib.parse import urlsplit, urlunsplit

    from kvforge.redact import redact_text, redact_url, spilled_userinfo, split_urls

    tiers = split_urls(url)
    if len(tiers) != 1 or not tiers[0].startswith(("redis://", "rediss://")) or spilled_userinfo(tiers[0]):
        return  # a URL the client would misread: the store refuses it in its own words when it opens
    try:
        import redis
    except ImportError:
        return  # the store's own check names the missing extra
    try:
        parts = urlsplit(tiers[0])
        bare = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        client = redis.Redis.from_url(bare, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    except Exception:  # an odd URL: the store reports it in its own words when it opens
        return
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError) as e:
        if isinstance(e, redis.AuthenticationError):
            return
        raise redis_unavailable(redact_url(tiers[0]), redact_text(str(e))) from None
    except Exception:
        return  # it answered (e.g. NOAUTH): reachable
    finally:
        client.close()


def probe_hub_model(model_id: str, timeout_s: float = 3.0) -> None:
    """A hub id loads only from the local Hugging Face cache or a reachable hub: say so at once, not after a minute
    of retries and warnings."""
    import os
    import socket
    from urllib.parse import urlsplit

    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return
    cached = try_to_load_from_cache(model_id, "config.json")
    if isinstance(cached, str):
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if not offline:
        host = urlsplit(endpoint).hostname or "huggingface.co"
        try:
            socket.create_connection((host, 443), timeout=timeout_s).close()
            return
        except OSError:
            pass
    why = "HF_HUB_OFFLINE is set" if offline else f"{urlsplit(endpoint).hostname} cannot be reached"
    raise UserError(
        f"model {model_id!r} is not in the local Hugging Face cache and {why}: give a built-in name "
        "(kvforge models), a model folder or a .gguf file"
    )


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """Load the model named by ``--model``, quietly (no transformers progress bars)."""
    from kvforge.compat import quiet_transformers
    from kvforge.model import load_model

    quiet_transformers()
    return load_model(args.model, device=args.device, dtype=args.dtype)


def read_text_file(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"file not found: {path}")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from e


def check_store_url(url: str | None) -> None:
    """Refuse a store URL with an unknown scheme or a relative ``file://`` path before the model loads."""
    if not url:
        return
    from urllib.parse import urlsplit

    from kvforge.redact import redact_url, split_urls

    if not isinstance(url, str):
        raise UserError(f"a store URL must be text, got {type(url).__name__}")
    for part in split_urls(url):
        shown = redact_url(part)  # a URL appears in a message only redacted
        scheme = part.split("://", 1)[0] + "://" if "://" in part else ""
        if scheme not in ("memory://", "file://", "redis://", "rediss://"):
            raise UserError(f"unknown store URL {shown!r}: use memory://, file:///abs/dir, redis://host:port/db")
        if scheme == "file://":
            parts = urlsplit(part)
            if parts.netloc or not parts.path.startswith("/"):
                raise UserError(f"store URL {shown!r} is not an absolute path: write file:///abs/dir (three slashes)")


def add_http_args(parser: argparse.ArgumentParser, port: int) -> None:
    """What ``kvforge serve`` and ``kvforge route`` share as HTTP servers: the address, the API key, the body limit and
    the connection limits."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: local only)")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KVFORGE_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $KVFORGE_API_KEY; none = open)",
    )
    parser.add_argument("--max-body-bytes", type=positive_int, default=8 * 2**20)
    parser.add_argument(
        "--max-connections",
        type=positive_int,
        default=None,
        help="open connections before new ones get a 503 (default: the file limit less 128)",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=10.0,
        help="seconds a request's headers may take to arrive, and a body may pause (then 408 / closed)",
    )


def connection_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn options for ``args`` (:mod:`kvforge.serve.connections`); a bad value is a one-line error."""
    from kvforge.serve.connections import uvicorn_options

    if not 0 < args.read_timeout < float("inf"):
        raise UserError(f"--read-timeout must be > 0 seconds, got {args.read_timeout}")
    return uvicorn_options(args.max_connections, args.read_timeout)


def check_api_key(key: str | None) -> None:
    """:func:`kvforge.serve.middleware.check_api_key` first thing (without the serve extra, the server says so)."""
    try:
        from kvforge.serve.middleware import check_api_key as check
    except ImportError:
        return
    check(key)


def check_port_free(host: str, port: int) -> None:
    """Fail now, not after the model loaded, when ``host:port`` cannot be bound."""
    import socket

    if not 0 < port < 65536:
        raise UserError(f"port must be in 1..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise UserError(f"cannot resolve --host {host!r}: {e}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def prefill_progress(min_tokens: int = 4096, stream: Any = None) -> Any:
    """An ``on_chunk(done, total)`` hook drawing a tqdm bar on stderr for a prefill of several chunks, when stderr
    is a terminal or the prompt has ``min_tokens`` tokens or more (long runs logged to a file show progress too)."""
    import sys

    stream = sys.stderr if stream is None else stream
    state: dict[str, Any] = {"bar": None}

    def on_chunk(done: int, total: int) -> None:
        bar = state["bar"]
        if bar is None:
            if done >= total or not (stream.isatty() or total >= min_tokens):
                return  # one chunk only, or a short prompt on a non-terminal: no bar
            from tqdm.auto import tqdm

            bar = state["bar"] = tqdm(total=total, desc="prefill", unit="tok", file=stream, leave=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
            state["bar"] = None

    return on_chunk
