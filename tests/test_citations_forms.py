"""benchmarks/citations_forms.py: its rates (standard error, Wilson interval; numbers checked by hand) and
--summarize over JSON lines it wrote (no model loaded)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "citations_forms.py"
_spec = importlib.util.spec_from_file_location("citations_forms", SCRIPT)
cf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cf)


def test_rate_standard_error_and_wilson_interval():
    # 9/10: s.e. sqrt(0.9 * 0.1 / 10) = 0.095; Wilson 95% 0.596-0.982
    assert cf.rate(9, 10) == "9/10 (90%, s.e. 9%, 95% 60%-98%)"
    # 10/10: s.e. 0, Wilson lower end 10 / (10 + 1.96^2) = 0.722
    assert cf.rate(10, 10) == "10/10 (100%, s.e. 0%, 95% 72%-100%)"
    assert cf.rate(0, 0) == "0/0"


def _row(form, kind, right, first, top3, **extra):
    return {"form": form, "doc": "d", "kind": kind, "right": right, "first": first, "top3": top3, "cite_s": 1.0,
            "ask_s": 2.0, **extra}


def test_summarize_pools_files(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps(r) for r in [_row("exact", "fact", True, True, True),
                                                   _row("exact", "copy", True, False, True),
                                                   _row("exact", "copy", False, False, False)]) + "\n")
    b.write_text(json.dumps(_row("bounded", "fact", True, True, True, fact_streamed=True)) + "\n")
    out = subprocess.run([sys.executable, str(SCRIPT), "--summarize", str(a), str(b)], capture_output=True,
                         text=True, check=True).stdout
    assert "exact: 2/3 right; first cited passage holds the answer in 1/2 (50%" in out
    assert "  copy: 1/2 right; first cited passage holds the answer in 0/1 (0%" in out
    assert "bounded: 1/1 right; first cited passage holds the answer in 1/1 (100%" in out
    assert "the answer's chunk streamed for 1/1" in out


def test_summarize_bad_line_is_one_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"form": "exact"}\nnot json\n')
    r = subprocess.run([sys.executable, str(SCRIPT), "--summarize", str(p)], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip() == f"{p}:1: not a line of benchmarks/citations_forms.py"
    r = subprocess.run([sys.executable, str(SCRIPT), "--summarize", str(tmp_path / "none.jsonl")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
