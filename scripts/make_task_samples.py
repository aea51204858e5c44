"""Write the small task samples shipped in ``src/kvforge/data`` (smoke tests of the converted tasks, not benchmarks).

Every context is a passage of the bundled public-domain Moby-Dick excerpt (``haystack_gutenberg``); the questions,
answers and summaries are kvforge's own text. Each folder has the layout of the shared-data folder of the same name,
so the task loaders read it unchanged. Run: ``python3 scripts/make_task_samples.py`` (deterministic).
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "src" / "kvforge" / "data"
SOURCE = "kvforge sample: haystack_gutenberg/moby_dick_excerpt.txt"
TEXT = (DATA / "haystack_gutenberg" / "moby_dick_excerpt.txt").read_text(encoding="utf-8")
PARAS = [p.strip("\n") for p in TEXT.split("\n\n") if p.strip()]


def text(*indices: int) -> str:
    return "\n\n".join(PARAS[i] for i in indices)


def span(first: int, last: int) -> str:
    return text(*range(first, last + 1))


def passages(indices: list[int]) -> str:
    return "\n\n".join(f"Passage {k}:\n{PARAS[i]}" for k, i in enumerate(indices, 1))


def where(indices: tuple[int, ...]) -> str:
    return f"{SOURCE} paragraphs {', '.join(map(str, indices))}"


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def longbench() -> None:
    def row(dataset: str, number: int, question: str, context: str, answers: list[str], paras: range | list) -> dict:
        return {"_id": f"sample-{dataset}-{number}", "dataset": dataset, "language": "en", "input": question,
                "context": context, "answers": answers, "length": len(context.split()), "all_classes": None,
                "source": where(tuple(paras))}  # fmt: skip

    sets = {
        "narrativeqa": [
            row(
                "narrativeqa",
                0,
                "Why does the narrator go to sea as a sailor rather than as a passenger?",
                span(0, 15),
                ["Because sailors are paid, while passengers must pay."],
                range(0, 16),
            )
        ],
        "qasper": [
            row(
                "qasper",
                0,
                "What is the name of the harpooneer who shares the narrator's bed?",
                span(104, 110),
                ["Queequeg"],
                range(104, 111),
            )
        ],
        "multifieldqa_en": [
            row(
                "multifieldqa_en",
                0,
                "What object does the narrator find on the sea chest?",
                span(78, 83),
                ["a large door mat"],
                range(78, 84),
            )
        ],
        "hotpotqa": [
            row(
                "hotpotqa",
                0,
                "In which town stands the inn kept by Peter Coffin?",
                passages([17, 23, 2, 33]),
                ["New Bedford"],
                [17, 23, 2, 33],
            )
        ],
        "2wikimqa": [
            row(
                "2wikimqa",
                0,
                "Which island did the narrator want his ship to come from?",
                passages([51, 18, 5]),
                ["Nantucket"],
                [51, 18, 5],
            )
        ],
        "musique": [
            row(
                "musique",
                0,
                "What did the harpooneer who arrived from the south seas try to sell?",
                passages([74, 9, 86]),
                ["embalmed New Zealand heads"],
                [74, 9, 86],
            )
        ],
        "gov_report": [
            row(
                "gov_report",
                0,
                "",
                span(16, 28),
                [
                    "The narrator packs his carpet-bag and reaches New Bedford on a Saturday night in December, too "
                    "late for the packet to Nantucket, where he means to sign on. With little money he walks the cold, "
                    "dark streets, passes inns that look too expensive, stumbles into a church, and at last finds the "
                    "Spouter Inn, kept by Peter Coffin, which looks cheap enough for him."
                ],
                range(16, 29),
            )
        ],
        "multi_news": [
            row(
                "multi_news",
                0,
                "",
                passages([49, 51, 74]),
                [
                    "A ship's crew arrives at the inn and drinks noisily; one quiet, tall Southerner among them, "
                    "Bulkington, slips away and his shipmates run after him. The landlord explains that the harpooneer "
                    "the narrator must share a bed with has come from the south seas and is selling embalmed New "
                    "Zealand heads in town."
                ],
                [49, 51, 74],
            )
        ],
    }
    for name, rows in sets.items():
        write(DATA / "longbench" / f"{name}.jsonl", rows)


def leval() -> None:
    document = span(29, 47)
    write(DATA / "leval_multiquestion" / "narrative_qa.jsonl", [{
        "id": "sample-spouter-inn", "task": "narrative_qa", "input": document,
        "instructions": ["What is the name of the inn?", "Where does the landlord say the narrator can sleep?",
                         "What are the young seamen examining when the narrator enters?"],
        "outputs": ["The Spouter Inn", "In a harpooneer's bed, sharing his blanket", "specimens of skrimshander"],
        "source": where(tuple(range(29, 48))), "evaluation": "f1",
    }])  # fmt: skip


def squad() -> None:
    questions = {
        17: [("When did the narrator arrive in New Bedford?", "a Saturday night in December"),
             ("What had already sailed?", "the little packet for Nantucket"),
             ("Which ship did the narrator board in New Bedford?", None)],
        23: [("What words were painted on the sign?", "The Spouter Inn:—Peter Coffin")],
        51: [("How tall was the quiet man?", "full six feet"),
             ("What name did his shipmates shout?", "Bulkington")],
    }  # fmt: skip
    rows = []
    for i, qas in questions.items():
        context = PARAS[i].replace("\n", " ")  # SQuAD paragraphs have no line breaks
        items = []
        for k, (question, answer) in enumerate(qas):
            start = context.find(answer) if answer else -1
            assert answer is None or start >= 0, answer
            items.append({"id": f"sample-{i}-{k}", "question": question, "answers": [answer] if answer else [],
                          "answer_starts": [start] if answer else [], "is_impossible": answer is None})  # fmt: skip
        rows.append({"id": f"moby_dick-{i}", "title": "Moby-Dick", "context": context, "qas": items})
    write(DATA / "squad_v2_dev" / "dev.jsonl", rows)


def musique() -> None:
    def ctxs(indices: list[int]) -> list[dict]:
        return [{"title": f"Moby-Dick, paragraph {i}", "text": PARAS[i].replace("\n", " ")} for i in indices]

    write(DATA / "musique_rag" / "musique_s.jsonl", [
        {"id": "sample-0", "question": "In which town stands the inn whose landlord is Peter Coffin?",
         "answers": ["New Bedford"], "ctxs": ctxs([2, 17, 33, 23, 5, 40, 19, 81, 24, 105])},
        {"id": "sample-1", "question": "What did the harpooneer who shared the narrator's bed try to sell in town?",
         "answers": ["embalmed New Zealand heads", "heads"], "ctxs": ctxs([86, 9, 74, 51, 95, 13, 36, 109, 62, 3])},
    ])  # fmt: skip


if __name__ == "__main__":
    longbench()
    leval()
    squad()
    musique()
