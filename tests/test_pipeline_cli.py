"""kvcli in shell pipelines: stdin, several documents, --out, config defaults, shell completion."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.conftest import EXAMPLES, KVCLI, ROOT

DOC = (EXAMPLES / "station-log.txt").read_text(encoding="utf-8")[:1600]
KV = " ".join(shlex.quote(a) for a in KVCLI)


@pytest.fixture()
def clean_env(tmp_path):
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path / "cfg"))
    for k in ("KVCLI_POLICY", "KVCLI_BUDGET", "KVCLI_MODEL", "KVCLI_CONFIG"):
        env.pop(k, None)
    return env


def sh(cmd: str, env, cwd=ROOT, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def test_cat_into_run_leaves_only_the_answer(tmp_path, clean_env):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    out = tmp_path / "out"
    q = "Who wrote this log?"
    r = sh(f"cat {doc} | {KV} run --policy snapkv --budget 128 -n 12 {shlex.quote(q)} > {out}", clean_env)
    assert r.returncode == 0, r.stderr
    ref = sh(f"{KV} run --doc {doc} --policy snapkv --budget 128 -n 12 --json {shlex.quote(q)}", clean_env)
    assert ref.returncode == 0, ref.stderr
    res = json.loads(ref.stdout)
    assert out.read_text() == res["answer"] + "\n"  # the answer and nothing else
    assert res["policy"] == "snapkv" and res["stats"]["kv_cells"] <= 128 + 12
    assert "[snapkv @ 128]" in r.stderr and "prompt tokens" in r.stderr


def test_for_loop_over_files_and_stdin_dash(tmp_path, clean_env):
    for name, text in [("a.txt", "The bakery opens at seven. Bread is three euros."),
                       ("b.txt", "The ferry leaves at noon from pier four.")]:
        (tmp_path / name).write_text(text)
    r = sh(f'for f in *.txt; do {KV} run -q --doc "$f" -n 8 "When?" > "$f.answer"; done', clean_env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # --quiet: nothing on stderr
    for name in ("a.txt", "b.txt"):
        assert (tmp_path / f"{name}.answer").read_text().strip()
    # '-' is standard input; several --doc are joined with their names
    both = sh(f"cat a.txt | {KV} run --doc - --doc b.txt -n 8 --json 'When?'", clean_env, cwd=tmp_path)
    one = sh(f"{KV} run --doc b.txt -n 8 --json 'When?'", clean_env, cwd=tmp_path)
    assert both.returncode == 0 and one.returncode == 0, both.stderr + one.stderr
    assert json.loads(both.stdout)["stats"]["prompt_tokens"] > json.loads(one.stdout)["stats"]["prompt_tokens"] + 10


def test_read_documents_names_each_part(tmp_path):
    from kvcli.documents import read_documents
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b.txt").write_text("beta")
    text = read_documents([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")])
    assert text == "### a.txt\n\nalpha\n\n### b.txt\n\nbeta"


def _policy_of(env, *args) -> tuple[str, int | None]:
    r = subprocess.run([*KVCLI, "run", "-n", "1", "--json", *args, "Hi"], input="Short text about ferries.",
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    return out["policy"], out["budget"], out["model"]


def test_config_env_file_and_flags(tmp_path, clean_env):
    from kvcli.testing.tiny_gguf import write_tiny_llama
    tiny = write_tiny_llama(tmp_path / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2, head_dim=16)
    cfg = tmp_path / "cfg" / "kvcli" / "config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(f'policy = "streamingllm"\nbudget = 64\nmodel = "{tiny}"\n')
    assert _policy_of(clean_env) == ("streamingllm", 64, str(tiny))                     # the config file
    env = dict(clean_env, KVCLI_POLICY="snapkv", KVCLI_BUDGET="48")
    assert _policy_of(env)[:2] == ("snapkv", 48)                                         # env beats the file
    assert _policy_of(env, "--policy", "full", "--model", str(tiny))[0] == "full"        # flags beat both
    cfg.write_text('polcy = "snapkv"\n')
    r = subprocess.run([*KVCLI, "run", "Hi"], input="x", capture_output=True, text=True, env=clean_env, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "unknown key 'polcy'" in r.stderr
    cfg.write_text("budget = -3\n")
    r = subprocess.run([*KVCLI, "run", "Hi"], input="x", capture_output=True, text=True, env=clean_env, cwd=ROOT)
    assert r.returncode == 2 and "'budget' must be a positive integer" in r.stderr
    cfg.unlink()
    r = subprocess.run([*KVCLI, "run", "Hi"], input="x", capture_output=True, text=True, cwd=ROOT,
                       env=dict(clean_env, KVCLI_BUDGET="lots"))
    assert r.returncode == 2 and "KVCLI_BUDGET='lots' is not a positive integer" in r.stderr


def test_shell_completion(clean_env):
    env = dict(clean_env, _KVCLI_COMPLETE="bash_complete", COMP_WORDS="kvcli ch", COMP_CWORD="1")
    r = subprocess.run([sys.executable, "-c", "from kvcli.cli import main; main()"], capture_output=True, text=True,
                       env=env, cwd=ROOT)
    assert "plain,chat" in r.stdout.split()
    env.update(COMP_WORDS="kvcli chat --policy sn", COMP_CWORD="3")
    r = subprocess.run([sys.executable, "-c", "from kvcli.cli import main; main()"], capture_output=True, text=True,
                       env=env, cwd=ROOT)
    assert "plain,snapkv" in r.stdout.split()
    env = dict(clean_env, _KVCLI_COMPLETE="bash_source")
    r = subprocess.run([sys.executable, "-c", "from kvcli.cli import main; main()"], capture_output=True, text=True,
                       env=env, cwd=ROOT)
    assert "_kvcli_completion" in r.stdout and "complete " in r.stdout
