"""Semantic retrieval heads (CompressKV §3.2, Eq. 5): which query heads read the answer while the model copies it.

For one needle-in-a-haystack probe, the model greedily answers the question; at every decoding step
whose generated token y_t is one of the answer span's tokens, each (layer, query head) adds the
attention mass its query (the one that produced y_t) puts on the whole answer span:

    score(h) += sum_{j in span} a^(h)_{t, j}        for each step t with y_t in span tokens

A probe counts only if the answer is recalled (ROUGE-1 recall of the answer words in the response
above `min_recall`, the authors' code uses > 0.5); a head's score is the mean over the successful
probes. Differences from the authors' script: a token that occurs m times in the span adds its mass
once (their loop adds it m times), and the span is located exactly (character offsets) rather than
by token-set overlap.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvcli.calibration.probes import Probe, rouge1_recall
from kvcli.calibration.runner import LM, Runner, attention_probs


@dataclass
class ProbeResult:
    key: str
    length: int                  # tokens in the prompt
    recall: float
    ok: bool
    steps: int                   # decoding steps that produced an answer token
    response: str
    scores: np.ndarray           # [n_layer, n_head] float64: summed span attention over the counted steps

    def as_json(self) -> dict:
        return {"key": self.key, "length": self.length, "recall": self.recall, "ok": self.ok, "steps": self.steps,
                "response": self.response, "scores": self.scores.tolist()}

    @classmethod
    def from_json(cls, d: dict) -> "ProbeResult":
        return cls(d["key"], int(d["length"]), float(d["recall"]), bool(d["ok"]), int(d["steps"]), d["response"],
                   np.asarray(d["scores"], dtype=np.float64))


def answer_span(lm: LM, probe: Probe) -> tuple[list[int], list[int]]:
    """(prompt tokens, token indices that overlap the answer's characters)."""
    enc = lm.tokenizer(probe.prompt, add_special_tokens=False, return_offsets_mapping=True)
    ids, offs = list(enc["input_ids"]), enc["offset_mapping"]
    span = [i for i, (a, b) in enumerate(offs) if b > probe.answer_start and a < probe.answer_end]
    if not span:
        raise RuntimeError(f"probe {probe.key}: the answer is not in the tokenised prompt")
    return ids, span


def run_probe(lm: LM, probe: Probe, max_new_tokens: int, min_recall: float) -> ProbeResult:
    ids, span = answer_span(lm, probe)
    span_t = torch.tensor(span)
    span_tokens = {ids[i] for i in span}
    step = np.zeros((lm.n_layer, lm.n_head), dtype=np.float64)

    def on_layer(layer, q, K, V, module):
        p = attention_probs(lm, q[:, -1:], K, module.scaling)[:, 0]      # [n_head, n]
        step[layer] = p[:, span_t].sum(dim=-1).double().numpy()

    runner = Runner(lm, on_layer)
    total = np.zeros_like(step)
    counted = 0
    out: list[int] = []
    tok = runner.start(ids, rows=1)
    for _ in range(max_new_tokens):
        if tok in lm.eog_ids:
            break
        piece = lm.piece(tok)
        if "\n" in piece and out:   # the authors' script stops at a newline
            break
        if tok in span_tokens:      # `step` holds the attention of the query that produced `tok`
            total += step
            counted += 1
        out.append(tok)
        if len(out) == max_new_tokens:
            break
        tok = runner.step(tok)
    response = lm.tokenizer.decode(out, skip_special_tokens=True).strip()
    recall = rouge1_recall(probe.needle.answer, response)
    return ProbeResult(probe.key, len(ids), recall, recall > min_recall and counted > 0, counted, response, total)


def head_scores(results: list[ProbeResult], n_layer: int, n_head: int) -> tuple[np.ndarray, int]:
    """Mean per-probe score over the successful probes, [n_layer, n_head]; and how many succeeded."""
    ok = [r.scores for r in results if r.ok]
    if not ok:
        return np.zeros((n_layer, n_head)), 0
    return np.mean(np.stack(ok), axis=0), len(ok)


