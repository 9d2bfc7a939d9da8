"""WindowKV's `task=auto`: is an instruction information localization (QA) or aggregation (summaries, few-shot,
synthetic counting/retrieval, code)?

The paper's classifier is a fine-tuned BERT whose weights were never released. This one is a logistic
regression over word and character n-grams of the instruction, trained by `python -m kvcli.taskclass.train`
on the labelled instructions in kvcli/data/task_instructions.jsonl (written for this project) and shipped
as kvcli/data/task_classifier.json. It is model-independent, runs in well under a millisecond after a
one-time load of a few milliseconds, and is deterministic. Method, data and held-out accuracy:
docs/windowkv-task-classifier.md.

    from kvcli.taskclass import classify
    classify("Summarise this document.")   # TaskPrediction(task='aggregation', p_aggregation=0.9.., ...)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from kvcli.errors import KvcliError
from kvcli.taskclass.features import featurize

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
WEIGHTS_PATH = DATA_DIR / "task_classifier.json"
INSTRUCTIONS_PATH = DATA_DIR / "task_instructions.jsonl"
FORMAT = "kvcli-taskclass-1"
TASKS = ("localization", "aggregation")   # label 0, label 1

# Fewer known n-grams than this and the prediction is mostly the bias: refuse rather than guess (e.g. text
# in a language the English-heavy training data does not cover).
MIN_KNOWN_FEATURES = 5

__all__ = ["MIN_KNOWN_FEATURES", "TASKS", "TaskClassifier", "TaskPrediction", "classify", "classifier",
           "resolve_task"]


@dataclass(frozen=True)
class TaskPrediction:
    task: str               # "localization" or "aggregation"
    p_aggregation: float    # the model's probability of aggregation
    known_features: int     # n-gram features of the text that the model has weights for (0: it knows nothing)

    @property
    def confidence(self) -> float:
        return max(self.p_aggregation, 1.0 - self.p_aggregation)


class TaskClassifier:
    """Binary features present in `weights`, L2-normalised, dotted with the weights, plus the bias."""

    def __init__(self, weights: dict[str, float], bias: float, feature_set: str, threshold: float = 0.5):
        self.weights = weights
        self.bias = float(bias)
        self.feature_set = feature_set
        self.threshold = float(threshold)

    @classmethod
    def from_file(cls, path: str | Path) -> "TaskClassifier":
        path = Path(path)
        try:
            blob = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise KvcliError(f"cannot read the task classifier weights {path}: {e}") from None
        if not isinstance(blob, dict) or blob.get("format") != FORMAT:
            raise KvcliError(f"{path} is not a kvcli task classifier ({FORMAT}); retrain it with "
                             "python -m kvcli.taskclass.train")
        return cls({str(k): float(v) for k, v in blob["weights"].items()}, blob["bias"], blob["feature_set"],
                   blob.get("threshold", 0.5))

    def logit(self, text: str) -> tuple[float, int]:
        known = [f for f in featurize(text, self.feature_set) if f in self.weights]
        if not known:
            return self.bias, 0
        # sorted: float addition in a fixed order, so the same text gives the same bits everywhere
        total = math.fsum(self.weights[f] for f in sorted(known))
        return self.bias + total / math.sqrt(len(known)), len(known)

    def predict(self, text: str) -> TaskPrediction:
        if not isinstance(text, str) or not text.strip():
            raise KvcliError("the task classifier needs a non-empty instruction")
        z, known = self.logit(text)
        p = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))
        return TaskPrediction(TASKS[1] if p >= self.threshold else TASKS[0], p, known)


@lru_cache(maxsize=1)
def classifier() -> TaskClassifier:
    """The shipped classifier (loaded once per process)."""
    if not WEIGHTS_PATH.is_file():
        raise KvcliError(f"the task classifier weights are missing ({WEIGHTS_PATH}); reinstall kvcli or run "
                         "python -m kvcli.taskclass.train")
    return TaskClassifier.from_file(WEIGHTS_PATH)


def classify(text: str) -> TaskPrediction:
    return classifier().predict(text)


def resolve_task(text: str, who: str = "task=auto") -> TaskPrediction:
    """classify(text), or a clear error when the classifier knows too little of the text to decide."""
    pred = classify(text)
    if pred.known_features < MIN_KNOWN_FEATURES:
        raise KvcliError(f"{who}: the task classifier cannot tell what kind of task this instruction is (it knows "
                         f"{pred.known_features} of its word/character n-grams; it was trained on mostly English "
                         "instructions); pass task=localization (questions about the text) or task=aggregation "
                         "(summaries, few-shot, counting, code) instead")
    return pred
