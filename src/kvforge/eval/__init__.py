"""EVALUATE: JSONL examples, metrics, built-in tasks, the method x budget runner and its report."""

from kvforge.eval.data import DataFormatError, Example, read_examples, write_examples
from kvforge.eval.metrics import METRICS, normalized_score, score_prediction

__all__ = [
    "METRICS",
    "DataFormatError",
    "Example",
    "normalized_score",
    "read_examples",
    "score_prediction",
    "write_examples",
]
