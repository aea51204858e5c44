"""RULER's variable tracking and common-words extraction, and the RULER mix (all synthetic tasks interleaved).

Following RULER (arXiv:2404.06654): variable tracking hides one chain of ``num_hops`` assignments
("VAR ABCDE = 12345." then "VAR FGHIJ = VAR ABCDE." ...) in the haystack at random sentence boundaries and asks for
every variable holding the value; common-words extraction lists words where ``num_common`` words occur
``freq_common`` times and the rest ``freq_rare`` times, and asks for the common ones. Departures: the chain is hidden
in natural text (RULER repeats "The grass is green..."), and for contexts under 4096 units the common-word frequency
shrinks so that the common words fill at most half the list. CWE lists fill the length up to less than one
rare word's entries.
"""

from __future__ import annotations

import itertools
import random
import re
import string

from kvforge.eval.data import Example
from kvforge.eval.tasks.base import Measure, TaskConfig, interleave
from kvforge.eval.tasks.needle import filler_text, insert_needles, load_haystack, needle_task


def variable_tracking_example(cfg: TaskConfig, length: int, index: int, num_hops: int = 4) -> Example:
    """One variable-tracking example: a chain of ``num_hops`` + 1 variables, all holding one value."""
    rng = cfg.rng("vt", length, index)
    measure = Measure(cfg.tokenizer)
    names: list[str] = []
    while len(names) < num_hops + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10_000, 99_999))
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
    depths = sorted(rng.random() for _ in statements)
    size = length - sum(measure.size(" " + s + " ") for s in statements)
    hay = filler_text(load_haystack(cfg), size, measure, rng.random())
    context, _ = insert_needles(hay, statements, depths, measure)
    return Example(
        id=f"ruler-vt-L{length}-{index}",
        context=context,
        question=f"Find all variables that are assigned the value {value} in the text above.",
        answers=names,
        metric="contains_all",
        task="ruler-vt",
        max_new_tokens=48,
        answer_prefix=(
            f"Answer: According to the chain(s) of variable assignment in the text above, {len(names)} variables "
            f"are assigned the value {value}, they are:"
        ),
        needles=statements,
    )


def _vocabulary(cfg: TaskConfig) -> list[str]:
    words = set(re.findall(r"\b[a-z]{4,10}\b", load_haystack(cfg)[:200_000]))
    return sorted(words)


def common_words_example(
    cfg: TaskConfig, length: int, index: int, num_common: int = 10, freq_common: int = 30, freq_rare: int = 3
) -> Example:
    """One common-words-extraction example about ``length`` units long."""
    rng = cfg.rng("cwe", length, index)
    measure = Measure(cfg.tokenizer)
    header = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n"
    )
    length = max(length - measure.size(header), 1)
    vocab = _vocabulary(cfg)
    sample = rng.sample(vocab, 60)
    unit = measure.size(" ".join(f"{i + 1}. {w}" for i, w in enumerate(sample))) / len(sample)
    num_entries = max(int(length / unit), 2 * num_common)
    freq_common = max(2, min(freq_common, num_entries // (2 * num_common)))
    freq_rare = max(1, min(freq_rare, freq_common - 1))
    max_rare = min(len(vocab) - num_common, 2 * max(1, (num_entries - num_common * freq_common) // freq_rare) + 8)
    chosen = rng.sample(vocab, num_common + max_rare)
    common, shuffle_seed = chosen[:num_common], rng.random()

    def build(num_rare: int) -> str:
        rare = chosen[num_common : num_common + num_rare]
        entries = [w for w in common for _ in range(freq_common)] + [w for w in rare for _ in range(freq_rare)]
        random.Random(shuffle_seed).shuffle(entries)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries))

    lo, hi = 1, max_rare  # binary search: the most rare words that still fit in ``length``
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if measure.size(build(mid)) <= length else (lo, mid - 1)
    context = build(lo)
    return Example(
        id=f"ruler-cwe-L{length + measure.size(header)}-{index}",
        context=header + context,
        question=f"What are the {num_common} most common words in the above list?",
        answers=common,
        metric="contains_all",
        task="ruler-cwe",
        max_new_tokens=64,
        answer_prefix=f"Answer: The top {num_common} words that appear most often in the list are:",
    )


def _per_length(cfg: TaskConfig) -> int:
    return cfg.num_samples * len(cfg.depths)


def variable_tracking_task(cfg: TaskConfig) -> list[Example]:
    """``num_samples x len(depths)`` examples per length, so the counts match the needle grid."""
    return [variable_tracking_example(cfg, n, i) for n in cfg.lengths for i in range(_per_length(cfg))]


def common_words_task(cfg: TaskConfig) -> list[Example]:
    """``num_samples x len(depths)`` examples per length."""
    return [common_words_example(cfg, n, i) for n in cfg.lengths for i in range(_per_length(cfg))]


def ruler_mix(cfg: TaskConfig) -> list[Example]:
    """Single needle, multi-key, multi-value, multi-query, variable tracking and common words, interleaved."""
    groups = [needle_task(cfg, v) for v in ("single", "mk", "mv", "mq")]
    return interleave([*groups, variable_tracking_task(cfg), common_words_task(cfg)])
