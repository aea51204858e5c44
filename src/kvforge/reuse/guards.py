"""Lexical guards against semantic false hits: two texts an embedder finds close but that ask different things.

Sentence embeddings are nearly blind to the few words that make two prompts differ ("10.0.0.1" / "10.0.0.2",
"encrypt" / "decrypt", "he" / "she", "A beat B" / "B beat A"). The guards compare the words themselves; any
difference they find is a miss, whatever the similarity. They are generic rules, not lists of cases, so they hold
for kinds of near-miss nobody wrote down:

* ``substitution``: each text has a word the other lacks. A word replaced by another (a name, a number, an
  identifier, an opposite, a pronoun, a tense) is what a near-miss is.
* ``insertion``: one text has a content word the other lacks (``"What is the population of Germany?"`` / ``"What is
  the urban population of Germany?"``). A word added on one side narrows, widens or redirects what is asked, and the
  embedder barely sees it (cosine 0.91 to 0.94 for such pairs). Only closed-class words may be added (``of``, ``is``,
  ``exactly``, ``please``, ``can you tell me``: :data:`FUNCTION_WORDS`); the similarity bound decides those.
* ``marks``: the code-like chunks differ: a chunk (between spaces) holding a character other than a letter, a digit,
  an apostrophe or a hyphen between letters (``>``, ``a[1:]``, ``-R``, ``€100``, ``./build``, ``a??``, an emoji)
  is compared verbatim, case and all, in order. Only quotes around a chunk and one stop after it (``Paris?``,
  ``"morning",``) are prose and dropped. The word guards read words only; these
  characters are what a command, a formula, a path or a price is made of.
* ``case``: a word written in another case (``polish`` / ``Polish``) where both sentences use capitals; a sentence
  typed all in lower case is compared without case (``who painted the mona lisa``), and so is a sentence's first word.
* ``order``: the words both texts share appear in another order (swapped subjects, PAWS-style scrambles).
* ``numbers``: the numbers (digits and number words) differ, also when one text only adds one ("in 1990").
* ``negation``: a different count of negation cues (``not``, ``n't``, ``never``, ``without``, ...), also added ones.

Words are compared after normalisation: lower case, punctuation around words dropped (inside them kept: ``10.0.0.1``,
``np.argmax``, ``tar.gz`` stay one word), contractions expanded, the articles a/an/the ignored, ``which`` read as
``what``, ``1,000`` as ``1000`` and ``p.m.`` as ``pm``. A plural stays a plural (``spectacle`` / ``spectacles``,
``good`` / ``goods``). What each guard adds on top of the
similarity bound is measured in docs/reuse.md ("Guards: what each adds").
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence

_TOKEN = re.compile(r"(?:(?<![\w.])[-+−.](?=\d))?[\w#$%^*+@&]+(?:[.:/\-^*+'][\w#$%^*+@&]+)*", re.UNICODE)
_CONTRACTIONS = (
    (re.compile(r"\bcan't\b"), "can not"),
    (re.compile(r"\bwon't\b"), "will not"),
    (re.compile(r"n't\b"), " not"),
    (re.compile(r"'re\b"), " are"),
    (re.compile(r"'ll\b"), " will"),
    (re.compile(r"'ve\b"), " have"),
    (re.compile(r"'m\b"), " am"),
    (re.compile(r"'d\b"), " would"),
    (re.compile(r"'s\b"), ""),  # possessive or "is": dropped either way
)
IGNORED = frozenset(("a", "an", "the"))
_ARTICLE_USE = re.compile(r"\s+[\w$€£(\"']")  # what follows an article: a space, then a word
SAME_WORD = {"which": "what"}  # "which city is..." asks what "what ... city" asks
_SMALL_NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen twenty"
)
NUMBER_WORDS = {w: str(i) for i, w in enumerate(_SMALL_NUMBERS.split())} | {
    "thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80", "ninety": "90",
    "hundred": "100", "thousand": "1000", "million": "1e6", "billion": "1e9", "trillion": "1e12", "dozen": "12",
    "half": "0.5", "twice": "x2", "once": "x1", "first": "1st", "second": "2nd", "third": "3rd", "fourth": "4th",
    "fifth": "5th",
}  # fmt: skip
_NEGATION_WORDS = (
    "not no never none nobody nothing neither nor nowhere without cannot except unless hardly barely scarcely seldom "
    "rarely lack lacks lacked lacking fail fails failed unable"
)
NEGATIONS = frozenset(_NEGATION_WORDS.split())
# Closed-class words that frame a question without naming what it is about: adding one ("the population *of*
# Germany", "*can you tell me* the capital", "*exactly* how many") leaves the question the same. Quantifiers
# (all, only, most, some), negations, wh-words, deontic modals and directional particles (up, off, out) change it
# and are not here.
_FUNCTION_WORDS = (
    "this that these those it its i me you is am are was were be been being do does did have has had can could would "
    "will of in on at to for by with from as and or but so then also too just very really quite exactly precisely "
    "approximately roughly actually please kindly tell"
)
FUNCTION_WORDS = frozenset(_FUNCTION_WORDS.split())
_DOTTED = re.compile(r"[a-z](?:\.[a-z])+")  # p.m, u.s, e.g
_DIGIT_GROUPS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_LEADING_ZEROS = re.compile(r"(?<![\d.])0+(?=\d)")


def _normal(word: str) -> str:
    """One word in comparable form: thousands separators and leading zeros dropped."""
    if any(c.isdigit() for c in word):
        return _LEADING_ZEROS.sub("", word.replace("−", "-"))
    if _DOTTED.fullmatch(word):
        return word.replace(".", "")
    return SAME_WORD.get(word, word)


def tokens(text: str) -> list[str]:
    """The words of ``text`` as the guards compare them (see the module docstring), in order."""
    lowered = _DIGIT_GROUPS.sub("", text.lower().replace("’", "'"))
    for pattern, replacement in _CONTRACTIONS:
        lowered = pattern.sub(replacement, lowered)
    out = []
    for match in _TOKEN.finditer(lowered):
        word = match.group(0).strip("'")
        if word in IGNORED and _ARTICLE_USE.match(lowered, match.end()):
            continue  # an article before a word ("a dog"), not a name or a letter ("Server A, ...", "option a")
        if word:
            out.append(_normal(word))
    return out


def numbers(text: str) -> Counter[str]:
    """The numbers of ``text`` (words with a digit, and number words as digits), with counts."""
    found: Counter[str] = Counter()
    for word in tokens(text):
        if any(c.isdigit() for c in word):
            found[word] += 1
        elif word in NUMBER_WORDS:
            found[NUMBER_WORDS[word]] += 1
    return found


def negations(text: str) -> int:
    """Number of negation cues."""
    return sum(1 for w in tokens(text) if w in NEGATIONS)


# ------------------------------------------------------------------------------------------------ guards
def substitution_guard(query: str, donor: str) -> str | None:
    """A miss when each text has a word the other lacks, counting repeats (a word replaced, not only added)."""
    a, b = Counter(tokens(query)), Counter(tokens(donor))
    only_a, only_b = sorted((a - b).elements()), sorted((b - a).elements())
    if only_a and only_b:
        return f"words differ ({', '.join(only_a[:3])} vs {', '.join(only_b[:3])})"
    return None


def insertion_guard(query: str, donor: str) -> str | None:
    """A miss when the words one text has and the other lacks (counting repeats) include a content word."""
    a, b = Counter(tokens(query)), Counter(tokens(donor))
    added = [w for w in sorted((a - b).elements()) + sorted((b - a).elements()) if w not in FUNCTION_WORDS]
    return f"content words on one side only ({', '.join(added[:3])})" if added else None


def order_guard(query: str, donor: str) -> str | None:
    """A miss when the words both texts hold equally often do not appear in the same order (every occurrence)."""
    a, b = tokens(query), tokens(donor)
    ca, cb = Counter(a), Counter(b)
    shared = {w for w in ca if ca[w] == cb.get(w)}
    order_a = [w for w in a if w in shared]
    order_b = [w for w in b if w in shared]
    return None if order_a == order_b else "shared words in another order"


_QUOTES = "'\"`“”‘’«»"
_OPENERS = _QUOTES + "¿¡"
_STOPS = ".,;:!?…。，、？！；："
_JOINERS = "'’"
_INNER_HYPHEN = re.compile(r"(?<=[^\W\d_])-(?=[^\W\d_])")  # well-known, pre-war: words, not marks


def marks(text: str) -> list[str]:
    """The code-like chunks of ``text``, verbatim and in order (see ``marks`` in the module docstring)."""
    out = []
    for chunk in text.split():
        core = chunk.lstrip(_OPENERS).rstrip(_QUOTES)
        core = (core[:-1] if core[-1:] and core[-1] in _STOPS else core).rstrip(_QUOTES)  # one stop: ".." is kept
        if _DOTTED.fullmatch(core.lower().rstrip(".")):
            continue  # p.m., e.g., U.S.: an abbreviation, read as a word
        if any(not (c.isalnum() or c in _JOINERS) for c in _INNER_HYPHEN.sub("", core)):
            out.append(core)
    return out


def marks_guard(query: str, donor: str) -> str | None:
    a, b = marks(query), marks(donor)
    return None if a == b else f"code-like chunks differ ({' '.join(a[:3])} vs {' '.join(b[:3])})"


_SENTENCE = re.compile(r"[^.!?。？！]+[.!?。？！]*")


def _cased_words(text: str) -> set[str]:
    """The words of ``text`` whose case was chosen: those of sentences with a capital, but each sentence's first."""
    out: set[str] = set()
    for sentence in _SENTENCE.findall(text):
        if sentence != sentence.lower():
            out.update(re.findall(r"\w+", sentence)[1:])
    return out


def case_guard(query: str, donor: str) -> str | None:
    a, b = _cased_words(query), _cased_words(donor)
    changed = sorted(w for x, y in ((a, b), (b, a)) for w in x - y if w.lower() in {v.lower() for v in y - x})
    return f"case differs ({', '.join(changed[:3])})" if changed else None


def numbers_guard(query: str, donor: str) -> str | None:
    a, b = numbers(query), numbers(donor)
    return None if a == b else f"numbers differ ({sorted(a.elements())} vs {sorted(b.elements())})"


def negation_guard(query: str, donor: str) -> str | None:
    a, b = negations(query), negations(donor)
    return None if a == b else f"negation differs ({a} vs {b} cues)"


Guard = Callable[[str, str], "str | None"]
GUARDS: dict[str, Guard] = {
    "substitution": substitution_guard,
    "insertion": insertion_guard,
    "order": order_guard,
    "marks": marks_guard,
    "case": case_guard,
    "numbers": numbers_guard,
    "negation": negation_guard,
}
DEFAULT_GUARDS = ("numbers", "negation", "substitution", "insertion", "order", "marks", "case")


def check_names(guards: Sequence[str]) -> tuple[str, ...]:
    """``guards`` as a tuple, or ValueError naming the unknown one and the choices."""
    for name in guards:
        if name not in GUARDS:
            raise ValueError(f"unknown guard {name!r}; choose from {sorted(GUARDS)}")
    return tuple(guards)


def check(query: str, donor: str, guards: Sequence[str] = DEFAULT_GUARDS) -> str | None:
    """The first reason ``query`` must not reuse ``donor``'s KV, or None when every guard passes."""
    for name in check_names(guards):
        reason = GUARDS[name](query, donor)
        if reason is not None:
            return f"{name}: {reason}"
    return None


def failed(query: str, donor: str, guards: Sequence[str] = DEFAULT_GUARDS) -> frozenset[str]:
    """The names of every guard in ``guards`` that refuses the pair (the statistics keep them all)."""
    return frozenset(name for name in check_names(guards) if GUARDS[name](query, donor) is not None)
