"""Chat templates: both engines render the GGUF's jinja template with kvcli.templating, so the same
messages give the same prompt text and the same tokens in the native and the reference engine."""
from __future__ import annotations

import pytest

from kvcli.errors import KvcliError
from kvcli.templating import gguf_special_token_ids, render_chat
from kvcli.testing.tiny_gguf import write_tiny_llama

CONVERSATIONS = [
    [{"role": "user", "content": "Summarise this document.\n\nIt is about « solar » gardens & <tags>."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}],
    [{"role": "user", "content": "First question?"}, {"role": "assistant", "content": "First answer."},
     {"role": "user", "content": "Second question?"}],
]

# a template that uses what real templates use: special-token variables, raise_exception, tojson,
# loop controls, trim_blocks/lstrip_blocks whitespace rules
CUSTOM = """{{ bos_token }}
{% for m in messages %}
  {% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
  {% if m['role'] == 'system' %}{% continue %}{% endif %}
[{{ m['role'] | upper }}] {{ m['content'] | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT] {% endif %}"""


@pytest.fixture(scope="module")
def engines(default_model):
    from kvcli.native.session import NativeSession
    from kvcli.reference.session import ReferenceSession
    n = NativeSession(default_model, n_ctx=0)
    r = ReferenceSession(default_model, n_ctx=0)
    yield n, r
    n.close()


def test_default_model_same_prompt_and_tokens_in_both_engines(engines):
    native, reference = engines
    assert native.special_tokens() == reference.special_tokens() == {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
    for msgs in CONVERSATIONS:
        for gen in (True, False):
            a = native.apply_chat_template(msgs, add_assistant=gen)
            b = reference.apply_chat_template(msgs, add_assistant=gen)
            assert a == b
            assert native.tokenize(a) == reference.tokenize(b)
            # the transformers tokenizer's own rendering of the same template agrees too
            assert a == reference.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    # SmolLM2's template adds its default system turn when the messages have none (llama.cpp's
    # built-in ChatML, which the native engine used before, dropped it)
    p = native.apply_chat_template(CONVERSATIONS[0])
    assert p.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert p.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert native.apply_chat_template(CONVERSATIONS[1]).startswith("<|im_start|>system\nAnswer in one word.<|im_end|>")


@pytest.fixture(scope="module")
def tiny_custom(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tmpl") / "custom.gguf", n_layer=1, n_head=2, n_head_kv=1,
                            head_dim=8, chat_template=CUSTOM)


def test_tiny_model_custom_template_same_in_both_engines(tiny_custom):
    from kvcli.native.session import NativeSession
    from kvcli.reference.session import ReferenceSession
    native, reference = NativeSession(tiny_custom, n_ctx=0), ReferenceSession(tiny_custom, n_ctx=0)
    try:
        msgs = CONVERSATIONS[1] + [{"role": "assistant", "content": 'say "hi"'}]
        a = native.apply_chat_template(msgs)
        assert a == reference.apply_chat_template(msgs)
        # block tags eat their line's newline (trim_blocks), expressions keep theirs
        assert a == ('<|im_start|>\n[USER] "Capital of France?"<|im_end|>\n'
                     '[ASSISTANT] "say \\"hi\\""<|im_end|>\n[ASSISTANT] ')
        assert a == reference.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert native.tokenize(a) == reference.tokenize(a)
        for engine in (native, reference):
            with pytest.raises(KvcliError, match="refuses these messages: bad role tool"):
                engine.apply_chat_template([{"role": "tool", "content": "x"}])
    finally:
        native.close()


def test_template_errors_are_one_line(tmp_path):
    no_template = write_tiny_llama(tmp_path / "none.gguf", n_layer=1, n_head=2, n_head_kv=1, head_dim=8,
                                   chat_template="")
    from kvcli.native.session import NativeSession
    s = NativeSession(no_template, n_ctx=0)
    try:
        with pytest.raises(KvcliError, match="none.gguf has no chat template"):
            s.apply_chat_template(CONVERSATIONS[0])
    finally:
        s.close()
    with pytest.raises(KvcliError, match="not valid jinja"):
        render_chat("{% for m in messages %}", CONVERSATIONS[0])
    with pytest.raises(KvcliError, match="failed"):
        render_chat("{{ messages[0]['content'].nope() }}", CONVERSATIONS[0])
    with pytest.raises(KvcliError, match="needs a 'role' and a 'content'"):
        render_chat("{{ 1 }}", [{"role": "user"}])
    with pytest.raises(KvcliError, match="failed"):  # sandboxed: a template cannot reach Python internals
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", CONVERSATIONS[0])
    assert gguf_special_token_ids(no_template)["eos_token"] == 2   # the copied SmolLM2 tokenizer keys
