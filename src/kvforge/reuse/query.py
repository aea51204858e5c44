"""What a semantic strategy embeds for a chat: the words the user wrote, never the chat template around them.

The chat template and a model's default system prompt are the same for every prompt, so embedding the templated text
makes any two prompts look alike ("What is the capital of austria?" / "... of Australia?": cosine 0.71 for the
user's words, 0.91 for the templated texts). :func:`user_query` returns the last user message as the text to embed,
and a :class:`PromptContext` covering every token before it (system prompt, template header, earlier turns): in
canonical mode only stored prompts with exactly these leading tokens are candidates (same system prompt, same
conversation so far), and in context mode the conversation so far is the part that is reused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvforge.reuse.base import PromptContext

logger = logging.getLogger(__name__)


def _render(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[str, bool]:
    """The prompt text as the engine tokenises it (``Engine.encode_chat``) and whether special tokens are added."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), False
    return "\n\n".join(str(m["content"]) for m in messages), True


def user_query(
    tokenizer: Any, prompt: Any, ids: Sequence[int], raw: bool = False
) -> tuple[str | None, PromptContext | None]:
    """``(text to embed, the context before it)`` for a prompt the engine encoded as ``ids``.

    ``prompt`` is what ``Engine.encode_chat`` took: a string (one user message, or raw text with ``raw``), a list of
    chat messages, or token ids. Token ids, a chat not ending with a user message, or a template that does not show
    the user's words verbatim give ``(None, None)``: nothing to match, a semantic miss (never a guess).
    """
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        return None, None
    if isinstance(prompt, str) and (raw or not getattr(tokenizer, "chat_template", None)):
        return prompt, None
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    last = messages[-1] if messages else {}
    content = last.get("content") if isinstance(last, dict) else None
    if last.get("role") != "user" or not isinstance(content, str) or not content.strip():
        return None, None
    text, add_special = _render(tokenizer, messages)
    start = text.rfind(content)
    if start < 0:
        start = text.rfind(content.strip())
    if start < 0:
        logger.debug("the chat template does not show the user's message verbatim: no semantic match")
        return None, None
    try:
        enc = tokenizer(text, add_special_tokens=add_special, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):  # a slow tokenizer has no offsets
        return None, None
    if list(enc.input_ids) != list(ids):
        return None, None  # not the engine's tokenisation of this prompt
    offsets = enc.offset_mapping
    split = next((i for i, (s, e) in enumerate(offsets) if e > start and not (s == e == 0 and i == 0)), len(ids))
    if split == 0:
        return content, None
    history = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages[:-1] if isinstance(m.get("content"), str))
    return content, PromptContext(history, split)
