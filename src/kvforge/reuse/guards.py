"""Lexical guards against semantic false hits: two texts an embedder finds close but that ask different things.

Sentence embeddings are nearly blind to numbers ("in 1990" vs "in 1999"), negation ("was" vs "was not"), named
entities ("RSA" vs "Diffie-Hellman") and who-does-what-to-whom ("A is a tributary of B" vs "B ... of A"). Each guard
compares one of these between the new prompt and the donor; any difference is a miss. All are case-insensitive
(paraphrased questions are often lower-cased).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*", re.UNICODE)
_NUMBER = re.compile(r"\d[\d,.]*\d|\d")


def _set(text: str) -> frozenset[str]:
    return frozenset(text.split())


NUMBER_WORDS = _set(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand million billion "
    "trillion first second third fourth fifth sixth seventh eighth ninth tenth half twice once dozen"
)
NEGATIONS = _set(
    "not no never none nobody nothing neither nor nowhere without cannot cant dont doesnt didnt isnt wasnt arent "
    "werent wont wouldnt shouldnt couldnt hasnt havent hadnt except unless"
)
WH_WORDS = (
    "how many",
    "how much",
    "how long",
    "how old",
    "how far",
    "what year",
    "who",
    "whom",
    "whose",
    "when",
    "where",
    "why",
    "which",
    "what",
    "how",
)
WORD_ORDER_MIN = 0.9  # measured on paws_wiki / squad_paraphrase (docs/reuse.md)
_STOP_CAPS = _set("i a an the in on at of for to by with from and or but is was are were be this that")


def words(text: str) -> list[str]:
    """Lower-cased word tokens (apostrophes kept inside words, so "didn't" is one word)."""
    return [w.lower().replace("’", "'") for w in _WORD.findall(text)]


def numbers(text: str) -> Counter[str]:
    """Digit numbers (thousands separators removed) and number words, with counts."""
    found = Counter(n.replace(",", "").rstrip(".") for n in _NUMBER.findall(text))
    found.update(w for w in words(text) if w in NUMBER_WORDS)
    return found


def negations(text: str) -> int:
    """Number of negation cues ("not", "n't", "never", "without", ...)."""
    ws = words(text)
    return sum(1 for w in ws if w.replace("'", "") in NEGATIONS or w.endswith("n't"))


def entities(text: str) -> list[str]:
    """Capitalised words not starting a sentence, acronyms and words with digits, lower-cased, in order."""
    out = []
    sentence_start = True
    for match in re.finditer(r"\S+", text):
        token = match.group(0)
        word = _WORD.search(token)
        if word is not None:
            w = word.group(0)
            if (w[0].isupper() and not sentence_start and w.lower() not in _STOP_CAPS) or (len(w) > 1 and w.isupper()):
                out.append(w.lower())
            sentence_start = False
        if token[-1] in ".?!:":
            sentence_start = True
    return out


def wh_word(text: str) -> str | None:
    """The question's interrogative ("how many", "when", ...) or None when it has none."""
    lowered = " " + " ".join(words(text)) + " "
    for wh in WH_WORDS:
        if f" {wh} " in lowered:
            return wh
    return None


# ------------------------------------------------------------------------------------------------ guards
def numbers_guard(query: str, donor: str) -> str | None:
    a, b = numbers(query), numbers(donor)
    return None if a == b else f"numbers differ ({sorted(a)} vs {sorted(b)})"


def negation_guard(query: str, donor: str) -> str | None:
    a, b = negations(query), negations(donor)
    return None if a == b else f"negation differs ({a} vs {b} cues)"


def entities_guard(query: str, donor: str) -> str | None:
    """Every entity of each text must occur (case-insensitively) as a word of the other."""
    words_q, words_d = set(words(query)), set(words(donor))
    missing = [e for e in entities(query) if e not in words_d] + [e for e in entities(donor) if e not in words_q]
    return None if not missing else f"entities differ ({missing[:3]})"


def entity_order_guard(query: str, donor: str) -> str | None:
    """Shared entities must appear in the same order (rejects "A is a tributary of B" vs "B ... of A")."""
    shared = set(entities(query)) | set(entities(donor))
    order_q = [w for w in dict.fromkeys(words(query)) if w in shared]
    order_d = [w for w in dict.fromkeys(words(donor)) if w in shared]
    return None if order_q == order_d else "entities in another order"


def order_ratio(a: str, b: str) -> float:
    """Share of the words occurring once in each text that keep their relative order (LCS / count); 1.0 if < 2."""
    wa, wb = words(a), words(b)
    ca, cb = Counter(wa), Counter(wb)
    common = {w for w, n in ca.items() if n == 1 and cb.get(w) == 1}
    if len(common) < 2:
        return 1.0
    sa, sb = [w for w in wa if w in common], [w for w in wb if w in common]
    row = [0] * (len(sb) + 1)  # longest common subsequence, one row at a time
    for x in sa:
        prev = 0
        for j, y in enumerate(sb):
            prev, row[j + 1] = row[j + 1], prev + 1 if x == y else max(row[j + 1], row[j])
    return row[-1] / len(common)


def word_order_guard(query: str, donor: str) -> str | None:
    """Shared words must keep their order (>= WORD_ORDER_MIN): rejects PAWS-style scrambles of the same words."""
    ratio = order_ratio(query, donor)
    return None if ratio >= WORD_ORDER_MIN else f"word order differs ({ratio:.2f} of shared words in order)"


def wh_guard(query: str, donor: str) -> str | None:
    a, b = wh_word(query), wh_word(donor)
    return None if a == b else f"question word differs ({a} vs {b})"


Guard = Callable[[str, str], "str | None"]
GUARDS: dict[str, Guard] = {
    "numbers": numbers_guard,
    "negation": negation_guard,
    "entities": entities_guard,
    "entity_order": entity_order_guard,
    "wh": wh_guard,
    "word_order": word_order_guard,
}
DEFAULT_GUARDS = ("numbers", "negation", "entities", "entity_order", "wh", "word_order")


def check(query: str, donor: str, guards: Sequence[str] = DEFAULT_GUARDS) -> str | None:
    """The first reason ``query`` must not reuse ``donor``'s KV, or None when every guard passes."""
    for name in guards:
        if name not in GUARDS:
            raise ValueError(f"unknown guard {name!r}; choose from {sorted(GUARDS)}")
        reason = GUARDS[name](query, donor)
        if reason is not None:
            return f"{name}: {reason}"
    return None
