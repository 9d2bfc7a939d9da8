"""Train (and evaluate) the WindowKV task classifier: python -m kvcli.taskclass.train [--embeddings GGUF]

1. Model selection by stratified 5-fold cross-validation on the TRAIN split only: feature set (word n-grams,
   character n-grams, both), minimum document frequency and the L2 strength.
2. Refit the best setting on the whole train split, report accuracy and the confusion matrix on the
   held-out TEST split (never used for a choice), and write kvcli/data/task_classifier.json.
3. With --embeddings GGUF, the same procedure over the mean of the model's own token embeddings (the
   other route the design allows), for comparison only: that route is not shipped (see the docs).

Deterministic: fixed folds, exact Newton fits, sorted vocabularies; a rerun writes the same file.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from kvcli.taskclass import FORMAT, INSTRUCTIONS_PATH, TASKS, WEIGHTS_PATH, logreg
from kvcli.taskclass.features import FEATURE_SETS, featurize

LAMBDAS = (1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
MIN_DFS = (1, 2)
FOLDS = 5


def load_rows(path: Path = INSTRUCTIONS_PATH) -> list[dict]:
    rows = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("label") not in TASKS or r.get("split") not in ("train", "test") or not r.get("text", "").strip():
            raise ValueError(f"{path}:{i}: need text, label in {TASKS} and split train|test")
        rows.append(r)
    return rows


def labels(rows: list[dict]) -> np.ndarray:
    return np.array([TASKS.index(r["label"]) for r in rows], dtype=np.int64)


def folds(y: np.ndarray, k: int = FOLDS) -> np.ndarray:
    """Stratified fold ids: the i-th example of each class goes to fold i % k (file order, no randomness)."""
    fold = np.empty(len(y), dtype=np.int64)
    for c in (0, 1):
        idx = np.flatnonzero(y == c)
        fold[idx] = np.arange(len(idx)) % k
    return fold


# -- n-gram route ------------------------------------------------------------------------------------------
def vocabulary(feats: list[set[str]], min_df: int) -> list[str]:
    df = Counter(f for fs in feats for f in fs)
    return sorted(f for f, c in df.items() if c >= min_df)


def matrix(feats: list[set[str]], vocab: list[str]) -> np.ndarray:
    """Binary rows over `vocab`, L2-normalised (the classifier's inference does the same per text)."""
    col = {f: j for j, f in enumerate(vocab)}
    X = np.zeros((len(feats), len(vocab)))
    for i, fs in enumerate(feats):
        js = [col[f] for f in fs if f in col]
        if js:
            X[i, js] = 1.0 / np.sqrt(len(js))
    return X


def ngram_fit(feats: list[set[str]], y: np.ndarray, min_df: int, lam: float):
    vocab = vocabulary(feats, min_df)
    w, b = logreg.fit(matrix(feats, vocab), y, lam)
    return vocab, w, b


def ngram_predict(feats: list[set[str]], vocab: list[str], w: np.ndarray, b: float) -> np.ndarray:
    return logreg.predict_proba(matrix(feats, vocab), w, b)


# -- embedding route (comparison only) ---------------------------------------------------------------------
def embedding_features(texts: list[str], gguf_path: str) -> np.ndarray:
    """Mean of the model's input token embeddings over each text's tokens, L2-normalised."""
    import gguf  # noqa: PLC0415
    from gguf.quants import dequantize  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    path = Path(gguf_path).resolve()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    E = dequantize(t.data, t.tensor_type).reshape(-1, int(t.shape[0])).astype(np.float64)
    out = np.zeros((len(texts), E.shape[1]))
    for i, text in enumerate(texts):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        v = E[ids].mean(axis=0)
        out[i] = v / (np.linalg.norm(v) or 1.0)
    return out


# -- evaluation ---------------------------------------------------------------------------------------------
def confusion(y: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """[[true loc -> loc, true loc -> agg], [true agg -> loc, true agg -> agg]]."""
    m = np.zeros((2, 2), dtype=np.int64)
    for t, p in zip(y, pred):
        m[t, p] += 1
    return m


def cv_accuracy(fit_predict, y: np.ndarray, lambdas) -> list[float]:
    """Cross-validated accuracy for each strength; fit_predict(train idx, val idx, lambdas) -> [p_val per lam]."""
    fold = folds(y)
    correct = np.zeros(len(lambdas))
    for k in range(FOLDS):
        tr, va = np.flatnonzero(fold != k), np.flatnonzero(fold == k)
        for j, p in enumerate(fit_predict(tr, va, lambdas)):
            correct[j] += int(np.sum((p >= 0.5).astype(np.int64) == y[va]))
    return [float(c) / len(y) for c in correct]


def select_ngram(train_feats: dict[str, list[set[str]]], y: np.ndarray, log) -> tuple[tuple, list]:
    results = []
    for fs in FEATURE_SETS:
        feats = train_feats[fs]
        for min_df in MIN_DFS:
            def fp(tr, va, lambdas, feats=feats, min_df=min_df):
                vocab = vocabulary([feats[i] for i in tr], min_df)
                Xtr, Xva = matrix([feats[i] for i in tr], vocab), matrix([feats[i] for i in va], vocab)
                Z = logreg.with_bias(Xtr)
                K = Z @ Z.T     # shared by every strength
                return [logreg.predict_proba(Xva, *logreg.fit(Xtr, y[tr], lam, Z=Z, K=K)) for lam in lambdas]
            for lam, acc in zip(LAMBDAS, cv_accuracy(fp, y, LAMBDAS)):
                results.append(((fs, min_df, lam), acc))
                log(f"  cv  {fs:<12} min_df={min_df} lambda={lam:<7g} accuracy={acc:.4f}")
    # best accuracy; ties -> the stronger regulariser, then the larger min_df, then the simpler feature set
    order = {fs: i for i, fs in enumerate(FEATURE_SETS)}
    best = max(results, key=lambda r: (r[1], r[0][2], r[0][1], -order[r[0][0]]))
    return best[0], results


def per_kind(rows: list[dict], pred: np.ndarray) -> dict[str, tuple[int, int]]:
    out: dict[str, list[int]] = {}
    for r, p in zip(rows, pred):
        c = out.setdefault(r["kind"], [0, 0])
        c[0] += int(TASKS[p] == r["label"])
        c[1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


def format_confusion(m: np.ndarray) -> str:
    return ("                    predicted loc  predicted agg\n"
            f"  true localization  {m[0, 0]:>13}  {m[0, 1]:>13}\n"
            f"  true aggregation   {m[1, 0]:>13}  {m[1, 1]:>13}")


def train(data: Path, out: Path | None, embeddings: str | None, log=print) -> dict:
    rows = load_rows(data)
    train_rows = [r for r in rows if r["split"] == "train"]
    test_rows = [r for r in rows if r["split"] == "test"]
    ytr, yte = labels(train_rows), labels(test_rows)
    log(f"data: {data} ({len(train_rows)} train, {len(test_rows)} held-out test; "
        f"train {int(np.sum(ytr == 0))} localization / {int(np.sum(ytr == 1))} aggregation)")
    report: dict = {}

    log("n-gram logistic regression, 5-fold cross-validation on the train split:")
    train_feats = {fs: [featurize(r["text"], fs) for r in train_rows] for fs in FEATURE_SETS}
    (fs, min_df, lam), results = select_ngram(train_feats, ytr, log)
    cv_best = max(acc for _, acc in results)
    vocab, w, b = ngram_fit(train_feats[fs], ytr, min_df, lam)
    p = ngram_predict([featurize(r["text"], fs) for r in test_rows], vocab, w, b)
    pred = (p >= 0.5).astype(np.int64)
    m = confusion(yte, pred)
    acc = float(np.mean(pred == yte))
    log(f"selected: features={fs} min_df={min_df} lambda={lam:g} (cv accuracy {cv_best:.4f}); "
        f"{len(vocab)} features")
    log(f"held-out test accuracy: {acc:.4f} ({int(np.sum(pred == yte))}/{len(yte)})")
    log(format_confusion(m))
    for kind, (c, n) in per_kind(test_rows, pred).items():
        log(f"  {kind:<8} {c}/{n}")
    wrong = [(r["text"], r["label"], float(q)) for r, q, ok in zip(test_rows, p, pred == yte) if not ok]
    for text, label, q in wrong:
        log(f"  wrong: [{label}, p_agg={q:.3f}] {text}")
    report["ngram"] = {"features": fs, "min_df": min_df, "lambda": lam, "cv_accuracy": cv_best,
                       "test_accuracy": acc, "confusion": m.tolist(), "n_features": len(vocab)}

    if embeddings:
        log(f"token-embedding mean + logistic regression ({embeddings}), 5-fold cv on the train split:")
        Etr = embedding_features([r["text"] for r in train_rows], embeddings)
        Ete = embedding_features([r["text"] for r in test_rows], embeddings)
        # standardise with train statistics: raw embedding means are dominated by a shared direction
        mu, sd = Etr.mean(axis=0), Etr.std(axis=0) + 1e-8
        Ztr, Zte = (Etr - mu) / sd / np.sqrt(Etr.shape[1]), (Ete - mu) / sd / np.sqrt(Etr.shape[1])
        def efp(tr, va, lambdas):
            return [logreg.predict_proba(Ztr[va], *logreg.fit(Ztr[tr], ytr[tr], lam)) for lam in lambdas]
        eres = list(zip(LAMBDAS, cv_accuracy(efp, ytr, LAMBDAS)))
        for elam, a in eres:
            log(f"  cv  embeddings lambda={elam:<7g} accuracy={a:.4f}")
        elam, ecv = max(eres, key=lambda r: (r[1], r[0]))
        ww, bb = logreg.fit(Ztr, ytr, elam)
        epred = (logreg.predict_proba(Zte, ww, bb) >= 0.5).astype(np.int64)
        eacc = float(np.mean(epred == yte))
        em = confusion(yte, epred)
        log(f"embeddings selected lambda={elam:g} (cv accuracy {ecv:.4f}); held-out test accuracy {eacc:.4f}")
        log(format_confusion(em))
        report["embeddings"] = {"lambda": elam, "cv_accuracy": ecv, "test_accuracy": eacc,
                                "confusion": em.tolist()}

    if out is not None:
        blob = {
            "format": FORMAT,
            "feature_set": fs,
            "threshold": 0.5,
            "bias": round(b, 9),
            "trained": {"data": data.name, "data_sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
                        "n_train": len(train_rows), "min_df": min_df, "lambda": lam,
                        "cv_accuracy": round(cv_best, 6), "test_accuracy": round(acc, 6),
                        "test_confusion": m.tolist()},
            "weights": {f: round(float(x), 9) for f, x in zip(vocab, w)},
        }
        out.write_text(json.dumps(blob, ensure_ascii=False, indent=0, sort_keys=False) + "\n", encoding="utf-8")
        log(f"wrote {out} ({out.stat().st_size // 1024} KiB)")
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcli.taskclass.train", description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=INSTRUCTIONS_PATH, help="labelled instructions (jsonl)")
    ap.add_argument("--out", type=Path, default=WEIGHTS_PATH, help="where to write the weights")
    ap.add_argument("--no-write", action="store_true", help="evaluate only")
    ap.add_argument("--embeddings", metavar="GGUF", help="also evaluate the token-embedding route on this model")
    a = ap.parse_args(argv)
    train(a.data, None if a.no_write else a.out, a.embeddings, log=lambda s: print(s, file=sys.stdout, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
