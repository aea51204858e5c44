"""Needle in a haystack over lengths x depths, with RULER's variants (single, multi-key, multi-value, multi-query).

A needle is RULER's sentence "One of the special magic numbers for {key} is: {value}." inserted into natural text
(by default the Paul Graham essays, then the Gutenberg novels, of ``data_dir/haystack_*``; without them the
public-domain Moby-Dick excerpt shipped in ``kvforge/data``). ``needle-narrative`` uses other wordings instead
(:data:`WORDINGS`): a plain statement that could sit in the story ("Mr. Hale kept the spare key of the chapel in a
tin box under stone number 4417."), asked about in its own words, so that a method tuned to RULER's one template is
seen to carry over or not. A haystack file ``books.jsonl#pride_and_prejudice`` reads only that row of a JSONL file.
The context is
``length`` units long (model tokens with a tokenizer, else characters, see :class:`~.base.Measure`); the queried
needle starts ``depth`` of the way through the haystack, moved to the nearest sentence boundary (at most
``SNAP_WINDOW`` characters away) so no sentence is cut. Everything is drawn from ``TaskConfig.seed``.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvforge.errors import UserError
from kvforge.eval.data import Example
from kvforge.eval.tasks.base import Measure, TaskConfig
from kvforge.paths import haystack_files

SNAP_WINDOW = 200
ADJECTIVES = tuple(
    str.split(
        "ancient brave calm damp eager faint gentle hollow icy jolly keen lively mellow noisy odd proud quiet rapid "
        "shiny tidy upbeat vivid wary young zesty bitter crimson dusty elegant fierce golden humble"
    )
)
NOUNS = tuple(
    str.split(
        "anchor badger candle dolphin engine falcon garden harbor island jacket kettle lantern meadow needle orchard "
        "pepper quarry river saddle tunnel umbrella valley walrus yacht zebra beacon canyon fossil glacier hammock"
    )
)
VARIANTS = {"single": (1, 1, 1), "mk": (4, 1, 1), "mv": (1, 4, 1), "mq": (4, 1, 4)}  # (keys, values/key, queried)


@dataclass(frozen=True)
class Wording:
    """A needle that is a plain statement of the story, its question and the start of the answer.

    The templates take ``{who}`` (a title and surname), ``{what}`` (a thing of the wording's ``things``) and
    ``{value}`` (a number in ``[low, high]``, or one of ``words``).
    """

    needle: str
    question: str
    prefix: str
    things: tuple[str, ...]
    low: int = 1000
    high: int = 9999
    words: tuple[str, ...] = ()

    def draw(self, rng: random.Random) -> dict[str, str]:
        who = f"{rng.choice(TITLES)} {rng.choice(SURNAMES)}"
        value = rng.choice(self.words) if self.words else str(rng.randint(self.low, self.high))
        return {"who": who, "what": rng.choice(self.things), "value": value}


TITLES = ("Mr.", "Mrs.", "Miss", "Captain", "Doctor")
SURNAMES = tuple(
    str.split(
        "Hale Pendry Ashcombe Thorne Vickery Marlow Quill Fenwick Braddock Cotterell Drummond Everard Galloway "
        "Hartigan Ingram Jessop Kettering Lumley Northcott Ormsby Pilbeam Rackham Stanhope Tolliver Wainwright"
    )
)
# plain statements of a story, asked about in their own words (none says "special magic number")
WORDINGS: dict[str, Wording] = {
    "key": Wording(
        "{who} kept the spare key of the {what} in a tin box under the stone marked {value}.",
        "Under which stone did {who} keep the spare key of the {what}?",
        "{who} kept the spare key of the {what} under the stone marked",
        ("chapel", "boathouse", "granary", "old mill", "vestry", "counting-house"),
    ),
    "schooner": Wording(
        "The schooner that {who} bought that spring was entered in the harbour register of {what} as number {value}.",
        "As what number was the schooner that {who} bought entered in the harbour register?",
        "The schooner that {who} bought was entered in the harbour register as number",
        ("Whitby", "Falmouth", "Leith", "Bristol", "Dundee", "Harwich"),
        low=100_000,
        high=999_999,
    ),
    "debt": Wording(
        "When the accounts were settled at last, {who} found that {what} still owed {value} pounds.",
        "How many pounds did {what} still owe {who} when the accounts were settled?",
        "When the accounts were settled, {what} still owed",
        ("the miller", "the vicar", "the blacksmith", "the landlord", "the schoolmaster", "the ferryman"),
    ),
    "room": Wording(
        "The room that {who} took at the {what} was number {value}, at the top of the back stairs.",
        "What was the number of the room that {who} took at the {what}?",
        "The room that {who} took at the {what} was number",
        ("Blue Boar", "Golden Fleece", "Crown and Anchor", "Red Lion", "Three Feathers", "White Hart"),
        low=100,
        high=999,
    ),
    "password": Wording(
        "The word that {who} had to whisper at the gate of the {what} was {value}.",
        "What was the word that {who} had to whisper at the gate of the {what}?",
        "The word that {who} had to whisper at the gate of the {what} was",
        ("walled garden", "old priory", "lower orchard", "cemetery", "stable yard", "deer park"),
        words=(
            "marigold", "tinderbox", "juniper", "lodestar", "quicksilver", "periwinkle", "saltpetre", "hawthorn",
            "candlewick", "bergamot", "pennyroyal", "cormorant",
        ),
    ),
    "born": Wording(
        "{who} was born in the year {value}, in a farmhouse near {what}.",
        "In what year was {who} born?",
        "{who} was born in the year",
        ("Ashford", "Carlow", "Dunmore", "Hexham", "Kelso", "Ludlow"),
        low=1701,
        high=1899,
    ),
}


@lru_cache(maxsize=4)
def read_haystack(files: tuple[Path, ...]) -> str:
    """The text of haystack files (plain text, or JSONL with a ``text`` field per line), joined in order.

    ``books.jsonl#row_id`` reads only the JSONL row whose ``id`` is ``row_id`` (one book of a collection)."""
    texts: list[str] = []
    for path in files:
        file, row = split_row(path)
        if file.suffix == ".jsonl":
            with file.open(encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            picked = [r["text"] for r in rows if row is None or r.get("id") == row]
            if not picked:
                ids = ", ".join(str(r.get("id")) for r in rows)
                raise UserError(f"haystack {file} has no row with id {row!r} (ids: {ids})")
            texts.extend(picked)
        else:
            texts.append(file.read_text(encoding="utf-8"))
    return "\n\n".join(t.strip() for t in texts)


def split_row(path: Path) -> tuple[Path, str | None]:
    """``books.jsonl#pride_and_prejudice`` -> (``books.jsonl``, ``"pride_and_prejudice"``); else (path, None)."""
    text = str(path)
    if "#" in Path(text).name:
        file, row = text.rsplit("#", 1)
        return Path(file), row
    return Path(text), None


def load_haystack(cfg: TaskConfig) -> str:
    """All haystack text, concatenated in a fixed order."""
    files = tuple(cfg.haystack) if cfg.haystack else tuple(haystack_files(cfg.data_dir))
    if not files:
        raise UserError(f"no haystack files under {cfg.data_dir}/haystack_* nor in the package (set --haystack)")
    missing = [str(f) for f in files if not split_row(Path(f))[0].is_file()]
    if missing:
        raise UserError(f"haystack file(s) not found: {', '.join(missing)}")
    text = read_haystack(files)
    if len(text) < 1000:
        raise UserError("the haystack text is too short (< 1000 characters)")
    return text


def filler_text(haystack: str, size: int, measure: Measure, rng_offset: float) -> str:
    """``size`` units of haystack starting at a paragraph picked by ``rng_offset`` in [0, 1), wrapping around."""
    start = int(rng_offset * len(haystack))
    paragraph = haystack.find("\n", start)
    start = 0 if paragraph < 0 else paragraph + 1
    text = haystack[start:]
    while len(text) < size * 16 + 64 and measure.size(text) < size:
        text = text + "\n\n" + haystack
    return measure.head(text, size)


def _boundaries_near(text: str, pos: int) -> int:
    """The sentence boundary (after '. ', '? ', '! ' or a newline) closest to ``pos``; else the nearest space."""
    if pos <= 0 or pos >= len(text):
        return max(0, min(pos, len(text)))
    lo, hi = max(0, pos - SNAP_WINDOW), min(len(text), pos + SNAP_WINDOW)
    best = None
    for p in range(lo + 2, hi + 1):
        is_boundary = text[p - 1] == "\n" or text[p - 2 : p] in (". ", "? ", "! ")
        if is_boundary and (best is None or abs(p - pos) < abs(best - pos)):
            best = p
    if best is not None:
        return best
    space = text.rfind(" ", 0, pos)
    return space + 1 if space >= 0 else pos


def insert_needles(
    hay: str, needles: list[str], depths: list[float], measure: Measure, snap: bool = True
) -> tuple[str, list[int]]:
    """Insert each needle at its depth (a fraction of the haystack's units); returns the context and start chars."""
    num_units = measure.size(hay)
    positions = []
    for depth in depths:
        pos = measure.prefix_chars(hay, round(depth * num_units))
        positions.append(_boundaries_near(hay, pos) if snap else pos)
    order = sorted(range(len(needles)), key=lambda i: positions[i])
    parts, starts, cursor, offset = [], [0] * len(needles), 0, 0
    for i in order:
        pos = positions[i]
        parts.append(hay[cursor:pos])
        offset += pos - cursor
        left = "" if pos == 0 or hay[pos - 1].isspace() else " "
        right = "" if pos == len(hay) or hay[pos].isspace() else " "
        starts[i] = offset + len(left)
        parts.append(left + needles[i] + right)
        offset += len(left + needles[i] + right)
        cursor = pos
    parts.append(hay[cursor:])
    return "".join(parts), starts


def make_needle_example(cfg: TaskConfig, variant: str, length: int, depth: float, index: int) -> Example:
    """One needle example of a RULER ``variant`` with ``length`` units of context, queried needle at ``depth``."""
    num_keys, num_values, num_queries = VARIANTS[variant]
    rng = cfg.rng("needle", variant, length, depth, index)
    measure = Measure(cfg.tokenizer)
    pairs = rng.sample([(a, n) for a in ADJECTIVES for n in NOUNS], num_keys)
    keys = [f"{a}-{n}" for a, n in pairs]
    values = {k: [str(rng.randint(1_000_000, 9_999_999)) for _ in range(num_values)] for k in keys}
    needles = [f"One of the special magic numbers for {k} is: {v}." for k in keys for v in values[k]]
    depths = [depth] + [rng.random() for _ in needles[1:]]
    needle_size = sum(measure.size(" " + n + " ") for n in needles)
    if needle_size >= length:
        raise UserError(f"needle length {length} is too short for {len(needles)} needle(s) ({needle_size} units)")
    hay = filler_text(load_haystack(cfg), length - needle_size, measure, rng.random())
    context, _ = insert_needles(hay, needles, depths, measure)
    queried = keys[:num_queries]
    answers = [v for k in queried for v in values[k]]
    if num_values == 1 and num_queries == 1:
        question = f"What is the special magic number for {queried[0]} mentioned in the provided text?"
        prefix = f"The special magic number for {queried[0]} mentioned in the provided text is"
    else:
        names = queried[0] if len(queried) == 1 else ", ".join(queried[:-1]) + f" and {queried[-1]}"
        question = f"What are all the special magic numbers for {names} mentioned in the provided text?"
        prefix = f"The special magic numbers for {names} mentioned in the provided text are"
    return Example(
        id=f"{'needle' if variant == 'single' else 'ruler-' + variant}-L{length}-d{depth:.2f}-{index}",
        context=context,
        question=question,
        answers=answers,
        metric="contains" if len(answers) == 1 else "contains_all",
        task="needle" if variant == "single" else f"ruler-{variant}",
        max_new_tokens=16 + 12 * len(answers),
        answer_prefix=prefix,
        needles=[n for n in needles if any(v in n for v in answers)],
    )


def needle_task(cfg: TaskConfig, variant: str = "single") -> list[Example]:
    """The lengths x depths x samples grid of one variant."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown needle variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return [
        make_needle_example(cfg, variant, length, depth, i)
        for length in cfg.lengths
        for depth in cfg.depths
        for i in range(cfg.num_samples)
    ]


def make_narrative_example(cfg: TaskConfig, name: str, length: int, depth: float, index: int) -> Example:
    """One needle of wording ``name`` (:data:`WORDINGS`) in ``length`` units of haystack at ``depth``."""
    wording = WORDINGS[name]
    rng = cfg.rng("needle-narrative", name, length, depth, index)
    measure = Measure(cfg.tokenizer)
    fields = wording.draw(rng)
    needle = wording.needle.format(**fields)
    needle_size = measure.size(" " + needle + " ")
    if needle_size >= length:
        raise UserError(f"needle length {length} is too short for the needle ({needle_size} units)")
    hay = filler_text(load_haystack(cfg), length - needle_size, measure, rng.random())
    at = measure.prefix_chars(hay, round(depth * measure.size(hay)))
    # a statement of the story starts where a sentence ends (a line break of a wrapped book is no sentence end)
    ends = [m.end() for m in _STORY_SENTENCE_END.finditer(hay, max(0, at - 4 * SNAP_WINDOW), at + 4 * SNAP_WINDOW)]
    end = min(ends, key=lambda e: abs(e - at)) if ends else None
    context = insert_needles(hay, [needle], [depth], measure)[0] if end is None else f"{hay[:end]}{needle} {hay[end:]}"
    prefix = wording.prefix.format(**fields)
    return Example(
        id=f"needle-narrative-{name}-L{length}-d{depth:.2f}-{index}",
        context=context,
        question=wording.question.format(**fields),
        answers=[fields["value"]],
        metric="contains",
        task="needle-narrative",
        max_new_tokens=24,
        answer_prefix=prefix[0].upper() + prefix[1:],
        needles=[needle],
    )


def narrative_needle_task(cfg: TaskConfig, wordings: tuple[str, ...] = tuple(WORDINGS)) -> list[Example]:
    """The lengths x depths x samples grid with the narrative wordings, taken in turn (each cell its own wording)."""
    cells = [(n, d, i) for n in cfg.lengths for d in cfg.depths for i in range(cfg.num_samples)]
    offset = cfg.rng("needle-narrative-order").randrange(len(wordings))
    return [
        make_narrative_example(cfg, wordings[(offset + j) % len(wordings)], n, d, i)
        for j, (n, d, i) in enumerate(cells)
    ]


def narrative_multi_task(cfg: TaskConfig, num_needles: int = 4) -> list[Example]:
    """``needle-multi`` with narrative needles: per length and sample ONE document holding ``num_needles`` statements
    of different wordings at evenly spread depths (each at a sentence end), one question per needle."""
    measure = Measure(cfg.tokenizer)
    out = []
    for length in cfg.lengths:
        for index in range(cfg.num_samples):
            rng = cfg.rng("needle-multi-narrative", length, index)
            names = rng.sample(list(WORDINGS), min(num_needles, len(WORDINGS)))
            drawn = [(n, WORDINGS[n].draw(rng)) for n in names]
            needles = [WORDINGS[n].needle.format(**f) for n, f in drawn]
            hay = filler_text(load_haystack(cfg), length - sum(measure.size(" " + x + " ") for x in needles), measure,
                              rng.random())  # fmt: skip
            context = hay
            for j in reversed(range(len(needles))):  # insert from the end so earlier offsets stay valid
                at = measure.prefix_chars(context, round((j + 0.5) / len(needles) * measure.size(context)))
                ends = [m.end() for m in _STORY_SENTENCE_END.finditer(context, max(0, at - 4 * SNAP_WINDOW),
                                                                       at + 4 * SNAP_WINDOW)]  # fmt: skip
                at = min(ends, key=lambda e: abs(e - at)) if ends else at
                context = f"{context[:at]}{needles[j]} {context[at:]}"
            for j, ((name, fields), needle) in enumerate(zip(drawn, needles, strict=True)):
                prefix = WORDINGS[name].prefix.format(**fields)
                out.append(
                    Example(
                        id=f"needle-multi-narrative-L{length}-{index}-q{j}",
                        context=context,
                        question=WORDINGS[name].question.format(**fields),
                        answers=[fields["value"]],
                        metric="contains",
                        task="needle-multi-narrative",
                        max_new_tokens=24,
                        answer_prefix=prefix[0].upper() + prefix[1:],
                        needles=[needle],
                    )
                )
    return out


def multi_needle_task(cfg: TaskConfig, num_needles: int = 4) -> list[Example]:
    """Per length and sample, ONE document holding ``num_needles`` needles at evenly spread depths and one question
    per needle: examples share their context (the "store once, ask many" case of :mod:`kvforge.eval.stored`)."""
    measure = Measure(cfg.tokenizer)
    out = []
    for length in cfg.lengths:
        for index in range(cfg.num_samples):
            rng = cfg.rng("needle-multi", length, index)
            keys = [f"{a}-{n}" for a, n in rng.sample([(a, n) for a in ADJECTIVES for n in NOUNS], num_needles)]
            values = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
            needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values, strict=True)]
            needle_size = sum(measure.size(" " + n + " ") for n in needles)
            if needle_size >= length:
                raise UserError(f"needle length {length} is too short for {num_needles} needles ({needle_size} units)")
            hay = filler_text(load_haystack(cfg), length - needle_size, measure, rng.random())
            depths = [(j + 0.5) / num_needles for j in range(num_needles)]
            context, _ = insert_needles(hay, needles, depths, measure)
            for j, (key, value, needle) in enumerate(zip(keys, values, needles, strict=True)):
                out.append(
                    Example(
                        id=f"needle-multi-L{length}-{index}-q{j}",
                        context=context,
                        question=f"What is the special magic number for {key} mentioned in the provided text?",
                        answers=[value],
                        metric="contains",
                        task="needle-multi",
                        max_new_tokens=28,
                        answer_prefix=f"The special magic number for {key} mentioned in the provided text is",
                        needles=[needle],
                    )
                )
    return out


NUM_DOCS = 10


# a sentence end that is no abbreviation ("Mrs. Bennet": a document cut there splits a name, and a needle with it)
_NO_ABBREVIATION = r"(?<!\bMr)(?<!\bMrs)(?<!\bDr)(?<!\bSt)(?<!\bMs)"
_SENTENCE_END = re.compile(_NO_ABBREVIATION + r"(?<!\b[A-Z])[.!?][\"'\u201d\u2019)\]]?\s+")
# ... followed by the start of the next sentence
_STORY_SENTENCE_END = re.compile(_NO_ABBREVIATION + r"[.!?][\"'\u201d\u2019)\]]?\s+(?=[\"\u201c]?[A-Z])")


def _sentence_end_near(text: str, pos: int, lo: int, hi: int) -> int | None:
    """The end of a sentence (after ``.``, ``!`` or ``?``, a closing quote and whitespace) in ``(lo, hi)`` closest
    to ``pos``, or None."""
    ends = [m.end() for m in _SENTENCE_END.finditer(text, lo, hi) if lo < m.end() < hi]
    return min(ends, key=lambda e: abs(e - pos)) if ends else None


def split_documents(text: str, num_docs: int) -> list[str]:
    """``text`` cut into ``num_docs`` pieces of about equal size, at sentence ends when there is one within half a
    piece of the even cut (else at the nearest line break or space), so no sentence is cut."""
    size = len(text) / num_docs
    cuts = [0]
    for i in range(1, num_docs):
        target = round(i * size)
        lo, hi = max(cuts[-1], round(target - size / 2)), min(len(text), round(target + size / 2))
        cut = _sentence_end_near(text, target, lo, hi)
        if cut is None:
            cut = _boundaries_near(text, target)
        if cut > cuts[-1]:
            cuts.append(cut)
    cuts.append(len(text))
    docs = [text[a:b].strip() for a, b in itertools.pairwise(cuts)]
    return [d for d in docs if d]


def needle_docs_task(cfg: TaskConfig, num_docs: int = NUM_DOCS, narrative: bool = False) -> list[Example]:
    """Multi-document needles for RAG reuse: each single-needle example's context cut into ``num_docs`` chunks.

    The needle sits ``depth`` of the way through the concatenated documents (so in document ``~depth x num_docs``);
    ``chunks`` holds the documents, each reused on its own by the RAG strategies (``kvforge eval --rag``).
    ``narrative``: the needles of ``needle-narrative`` (several wordings, taken in turn) -> ``needle-narrative-docs``.
    """
    from kvforge.eval.data import CHUNK_SEPARATOR

    out = []
    task = "needle-narrative-docs" if narrative else "needle-docs"
    for ex in narrative_needle_task(cfg) if narrative else needle_task(cfg, "single"):
        chunks = split_documents(ex.context, num_docs)
        out.append(
            Example(
                id=ex.id.replace("needle-", "needle-docs-", 1) if not narrative else ex.id.replace(
                    "needle-narrative-", "needle-narrative-docs-", 1),
                context=CHUNK_SEPARATOR.join(chunks),
                question=ex.question,
                answers=ex.answers,
                metric=ex.metric,
                task=task,
                max_new_tokens=ex.max_new_tokens,
                answer_prefix=ex.answer_prefix,
                chunks=chunks,
                needles=ex.needles,
            )
        )
    return out
