"""Which GGUF architectures kvcli accepts, the one-line refusal for the rest, and the plain-completion
prompt of a model without a chat template (or --no-template)."""
from __future__ import annotations

import json

import pytest

from kvcli.testing.tiny_gguf import write_tiny

SHORT_DOC = "The garden has three solar panels and a small pond with six fish. " * 8


def _header_only(path, arch):
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch,why", [("gemma3n", "shared KV layers are not supported"),
                                      ("mamba", "not one kvcli has been made to run")])
def test_refused_architectures_say_what_is_missing(run_kvcli, tmp_path, arch, why):
    r = run_kvcli("info", _header_only(tmp_path / f"{arch}.gguf", arch))
    assert r.returncode == 2
    line = r.stderr.strip()
    assert "\n" not in line and f"unsupported architecture '{arch}'" in line and why in line
    assert "kvcli supports llama, qwen2, qwen3, phi3" in line


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_run_compresses_each_architecture(run_kvcli, tmp_path, arch):
    path = write_tiny(tmp_path / f"{arch}.gguf", arch, n_layer=2)
    r = run_kvcli("run", "--model", path, "--doc", "-", "Summarise.", "--policy", "snapkv", "--budget", "48",
                  "--json", "-n", "3", input=SHORT_DOC)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["stats"]
    assert s["prompt_tokens"] > 100 and s["kv_cells"] <= 48 + s["generated_tokens"]


def test_gemma3_compresses_its_global_layers_and_leaves_the_window(run_kvcli, tmp_path):
    """Layers 0 and 2 slide over 16 tokens (llama.cpp's window cache, left whole); 1 and 3 are compressed."""
    path = write_tiny(tmp_path / "gemma3.gguf", "gemma3", n_layer=4, sliding_window=16, swa_pattern=2)
    args = ("run", "--model", path, "--doc", "-", "Summarise.", "--policy", "snapkv", "--budget", "48", "--json",
            "-n", "3")
    r = run_kvcli(*args, input=SHORT_DOC)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["stats"]
    assert s["sliding_layers"] == [0, 2] and s["sliding_window"] == 16
    assert s["per_layer_cells"][1] == s["per_layer_cells"][3] == s["kv_cells"] <= 48 + s["generated_tokens"]
    # llama.cpp's window cache holds at least the window (it reuses older cells only when it needs room)
    sliding = s["per_layer_cells"][0]
    assert 16 <= sliding == s["per_layer_cells"][2] == s["sliding_cells"] <= s["prompt_tokens"] + s["generated_tokens"]
    # the reference engine compresses the same layers; its sliding layers keep every entry (the window is its mask's)
    r = run_kvcli(*args, "--engine", "reference", input=SHORT_DOC)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["stats"]
    assert s["sliding_layers"] == [0, 2] and s["sliding_window"] == 16
    assert s["per_layer_cells"][1] == s["per_layer_cells"][3] == s["kv_cells"] <= 48 + s["generated_tokens"]
    assert s["per_layer_cells"][0] == s["per_layer_cells"][2] == s["sliding_cells"] >= s["prompt_tokens"]


def test_gemma3_kvc_file_answers_like_run(run_kvcli, tmp_path):
    """A .kvc file of a gemma3 holds both caches (the compacted global one, the window) and answers as run does."""
    path = write_tiny(tmp_path / "gemma3.gguf", "gemma3", n_layer=4, sliding_window=16, swa_pattern=2)
    doc = tmp_path / "doc.txt"
    doc.write_text(SHORT_DOC)
    args = ("--model", path, "--doc", doc, "--policy", "snapkv", "--budget", "48")
    direct = run_kvcli("run", *args, "Summarise.", "-n", "6", "--json")
    assert direct.returncode == 0, direct.stderr
    out = tmp_path / "g.kvc"
    c = run_kvcli("compress", *args, "--question", "Summarise.", "-o", out, "-q")
    assert c.returncode == 0, c.stderr
    cached = run_kvcli("run", "--cache", out, "Summarise.", "-n", "6", "--json")
    assert cached.returncode == 0, cached.stderr
    assert json.loads(cached.stdout)["answer"] == json.loads(direct.stdout)["answer"]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("policy", ["snapkv", "h2o", "pyramidkv"])
def test_sliding_models_read_a_document_in_chunks(run_kvcli, tmp_path, word_doc, arch, policy):
    """--max-cache bounds a sliding-window model's read: the global layers are compacted after every chunk (without
    re-indexing: positions keep growing, within the model's context), the window cache stays llama.cpp's."""
    path = write_tiny(tmp_path / f"{arch}.gguf", arch, n_layer=4, sliding_window=16, swa_pattern=2)
    r = run_kvcli("run", "--model", path, "--doc", word_doc(1200), "What is the last word?", "--policy", policy,
                  "--budget", "48", "--max-cache", "256", "--json", "-n", "3")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["stats"]
    assert s["prompt_tokens"] > 1000 and s["chunks"] >= 4
    assert s["peak_kv_cells"] <= s["cache_cap"] <= 256 and s["sliding_layers"] == [0, 2]
    assert max(s["per_layer_cells"][1], s["per_layer_cells"][3]) == s["kv_cells"]   # pyramidkv: widths differ
    assert 16 <= s["sliding_cells"] <= 256


def test_a_sliding_model_refuses_a_document_past_its_context_in_one_line(run_kvcli, tmp_path, word_doc):
    path = write_tiny(tmp_path / "gemma3.gguf", "gemma3", n_layer=2, n_ctx_train=512, sliding_window=16)
    r = run_kvcli("run", "--model", path, "--doc", word_doc(1200), "What is the last word?", "--policy", "snapkv",
                  "--budget", "48", "-n", "3")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "more than the model's context (512 tokens) allows: a model with sliding-window layers (gemma3) is read " \
           "in chunks without re-indexing its positions" in r.stderr


def test_plain_prompt_without_chat_template(tmp_path):
    from kvcli.native.session import NativeSession
    from kvcli.templating import build_prompt
    from kvcli.templating import PLAIN_ANSWER_CUE
    s = NativeSession(write_tiny(tmp_path / "notpl.gguf", "qwen2", n_layer=1, chat_template=""), n_ctx=0)
    assert s.chat_template() is None or s.chat_template() == ""
    assert build_prompt(s, "The doc.", "The question?", "Be brief.") == \
        "Be brief.\n\nThe doc.\n\nThe question?" + PLAIN_ANSWER_CUE
    s.close()


def test_no_template_flag(run_kvcli, tmp_path, default_model):
    """--no-template on a model with a chat template: the prompt is the plain one (fewer tokens, no markers)."""
    args = ("run", "--doc", "-", "Summarise.", "--json", "-n", "1")
    chat = json.loads(run_kvcli(*args, input=SHORT_DOC).stdout)["stats"]["prompt_tokens"]
    r = run_kvcli(*args, "--no-template", input=SHORT_DOC)
    assert r.returncode == 0, r.stderr
    from kvcli.native.session import NativeSession
    from kvcli.templating import build_prompt
    s = NativeSession(default_model, n_ctx=0)
    expected = len(s.tokenize(build_prompt(s, SHORT_DOC, "Summarise.", template=False)))
    s.close()
    assert json.loads(r.stdout)["stats"]["prompt_tokens"] == expected < chat
