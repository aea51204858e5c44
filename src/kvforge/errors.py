"""Errors meant for a person: the CLI prints them as one line, the server turns them into 4xx."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# One message for one unsupported combination, in the engine, the CLI and the server alike.
PRESS_WITH_REUSE = (
    "a press combines with KV reuse only query-agnostic on a document, through document reuse (compressed once, "
    "stored, reused by later questions): Request(Document(doc, question), press=..., query_aware=False, "
    "reuse=DocumentReuse(store, model_id)); CLI: --prompt-file DOC --prompt QUESTION --press P --query-agnostic "
    "--reuse document; server: kvforge.query_aware=false with a 'document\\n\\nquestion' message and document reuse"
)
REUSE_WITH_WINDOW = "KV reuse does not combine with a sliding-window cache (--window)"
REUSE_WITH_DECODING_BUDGET = "KV reuse does not combine with a decoding budget yet (its cache is cut while it decodes)"
# reuse names (CLI --reuse, the server's kvforge.reuse) whose strategy, given a press, stores the compressed document
STORES_DOCUMENTS = frozenset({"prefix", "document"})


class UserError(Exception):
    """Bad input from the user (unknown name, unreadable file, invalid number, prompt too long...)."""


class ModelMismatchError(UserError):
    """A stored cache was made by another model, tokenizer, dtype or format version."""


class CorruptSegmentError(UserError):
    """Stored bytes are not a readable kvforge segment (truncated, bad checksum, garbled header)."""


class StoreUnavailableError(UserError):
    """A store backend cannot be reached (e.g. Redis connection refused)."""


class Aborted(Exception):
    """A request stopped before its end: ``reason`` is "cancelled" (client gone), "timeout" or "shutdown"."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def check_combination(
    *,
    press: bool,
    stores_documents: bool,
    query_aware: bool = True,
    has_document: bool = True,
    window: bool = False,
    decoding_budget: bool = False,
) -> None:
    """The one rule for what combines with KV reuse, called where reuse is asked for: by the engine before it plans,
    by the CLI and the server before a model loads or a request queues (so each says the same thing).

    Args:
        press: the prompt is compressed by a press.
        stores_documents: the reuse strategy stores a compressed document whole (a
            :class:`~kvforge.reuse.base.StoresCompressedDocuments`; by name: :data:`STORES_DOCUMENTS`).
        query_aware: the press sees the question (a compressed document must not: it is reused by other questions).
        has_document: the prompt has a document part (document + question).
        window, decoding_budget: the engine keeps a sliding-window cache / cuts the cache while decoding.
    """
    if window:
        raise UserError(REUSE_WITH_WINDOW)
    if decoding_budget:
        raise UserError(REUSE_WITH_DECODING_BUDGET)
    if press and not (stores_documents and not query_aware and has_document):
        raise UserError(PRESS_WITH_REUSE)


def redis_unavailable(display_url: str, reason: str) -> StoreUnavailableError:
    """The one message for a Redis store that does not answer (``display_url`` already redacted)."""
    return StoreUnavailableError(
        f"Redis store {display_url} is unavailable ({reason}); start redis-server or use another --store"
    )


def unknown_name(kind: str, name: str, choices: Iterable[str]) -> UserError:
    """``unknown press 'snapk'; did you mean 'snapkv'? choose from: ...`` (the closest names first)."""
    options = sorted(choices)
    close = difflib.get_close_matches(name, options, n=2, cutoff=0.6)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return UserError(f"unknown {kind} {name!r}{hint} choose from: {', '.join(options)}")
