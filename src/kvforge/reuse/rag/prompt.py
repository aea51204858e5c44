"""RAG prompts as token pieces: a shared prefix (chat header, system prompt), document chunks, separators, a question.

Chunks are tokenised separately, without special tokens, so a chunk has the same ids wherever it lands (its stored KV
is keyed by them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_PLACEHOLDER = "\x00KVFORGE_CONTEXT\x00"


@dataclass
class RagPrompt:
    """A RAG prompt as token pieces: ``prefix + c_1 + sep + c_2 + sep + ... + c_n + sep + question``.

    ``chunk_offsets[i][j]`` is the character span of token j inside ``chunk_texts[i]`` (maps auxiliary tokens).
    The question piece also holds the end of the user turn and the assistant header.
    """

    prefix_ids: list[int]
    chunk_ids: list[list[int]]
    sep_ids: list[int]
    question_ids: list[int]
    chunk_texts: list[str] = field(default_factory=list)
    chunk_offsets: list[list[tuple[int, int]]] = field(default_factory=list)
    question: str = ""
    system: str | None = None
    separator: str = "\n\n"

    def ids(self) -> list[int]:
        """The whole prompt's token ids (what a full prefill sees)."""
        out = list(self.prefix_ids)
        for chunk in self.chunk_ids:
            out += chunk + self.sep_ids
        return out + self.question_ids

    @property
    def num_context_tokens(self) -> int:
        return sum(len(c) for c in self.chunk_ids)


def _template_halves(tokenizer: Any, system: str | None) -> tuple[str, str]:
    """Text before and after the user message content in the chat template (ends with the assistant header)."""
    if not getattr(tokenizer, "chat_template", None):
        return (tokenizer.bos_token or "") if getattr(tokenizer, "bos_token", None) else "", ""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _PLACEHOLDER}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head, _, tail = text.partition(_PLACEHOLDER)
    return head, tail


def build_prompt(
    tokenizer: Any,
    docs: list[str],
    question: str,
    system: str | None = None,
    separator: str = "\n\n",
    answer_prefix: str = "",
) -> RagPrompt:
    """Tokenise a RAG prompt piece by piece (chat template around ``docs`` joined by ``separator`` + question).

    ``answer_prefix`` starts the assistant's answer (after the assistant header).
    """
    if not docs:
        raise ValueError("a RAG prompt needs at least one document")
    head, tail = _template_halves(tokenizer, system)
    enc = [tokenizer(d, add_special_tokens=False, return_offsets_mapping=True) for d in docs]
    for i, e in enumerate(enc):
        if not e["input_ids"]:
            raise ValueError(f"document {i} is empty after tokenisation")
    prompt = RagPrompt(
        prefix_ids=tokenizer(head, add_special_tokens=False)["input_ids"] if head else [],
        chunk_ids=[list(e["input_ids"]) for e in enc],
        sep_ids=tokenizer(separator, add_special_tokens=False)["input_ids"] if separator else [],
        question_ids=tokenizer(question + tail + answer_prefix, add_special_tokens=False)["input_ids"],
        chunk_texts=list(docs),
        chunk_offsets=[[tuple(o) for o in e["offset_mapping"]] for e in enc],
        question=question,
        system=system,
        separator=separator,
    )
    if not prompt.question_ids:
        raise ValueError("the question is empty after tokenisation")
    return prompt
