"""Token ids -> streamed text deltas for a server request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvforge.decode import trim_at_stop


class DeltaStream:
    """Token ids -> text deltas that never show a stop string (text that might start one is held back)."""

    def __init__(self, tokenizer: Any, stop: list[str], emit: Callable[[str], None] | None) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.emit = emit
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.tokens: list[int] = []
        self.sent = ""

    def __call__(self, token: int) -> None:
        self.tokens.append(token)
        if self.emit is None:
            return
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # half of a multi-byte character
        safe = trim_at_stop(text, self.stop) if self.stop else text
        end = len(safe) if len(safe) < len(text) else len(safe) - self.hold
        if end > len(self.sent) and safe.startswith(self.sent):
            self._send(safe[len(self.sent) : end])

    def finish(self, text: str) -> None:
        """Send what is left of the final ``text`` (the generation's, trimmed at its stop string)."""
        if self.emit is not None and text.startswith(self.sent) and len(text) > len(self.sent):
            self._send(text[len(self.sent) :])

    def _send(self, delta: str) -> None:
        self.sent += delta
        assert self.emit is not None
        self.emit(delta)
