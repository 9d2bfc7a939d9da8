"""Foundation: the patched library is loaded, run works end to end, every bad input gets one line and exit 2."""
from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.conftest import EXAMPLES, KVCLI, ROOT, sigint_default

SHORT_DOC = "The meeting moved from Tuesday to Thursday because the hall was booked. Bring the blue folders.\n"


def test_info_reports_patched_native_library(cli_runner):
    from kvcli.cli import cli
    r = cli_runner.invoke(cli, ["info", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["native"]["version"] == __import__("kvcli").__version__
    assert len(out["native"]["llama_commit"]) == 40 and out["native"]["llama_commit"].startswith("0c1e57098")
    assert out["native"]["patched"] is True
    assert out["model"]["architecture"] == "llama" and out["model"]["n_layer"] == 30
    assert out["model"]["n_head_kv"] == 3 and out["model"]["head_dim"] == 64


def test_models_lists_default(cli_runner, default_model):
    from kvcli.cli import cli
    r = cli_runner.invoke(cli, ["models", "--json"])
    assert r.exit_code == 0
    rows = json.loads(r.output)
    assert rows[0]["path"] == str(default_model) and rows[0]["quantisation"] == "Q4_1"


def test_run_json_on_example(run_kvcli):
    r = run_kvcli("run", "--doc", EXAMPLES / "solar-garden.txt", "Summarise this document.", "--json",
                  "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    s = out["stats"]
    assert out["policy"] == "full" and out["answer"].strip()
    assert s["prompt_tokens"] > 1000 and 1 <= s["generated_tokens"] <= 24
    assert abs(s["kv_cells"] - (s["prompt_tokens"] + s["generated_tokens"])) <= 1
    assert s["kv_bytes"] > 0 and s["kv_bytes"] == pytest.approx(s["kv_bytes_full"], rel=0.02)
    assert len(s["per_layer_cells"]) == 30
    for k in ("prefill_s", "compress_s", "decode_s", "decode_tok_s"):
        assert k in s


def test_pipe_leaves_only_the_answer_on_stdout(run_kvcli, tmp_path):
    out = tmp_path / "answer.txt"
    r = run_kvcli("run", "When is the meeting?", "--max-tokens", "12", "--out", out, input=SHORT_DOC)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "prompt tokens" not in r.stdout  # the summary line goes to stderr
    assert "prompt tokens" in r.stderr
    assert out.read_text().strip() == r.stdout.strip()


def test_greedy_run_is_deterministic(cli_runner):
    from kvcli.cli import cli
    args = ["run", "--doc", "-", "Where is the meeting?", "--max-tokens", "8", "--json"]
    a = cli_runner.invoke(cli, args, input=SHORT_DOC)
    b = cli_runner.invoke(cli, args, input=SHORT_DOC)
    assert a.exit_code == 0 and b.exit_code == 0
    assert json.loads(a.stdout)["answer"] == json.loads(b.stdout)["answer"]


def _bad(run_kvcli, *args, input=None):
    r = run_kvcli(*args, input=input)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvcli: error:"), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def test_bad_documents(run_kvcli, tmp_path):
    assert "not found" in _bad(run_kvcli, "run", "--doc", tmp_path / "nope.txt", "x")
    assert "directory" in _bad(run_kvcli, "run", "--doc", tmp_path, "x")
    (tmp_path / "empty.txt").write_text("  \n")
    assert "empty" in _bad(run_kvcli, "run", "--doc", tmp_path / "empty.txt", "x")
    (tmp_path / "bin.dat").write_bytes(bytes(range(256)) * 8)
    assert "not a text file" in _bad(run_kvcli, "run", "--doc", tmp_path / "bin.dat", "x")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 ok\nna\u00efve".encode("latin-1"))
    msg = _bad(run_kvcli, "run", "--doc", tmp_path / "latin1.txt", "x")
    assert "not valid UTF-8" in msg and "offset 3" in msg and "line 1" in msg
    unreadable = tmp_path / "secret.txt"
    unreadable.write_text("x")
    unreadable.chmod(0)
    if not __import__("os").access(unreadable, __import__("os").R_OK):  # root can read anything
        assert "cannot read" in _bad(run_kvcli, "run", "--doc", unreadable, "x")


def test_bad_models(run_kvcli, tmp_path, default_model):
    (tmp_path / "notgguf.gguf").write_text("hello")
    assert "not a GGUF" in _bad(run_kvcli, "run", "--model", tmp_path / "notgguf.gguf", "x", input=SHORT_DOC)
    assert "not found" in _bad(run_kvcli, "info", tmp_path / "missing.gguf")
    trunc = tmp_path / "trunc.gguf"
    with open(default_model, "rb") as f:
        trunc.write_bytes(f.read(5_000_000))
    assert "truncated" in _bad(run_kvcli, "run", "--model", trunc, "x", input=SHORT_DOC)
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "unsupported architecture 'gpt2'" in _bad(run_kvcli, "info", tmp_path / "gpt2.gguf")


def test_prompt_longer_than_context(run_kvcli, tmp_path):
    doc = tmp_path / "long.txt"
    doc.write_text("The quick brown fox jumps over the lazy dog near the river bank. " * 800)
    msg = _bad(run_kvcli, "run", "--doc", doc, "Summarise.")
    assert "8192" in msg and "prompt is" in msg


def test_bad_options(run_kvcli):
    assert "nosuch" in _bad(run_kvcli, "run", "--policy", "nosuch", "--budget", "64", "x", input=SHORT_DOC)
    assert "key=value" in _bad(run_kvcli, "run", "--policy-arg", "oops", "x", input=SHORT_DOC)
    assert "empty" in _bad(run_kvcli, "run", " ", input=SHORT_DOC)


def test_ctrl_c_keeps_partial_answer():
    proc = subprocess.Popen([*KVCLI, "run", "--doc", str(EXAMPLES / "solar-garden.txt"), "Write a long essay.",
                             "--max-tokens", "2000", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, text=True, preexec_fn=sigint_default)
    # wait for the answer to start streaming, then interrupt
    first = proc.stdout.read(20)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert len(first + rest) > 20
    assert "interrupted" in err and "Traceback" not in err
