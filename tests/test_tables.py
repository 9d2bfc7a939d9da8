"""benchmarks/tables.py --merge: pooling eval rounds and fidelity documents (numbers checked by hand)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tables)


def _ruler(seed, scores):
    """One round: task -> {(policy, budget): score}."""
    recs = [{"task": t, "length": 8192, "depth": 0.5, "sample": 0, "policy": p, "budget": b, "score": s, "status": "ok"}
            for t, cells in scores.items() for (p, b), s in cells.items()]
    return {"kind": "eval", "task": "ruler", "model": "/m/qwen.gguf", "settings": {"seed": seed}, "records": recs}


def _fidelity(doc, ppl):
    recs = [{"task": "fidelity", "doc": doc, "length": 4096, "depth": None, "sample": 0, "policy": p, "budget": b,
             "ppl": v, "kl_mean": 0.0 if p == "full" else 1.0, "status": "ok"} for (p, b), v in ppl.items()]
    return {"kind": "eval", "task": "fidelity", "model": "/m/qwen.gguf", "records": recs}


ROUNDS = [_ruler(0, {"vt": {("full", None): 100, ("snapkv", 128): 100},
                     "niah_single": {("full", None): 100, ("snapkv", 128): 0}}),
          _ruler(1, {"vt": {("full", None): 50, ("snapkv", 128): 50},
                     "niah_single": {("full", None): 100, ("snapkv", 128): 100}})]
DOCS = [_fidelity("a.txt", {("full", None): 2.0, ("h2o", 128): 4.0}),
        _fidelity("b.txt", {("full", None): 4.0, ("h2o", 128): 20.0})]


def test_pool_scores_mean_standard_error_and_fraction_of_full():
    cells, full = tables.pool_scores(ROUNDS)
    assert full[(8192, "all tasks")] == [100, 100, 50, 100]
    mean, se, n, frac = cells[(8192, "all tasks", "snapkv", 128)]
    assert (mean, n) == (62.5, 4)
    assert se == pytest.approx((sum((x - 62.5) ** 2 for x in (100, 0, 50, 100)) / 3 / 4) ** 0.5)
    assert frac == pytest.approx(62.5 / 87.5)
    assert cells[(8192, "vt", "snapkv", 128)][:3] == (75, 25, 2)


def test_pool_fidelity_ratio_of_means_and_document_range():
    cells, full = tables.pool_fidelity(DOCS)
    assert full == {4096: [2.0, 4.0]}
    ratio, lo, hi, kl = cells[(4096, "h2o", 128)]
    assert ratio == pytest.approx(24.0 / 6.0) and (lo, hi, kl) == (2.0, 5.0, 1.0)


def test_merge_cli_tables_and_plots(tmp_path):
    paths = []
    for i, res in enumerate(ROUNDS + DOCS):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(res))
    run = [sys.executable, str(ROOT / "benchmarks" / "tables.py"), "--merge"]
    out = subprocess.run([*run, *map(str, paths[:2]), "--plot", str(tmp_path / "r.png")], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert "| snapkv | 62 +- 24 (0.71) |" in out.stdout and (tmp_path / "r.png").stat().st_size > 1000
    out = subprocess.run([*run, *map(str, paths[2:]), "--plot", str(tmp_path / "f.png")], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert "| h2o | 4.00 (2.00–5.00) [1.00] |" in out.stdout and (tmp_path / "f.png").stat().st_size > 1000
    mixed = subprocess.run([*run, str(paths[0]), str(paths[2])], capture_output=True, text=True)
    assert mixed.returncode == 2 and "not a mix" in mixed.stderr.strip().splitlines()[-1]
    bad = subprocess.run([*run, str(paths[0]), "--plot", str(tmp_path / "no" / "x.png")], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "does not exist" in bad.stderr.strip().splitlines()[-1]
