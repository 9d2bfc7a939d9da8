#!/usr/bin/env python3
"""How the block index should score chunks: every question's per-row chunk maxima dumped once from stored reads, then
scorings compared offline (issue #63; how kvcli/drivers/block_index.py's rows, layers, scoring and candidates were
chosen, on the corpus's tuning part).

    python benchmarks/index_scoring.py dump --corpus corpus/ --split tune --docs py-datamodel,man-proc \
        --stores /tmp/stores-tune --out /tmp/scoring          # the stores index_recall.py --stores kept
    python benchmarks/index_scoring.py compare /tmp/scoring q/z3/exact/6-18 last32/share/two:share:share:4

dump: per document, each question (the summary question too) rendered as chat's first question; the prompt's tokens
after the stored document (at most ROWS) prefilled after the store's summary with every query observed
(block_index.question_queries), and for every chunk the largest logit per (layer, query head, query) by its page
bounds (`b`) and by its real keys (`r`): DIR/<doc>.npz and DIR/<doc>.json (evidence chunks, rows' text).

compare: a variant is ROWS/SCORE/MODE[/LAYERS]:
    ROWS   last32 (the prompt's last 32 tokens), cap64 (the last 64), q (all but the document's tail the store leaves
           out), all;
    SCORE  share (a softmax over the chunks per row, summed), zK (each row standardised over the chunks, the excess
           over K summed), lse, vote; -c appended: less the question-agnostic summary question's score per row;
    MODE   exact (real keys of every chunk), bound (the page bounds alone), candN (recall of the bounds' best N x
           select), two:S1:S2:N (S1 on the bounds picks N x select candidates, S2 on their real keys the select);
    LAYERS A-B (layers A..B-1 only).
Prints, per variant, the questions whose evidence chunks were all chosen (the first and last are always streamed).
"""
from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

import numpy as np
from bench_common import ROOT

sys.path.insert(0, str(ROOT))

from kvcli.drivers.reselect import STORE_TAIL  # noqa: E402  the document's last tokens a store leaves to the prompt

ROWS = 192


def dump(a) -> None:
    from index_recall import evidence_chunks
    from kvcli.drivers import block_index
    from kvcli.drivers.chunked import DEFAULT_CHUNK, pad_cells
    from kvcli.drivers.chunked_store import _snapshot_of
    from kvcli.drivers.compress import resolve
    from kvcli.drivers.reselect_bounded import ChunkedStore
    from kvcli.evaluation.corpus import corpus_documents, load_manifest
    from kvcli.evaluation.corpus_eval import doc_questions
    from kvcli.evaluation.questions import KINDS
    from kvcli.evaluation.runner import TURN_ROOM
    from kvcli.evaluation.tasks import prefix_text, render
    from kvcli.models import resolve_model
    from kvcli.native.session import NativeSession
    from kvcli.native.state import chunk_keys

    model = resolve_model(a.model)
    docs, _ = corpus_documents(a.corpus, a.split, None, None, a.docs, 0)
    formats = {d["id"]: d["format"] for d in load_manifest(a.corpus)["documents"]}
    s = NativeSession(model, n_ctx=pad_cells(DEFAULT_CHUNK), n_threads=a.threads, n_seq=2)
    cfg = resolve(model, "snapkv", a.budget)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for d in docs:
        store = ChunkedStore.open(Path(a.stores) / d.name, model)
        s.resize_context(pad_cells(cfg.budget + store.chunk + TURN_ROOM), 2)
        head_text = prefix_text(s, d.text, False)
        texts = [s.detokenize(store.tokens[c.first_token:c.first_token + c.n]) for c in store.chunks]
        bounds = [sum(len(t) for t in texts[:i + 1]) for i in range(len(texts))]
        head_chars = head_text.index(d.text.strip()[:200])
        queries, rec = [], []
        for i, q in enumerate(doc_questions(d, formats, a.per_kind, KINDS)):
            prompt = s.tokenize(render(s, d.text, [], q.question))
            probe = prompt[store.split:][-ROWS:]
            s.restore_seq(_snapshot_of(store.summary, store._read_file(store.summary)), 0)
            try:
                queries.append(block_index.question_queries(s, 0, probe, at=store.cap))
            finally:
                s.clear(0)
            rec.append({"i": i, "kind": q.kind, "rows": len(probe),
                        "evidence": [] if q.kind == "summary" else evidence_chunks(q, d.text, head_chars, bounds)})
        n = len(store.chunks)
        bound = [np.empty((n,) + q.shape[:3], np.float16) for q in queries]
        real = [np.empty((n,) + q.shape[:3], np.float16) for q in queries]
        for c in range(n):
            lo, hi = block_index.load_pages(store._read_file(store.pages[c]), s.info)
            keys = chunk_keys(store._read_chunk(store.chunks[c]), s.info.n_head_kv)[0]
            for j, q in enumerate(queries):
                bound[j][c] = block_index.chunk_maxima(q, lo, hi)
                real[j][c] = block_index.key_maxima(q, keys)
        np.savez(out / f"{d.name}.npz", **{f"b{j}": b for j, b in enumerate(bound)},
                 **{f"r{j}": r for j, r in enumerate(real)})
        (out / f"{d.name}.json").write_text(json.dumps({"doc": d.name, "chunks": n, "questions": rec,
                                                        "select": store.chunks_per_question(a.budget)}))
        store.close()
        print(d.name, n, "chunks,", len(rec), "questions", flush=True)
    s.close()


def row_slice(rows: str, w: int) -> slice:
    return {"last32": slice(max(w - 32, 0), w), "cap64": slice(max(w - 64, 0), w), "q": slice(STORE_TAIL, w),
            "all": slice(0, w)}[rows]


def score(m: np.ndarray, how: str) -> np.ndarray:
    """m [chunks, L, H, w] -> [chunks]."""
    flat = m.reshape(m.shape[0], -1).astype(np.float64)
    if how == "share":
        p = np.exp(flat - flat.max(axis=0))
        return (p / p.sum(axis=0)).sum(axis=1)
    if how.startswith("z"):
        z = (flat - flat.mean(axis=0)) / (flat.std(axis=0) + 1e-6)
        return np.maximum(z - float(how[1:]), 0).sum(axis=1)
    if how == "lse":
        return np.log(np.exp(flat - flat.max()).sum(axis=1))
    if how == "vote":
        return np.bincount(flat.argmax(axis=0), minlength=flat.shape[0]).astype(float)
    raise SystemExit(f"unknown score {how}")


def scored(m, agnostic, rows: str, how: str) -> np.ndarray:
    contrast = how.endswith("-c")
    how = how[:-2] if contrast else how
    s = score(m[..., row_slice(rows, m.shape[3])], how)
    if contrast:    # per row, so that the two probes' lengths do not weigh
        a = agnostic[..., row_slice(rows, agnostic.shape[3])]
        s = s / m[..., row_slice(rows, m.shape[3])].shape[3] - score(a, how) / a.shape[3]
    return s


def best(s: np.ndarray, k: int) -> list[int]:
    return sorted(np.argsort(-s, kind="stable")[:k].tolist())


def compare(a) -> None:
    for variant in a.variants:
        parts = variant.split("/")
        rows, how, mode = parts[:3]
        layers = slice(*(int(x) for x in parts[3].split("-"))) if len(parts) > 3 else slice(None)
        hits, n, per = 0, 0, {}
        for f in sorted(glob.glob(str(Path(a.dir) / "*.npz"))):
            meta = json.loads(Path(f).with_suffix(".json").read_text())
            z = np.load(f)
            chunks, select = meta["chunks"], meta["select"]
            agn = next(q for q in meta["questions"] if q["kind"] == "summary")
            inner = lambda key, z=z, layers=layers: z[key][1:-1, layers]   # noqa: E731
            for q in meta["questions"]:
                if q["kind"] == "summary":
                    continue
                r, b = inner(f"r{q['i']}"), inner(f"b{q['i']}")
                ra, ba = inner(f"r{agn['i']}"), inner(f"b{agn['i']}")
                if mode == "exact":
                    chosen = best(scored(r, ra, rows, how), select)
                elif mode == "bound":
                    chosen = best(scored(b, ba, rows, how), select)
                elif mode.startswith("cand"):
                    chosen = best(scored(b, ba, rows, how), int(mode[4:]) * select)
                elif mode.startswith("two:"):
                    _, first, second, k = mode.split(":")
                    cands = best(scored(b, ba, rows, first), int(k) * select)
                    chosen = [cands[j] for j in best(scored(r[cands], ra[cands], rows, second), select)]
                else:
                    raise SystemExit(f"unknown mode {mode}")
                hit = all(e - 1 in chosen for e in q["evidence"] if 0 < e < chunks - 1)
                hits += hit
                n += 1
                per.setdefault(meta["doc"], [0, 0])
                per[meta["doc"]][0] += hit
                per[meta["doc"]][1] += 1
        print(f"{variant:34s} {hits:3d} of {n} ({100 * hits / max(n, 1):.1f}%)  " +
              "  ".join(f"{d}: {h}/{m}" for d, (h, m) in per.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--model", default="qwen2.5-coder-0.5b")
    d.add_argument("--corpus", required=True)
    d.add_argument("--split", default="tune", choices=["tune", "heldout", "all"])
    d.add_argument("--docs", required=True)
    d.add_argument("--stores", required=True)
    d.add_argument("--budget", type=int, default=1024)
    d.add_argument("--per-kind", type=int, default=4)
    d.add_argument("--threads", type=int, default=2)
    d.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("dir")
    c.add_argument("variants", nargs="+")
    a = ap.parse_args()
    dump(a) if a.cmd == "dump" else compare(a)


if __name__ == "__main__":
    main()
