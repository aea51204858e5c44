"""Training of the semantic verifier (:mod:`kvforge.reuse.verifier`): its pairs and its fit, deterministic.

Pairs: the labelled pairs given (the training part of the calibration side of PAWS-Wiki and of the SQuAD
paraphrases with their same-paragraph negatives, and the written near-miss kinds of that part), plus pairs made from
questions (SQuAD questions of the same part), so that the verifier learns what changes a question and what does not
rather than what PAWS sentences look like:

* not the same (one edit each): a number changed, a negation added, a word swapped for its opposite, a content word
  replaced by one from another question, a content word inserted from another question, two content words swapped,
  the question word changed;
* the same: lower case without the question mark, a polite frame ("can you tell me ..."), a contraction, ``which``
  for ``what``, a leading phrase moved to the end ("In 1990, who won X?" / "Who won X in 1990?").

Fit: the biases and LayerNorms of MiniLM and a logistic head (BitFit), AdamW with a linear warm-up and decay, on one
thread with fixed seeds: the same pairs give the same parameters.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvforge.reuse.verifier import CrossEncoder

logger = logging.getLogger(__name__)

_AUX_WORDS = "is are was were did does do can could should would will has have had"
_STOP_WORDS = (
    "a an the of in on at to for by with from as and or but is are was were be been do does did what which who whom "
    "whose when where why how that this these those it its there their they he she his her many much"
)
_AUX, _STOP = frozenset(_AUX_WORDS.split()), frozenset(_STOP_WORDS.split())
_WH = ("what", "who", "when", "where", "why", "how", "which")
_OPPOSITES = (
    "increase decrease", "before after", "first last", "most least", "largest smallest", "highest lowest",
    "more less", "older younger", "north south", "east west", "won lost", "start end", "began ended",
    "maximum minimum", "encrypt decrypt", "import export", "buy sell", "left right", "open close", "he she",
    "his her", "men women", "inside outside", "above below", "early late", "positive negative", "add remove",
    "upload download", "true false", "cheap expensive", "allowed forbidden", "rise fall", "higher lower",
)  # fmt: skip
OPPOSITE = {a: b for pair in _OPPOSITES for a, b in (pair.split(), pair.split()[::-1])}
_FRAMES = ("can you tell me ", "please tell me ", "i'd like to know ", "quick question: ", "do you know ")


def part_of(group: str) -> str:
    """``fit`` (two thirds of the groups) or ``calibration`` (the rest), by a hash of the group."""
    digest = hashlib.sha256(f"verifier:{group}".encode()).hexdigest()
    return "calibration" if int(digest[:8], 16) % 3 == 0 else "fit"


def _content(words: list[str]) -> list[int]:
    return [i for i, w in enumerate(words) if len(w) > 3 and w.lower().strip("?,.") not in _STOP and w.isalpha()]


def _other_word(rng: random.Random, pool: Sequence[str], avoid: set[str]) -> str | None:
    for _ in range(10):
        words = pool[rng.randrange(len(pool))].split()
        idx = _content(words)
        if idx:
            word = words[rng.choice(idx)].lower()
            if word not in avoid:
                return word
    return None


def _negatives(q: str, rng: random.Random, pool: Sequence[str]) -> list[str]:
    """Every one-edit near-miss of question ``q`` this module makes (see the module docstring)."""
    words = q.split()
    lower = [w.lower() for w in words]
    out = []
    nums = [i for i, w in enumerate(words) if re.fullmatch(r"\d+(?:[.,]\d+)?", w.strip("?,."))]
    if nums:
        i = rng.choice(nums)
        core = words[i].strip("?,.")
        new = str(int(float(core.replace(",", ""))) + rng.choice((1, 2, 5, 10, 100)))
        out.append(" ".join([*words[:i], words[i].replace(core, new), *words[i + 1 :]]))
    aux = [i for i, w in enumerate(lower) if w in _AUX]
    if aux and "not" not in lower:
        i = aux[0]
        out.append(" ".join([*words[: i + 1], "not", *words[i + 1 :]]))
    opp = [i for i, w in enumerate(lower) if w.strip("?,.") in OPPOSITE]
    if opp:
        i = rng.choice(opp)
        core = lower[i].strip("?,.")
        out.append(" ".join([*words[:i], words[i].lower().replace(core, OPPOSITE[core]), *words[i + 1 :]]))
    content = _content(words)
    avoid = set(lower)
    if content:
        i = rng.choice(content)
        other = _other_word(rng, pool, avoid)
        if other:
            out.append(" ".join([*words[:i], other + words[i][len(words[i].rstrip("?,.")) :], *words[i + 1 :]]))
        j = rng.choice(content)
        other = _other_word(rng, pool, avoid)
        if other:
            out.append(" ".join([*words[:j], other, *words[j:]]))
    if len(content) >= 2:
        i, j = rng.sample(content, 2)
        swapped = list(words)
        swapped[i], swapped[j] = words[j].rstrip("?,.") + words[i][len(words[i].rstrip("?,.")) :], \
            words[i].rstrip("?,.") + words[j][len(words[j].rstrip("?,.")) :]  # fmt: skip
        if swapped[i].lower() != swapped[j].lower():
            out.append(" ".join(swapped))
    if lower and lower[0] in _WH:
        other = rng.choice([w for w in _WH if w not in (lower[0], "which")])
        out.append(" ".join([other.capitalize() if words[0][0].isupper() else other, *words[1:]]))
    return [n for n in out if n != q]


def _positives(q: str, rng: random.Random) -> list[str]:
    """Rewordings of ``q`` that ask the same (see the module docstring)."""
    out = [q.lower().rstrip("?").rstrip()]
    frame = rng.choice(_FRAMES)
    out.append(frame + q[:1].lower() + q[1:])
    for long, short in (("What is", "What's"), ("Who is", "Who's"), ("Where is", "Where's"), ("How is", "How's")):
        if q.startswith(long + " "):
            out.append(short + q[len(long) :])
        elif q.startswith(short + " "):
            out.append(long + q[len(short) :])
    if q.startswith("Which "):
        out.append("What " + q[len("Which ") :])
    head, sep, rest = q.partition(", ")
    if sep and len(head.split()) <= 5 and rest:
        body = rest.rstrip("?").rstrip()
        out.append(body[:1].upper() + body[1:] + " " + head[:1].lower() + head[1:] + ("?" if q.endswith("?") else ""))
    return [p for p in out if p != q]


def synthetic_pairs(questions: Sequence[str], seed: int = 0) -> list[tuple[str, str, bool]]:
    """``(stored, asked, same)``: one near-miss and one rewording per question (where it has any), deterministic."""
    rng = random.Random(seed)
    pool = sorted(set(questions))
    out = []
    for q in pool:
        negatives, positives = _negatives(q, rng, pool), _positives(q, rng)
        if negatives:
            out.append((q, rng.choice(negatives), False))
        if positives:
            out.append((q, rng.choice(positives), True))
    return out


def train_verifier(
    encoder: CrossEncoder,
    pairs: Sequence[tuple[str, str, bool]],
    epochs: int = 2,
    batch: int = 16,
    lr: float = 2e-3,
    seed: int = 0,
    progress: Callable[[str], Any] | None = None,
) -> dict[str, np.ndarray]:
    """Fit ``encoder``'s tuned parameters on ``(stored, asked, same)`` pairs, each read in a random order of its two
    texts (the verifier is meant to be symmetric); returns the tuned tensors."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    for name, param in encoder.model.named_parameters():
        param.requires_grad_(False)
        if name.endswith(".bias") or "LayerNorm" in name:
            param.requires_grad_(True)
    params = encoder.parameters()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps = epochs * ((len(pairs) + batch - 1) // batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.0, 1 - s / steps))
    encoder.model.train()
    t0, step = time.perf_counter(), 0
    try:
        for epoch in range(epochs):
            order = list(range(len(pairs)))
            rng.shuffle(order)
            for start in range(0, len(order), batch):
                chosen = [pairs[i] for i in order[start : start + batch]]
                texts = [(a, b) if rng.random() < 0.5 else (b, a) for a, b, _ in chosen]
                labels = torch.tensor([float(same) for _, _, same in chosen])
                loss = torch.nn.functional.binary_cross_entropy_with_logits(encoder.logits(texts), labels)
                opt.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
                sched.step()
                step += 1
                if progress is not None and step % 50 == 0:
                    elapsed = time.perf_counter() - t0
                    progress(f"epoch {epoch} step {step}/{steps} loss {loss.item():.3f} {elapsed:.0f}s")
    finally:
        encoder.model.eval()
        for param in encoder.model.parameters():
            param.requires_grad_(False)
        torch.set_num_threads(threads)
    return encoder.tensors()
