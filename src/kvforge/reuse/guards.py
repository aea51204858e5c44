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
_NUMBER_FULL = re.compile(
    r"(?<![\w.])(?P<cur>[$€£¥])?(?P<sign>[-−+])?(?P<num>(?:\d[\d,]*)?\.?\d+(?:[/:\-]\d+)*)(?![\d])"
    r"\s?(?P<unit>%|°[cfk]?|[a-zA-Zµ]+\.?(?:[a-zA-Z]\.)?)?",
    re.UNICODE,
)


def _set(text: str) -> frozenset[str]:
    return frozenset(text.split())


NUMBER_WORDS = _set(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen "
    "eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand million billion "
    "trillion first second third fourth fifth sixth seventh eighth ninth tenth half twice once dozen"
)
NEGATIONS = _set(
    "not no never none nobody nothing neither nor nowhere without cannot cant dont doesnt didnt isnt wasnt arent "
    "werent wont wouldnt shouldnt couldnt hasnt havent hadnt except unless hardly barely scarcely seldom rarely "
    "lack lacks lacked lacking fail fails failed unable neednt mustnt aint nobodys"
)
UNITS = _set(
    "% ° °c °f °k mg g kg t lb lbs oz ng µg ug mcg ml l dl cl kl mm cm m km ft yd mi nm mph kph kmh kn mm2 cm2 m2 km2 "
    "ha acre acres s ms us ns sec secs min mins h hr hrs day days week weeks month months year years yr yrs decade "
    "decades century centuries am pm bc bce ad ce w kw mw gw wh kwh mwh v kv mv ma mah hz khz mhz ghz b kb mb gb tb "
    "pb bit bits kbps mbps gbps pa kpa hpa bar psi atm j kj cal kcal n nm k c f x dollars dollar usd euros euro eur "
    "pounds pound gbp yen cents cent percent degrees degree celsius fahrenheit kelvin meters metres meter metre miles "
    "mile feet foot inches inch grams gram kilograms kilos kilo milligrams tons tonnes ton liters litres liter litre "
    "seconds second minutes minute hours hour times fold million billion trillion thousand hundred"
)
UNIT_ALIASES = {
    "percent": "%",
    "per": "",
    "degrees": "°",
    "degree": "°",
    "dollars": "$",
    "dollar": "$",
    "usd": "$",
    "euros": "€",
    "euro": "€",
    "eur": "€",
    "pounds": "lb",
    "pound": "lb",
    "lbs": "lb",
    "gbp": "£",
    "meters": "m",
    "metres": "m",
    "meter": "m",
    "metre": "m",
    "miles": "mi",
    "mile": "mi",
    "feet": "ft",
    "foot": "ft",
    "inches": "in",
    "inch": "in",
    "grams": "g",
    "gram": "g",
    "kilograms": "kg",
    "kilos": "kg",
    "kilo": "kg",
    "milligrams": "mg",
    "mcg": "µg",
    "ug": "µg",
    "tons": "t",
    "tonnes": "t",
    "ton": "t",
    "liters": "l",
    "litres": "l",
    "liter": "l",
    "litre": "l",
    "seconds": "s",
    "second": "s",
    "sec": "s",
    "secs": "s",
    "minutes": "min",
    "minute": "min",
    "mins": "min",
    "hours": "h",
    "hour": "h",
    "hr": "h",
    "hrs": "h",
    "years": "year",
    "yr": "year",
    "yrs": "year",
    "days": "day",
    "weeks": "week",
    "months": "month",
    "decades": "decade",
    "centuries": "century",
    "bce": "bc",
    "ce": "ad",
}
# Opposite words: a text with one side and not the other, against a text with the other side and not the first, ask
# different things ("safe" / "dangerous"). Prefixed opposites (un-, in-, il-, im-, ir-, dis-, non-) are found by rule.
ANTONYMS = tuple(
    tuple(pair.split("/"))
    for pair in [
        "before/after",
        "above/below",
        "over/under",
        "more/less",
        "more/fewer",
        "most/least",
        "increase/decrease",
        "increases/decreases",
        "increased/decreased",
        "rise/fall",
        "rises/falls",
        "rose/fell",
        "high/low",
        "higher/lower",
        "highest/lowest",
        "maximum/minimum",
        "max/min",
        "largest/smallest",
        "biggest/smallest",
        "large/small",
        "big/small",
        "first/last",
        "earliest/latest",
        "early/late",
        "earlier/later",
        "start/end",
        "begin/end",
        "beginning/end",
        "open/close",
        "opened/closed",
        "win/lose",
        "won/lost",
        "winner/loser",
        "buy/sell",
        "bought/sold",
        "import/export",
        "imports/exports",
        "north/south",
        "east/west",
        "northern/southern",
        "eastern/western",
        "left/right",
        "hot/cold",
        "warm/cool",
        "hotter/colder",
        "true/false",
        "positive/negative",
        "inside/outside",
        "input/output",
        "add/remove",
        "added/removed",
        "allow/forbid",
        "allowed/forbidden",
        "accept/reject",
        "accepted/rejected",
        "include/exclude",
        "included/excluded",
        "always/never",
        "major/minor",
        "strong/weak",
        "fast/slow",
        "faster/slower",
        "old/young",
        "older/younger",
        "oldest/youngest",
        "old/new",
        "newer/older",
        "newest/oldest",
        "easy/hard",
        "easy/difficult",
        "heavy/light",
        "heavier/lighter",
        "long/short",
        "longer/shorter",
        "longest/shortest",
        "tall/short",
        "cheap/expensive",
        "cheaper/dearer",
        "rich/poor",
        "best/worst",
        "better/worse",
        "good/bad",
        "pass/fail",
        "passed/failed",
        "success/failure",
        "same/different",
        "safe/dangerous",
        "up/down",
        "on/off",
        "push/pull",
        "enter/exit",
        "arrive/depart",
        "arrival/departure",
        "born/died",
        "birth/death",
        "male/female",
        "men/women",
        "man/woman",
        "boy/girl",
        "boys/girls",
        "husband/wife",
        "father/mother",
        "son/daughter",
        "brother/sister",
        "king/queen",
        "love/hate",
        "agree/disagree",
        "asleep/awake",
        "alive/dead",
        "present/absent",
        "wet/dry",
        "full/empty",
        "deep/shallow",
        "wide/narrow",
        "thick/thin",
        "light/dark",
        "day/night",
        "summer/winter",
        "spring/autumn",
        "morning/evening",
        "sunrise/sunset",
        "top/bottom",
        "front/back",
        "inner/outer",
        "upper/lower",
        "internal/external",
        "private/public",
        "rural/urban",
        "ancient/modern",
        "import/export",
        "attack/defend",
        "offense/defense",
        "offensive/defensive",
        "victory/defeat",
        "profit/loss",
        "gain/loss",
        "gains/losses",
        "credit/debit",
        "lend/borrow",
        "lent/borrowed",
        "teach/learn",
        "give/take",
        "gave/took",
        "send/receive",
        "sent/received",
        "sender/receiver",
        "buyer/seller",
        "parent/child",
        "predator/prey",
        "host/guest",
        "employer/employee",
        "acid/base",
        "acidic/basic",
        "cause/effect",
        "question/answer",
    ]
)
NEGATING_PREFIXES = ("un", "in", "il", "im", "ir", "dis", "non", "non-", "anti")
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


def _value(digits: str) -> str:
    """Canonical decimal value of "0040", "1,000", ".50", "3." -> "40", "1000", "0.5", "3"."""
    digits = digits.replace(",", "")
    whole, _, frac = digits.partition(".")
    whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
    return f"{whole}.{frac}" if frac else whole


def numbers(text: str) -> Counter[str]:
    """Numbers as values with their sign, format and unit, and number words, with counts.

    "-40" and "40", ".5" and "5", "03/04" and "04/03", "5 mg" and "5 g", "3 pm" and "3 am", "50%" and "50" all
    differ; "03/04" and "3/4", "1,000" and "1000", "0.50" and ".5" are equal. A unit is the word right after the number
    (or glued to it) when it is in :data:`UNITS`, or a currency sign right before it.
    """
    found: Counter[str] = Counter()
    for m in _NUMBER_FULL.finditer(text):
        sign = "-" if m.group("sign") in ("-", "−") else ""
        parts = re.split(r"([/:\-])", m.group("num"))
        value = "".join(p if i % 2 else _value(p) for i, p in enumerate(parts))
        unit = (m.group("unit") or "").lower().replace(".", "")
        unit = UNIT_ALIASES.get(unit, unit) if unit in UNITS else ""
        found[f"{m.group('cur') or ''}{sign}{value}{unit and ' ' + unit}"] += 1
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


def antonyms(query: str, donor: str) -> list[tuple[str, str]]:
    """Opposite words the texts disagree on: (word of query, word of donor) pairs, from :data:`ANTONYMS` and prefixes.

    A pair counts only when each text has its side and not the other's, so "better or worse" against "worse or
    better" is no difference.
    """
    wq, wd = set(words(query)), set(words(donor))
    found = []
    for a, b in ANTONYMS:
        for x, y in ((a, b), (b, a)):
            if x in wq and y not in wq and y in wd and x not in wd:
                found.append((x, y))
    for x in wq ^ wd:  # a word in one text only, whose un-/in-/dis-... opposite is only in the other
        other, own = (wd, wq) if x in wq else (wq, wd)
        for prefix in NEGATING_PREFIXES:
            if x.startswith(prefix) and len(x) - len(prefix) >= 3:
                base = x[len(prefix) :].lstrip("-")
                if base in other and base not in own:
                    found.append((x, base) if x in wq else (base, x))
    return found


def antonym_guard(query: str, donor: str) -> str | None:
    pairs = antonyms(query, donor)
    return None if not pairs else f"opposite words ({pairs[0][0]} vs {pairs[0][1]})"


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
    "antonyms": antonym_guard,
    "entities": entities_guard,
    "entity_order": entity_order_guard,
    "wh": wh_guard,
    "word_order": word_order_guard,
}
DEFAULT_GUARDS = ("numbers", "negation", "antonyms", "entities", "entity_order", "wh", "word_order")


def check(query: str, donor: str, guards: Sequence[str] = DEFAULT_GUARDS) -> str | None:
    """The first reason ``query`` must not reuse ``donor``'s KV, or None when every guard passes."""
    for name in guards:
        if name not in GUARDS:
            raise ValueError(f"unknown guard {name!r}; choose from {sorted(GUARDS)}")
        reason = GUARDS[name](query, donor)
        if reason is not None:
            return f"{name}: {reason}"
    return None
