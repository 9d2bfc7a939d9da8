"""Chat templates: the one renderer both engines use, so the same messages give the same prompt.

A GGUF carries its chat template as jinja source (`tokenizer.chat_template`). llama.cpp's
`llama_chat_apply_template` does not run it: it guesses a built-in format from the source
(SmolLM2's template is taken for plain ChatML, which drops the template's default system turn),
while transformers renders the jinja itself. kvcli renders the jinja source, for both engines,
with the environment transformers gives templates (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, the special tokens as
variables), so a prompt is the one the model's authors wrote the template for.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from kvcli.errors import KvcliError
from kvcli.models import _Header

# the special-token variables templates may use (transformers passes its special_tokens_map)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateRefused(Exception):
    """Raised by a template's own `raise_exception(...)` (e.g. roles in an order it does not accept)."""


def _raise(message):
    raise TemplateRefused(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes <, >, & and ' for HTML: a prompt needs the plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compiled(source: str):
    from jinja2 import TemplateError  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    # sandboxed: the template comes from a model file, not from us
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise KvcliError(f"the model's chat template is not valid jinja: {e}") from None


def render_chat(source: str | None, messages: list[dict], *, add_generation_prompt: bool = True,
                special_tokens: dict | None = None, model: str = "the model") -> str:
    """The prompt text `source` (a GGUF's tokenizer.chat_template) makes of `messages`.

    `special_tokens` maps SPECIAL_TOKEN_NAMES to the tokens' text ("<|endoftext|>"...); a name the
    model lacks is left undefined, as transformers leaves it. Errors (no template, invalid jinja, a
    template that refuses the messages) are one-line KvcliErrors.
    """
    from jinja2 import TemplateError  # noqa: PLC0415

    if not source:
        raise KvcliError(f"{model} has no chat template")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise KvcliError(f"a chat message needs a 'role' and a 'content' string (got {m!r:.80})")
    variables = {k: v for k, v in (special_tokens or {}).items() if k in SPECIAL_TOKEN_NAMES and v is not None}
    try:
        return _compiled(source).render(messages=messages, add_generation_prompt=bool(add_generation_prompt),
                                        **variables)
    except TemplateRefused as e:
        raise KvcliError(f"the chat template of {model} refuses these messages: {e}") from None
    except TemplateError as e:
        raise KvcliError(f"the chat template of {model} failed: {e}") from None


_GGUF_IDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
             "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


@lru_cache(maxsize=8)
def _special_ids(path: str, size: int, mtime_ns: int) -> tuple:
    try:
        values = _Header(Path(path)).values
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise KvcliError(f"cannot parse GGUF {Path(path).name} (truncated or corrupted?): {e}") from None
    ids = tuple((name, int(values[key])) for name, key in _GGUF_IDS.items()
                if isinstance(values.get(key), int) and not isinstance(values.get(key), bool))
    # llama.cpp's default when the key is absent: add BOS, except for gpt2-style BPE vocabularies
    add_bos = values.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = values.get("tokenizer.ggml.model") != "gpt2"
    return ids + ((ADD_BOS, int(bool(add_bos))),)


ADD_BOS = "add_bos"   # not a token: whether the vocabulary puts BOS before a prompt (tokenizer.ggml.add_bos_token)


def gguf_special_token_ids(model_path) -> dict:
    """{bos_token: id, ...} as the GGUF's tokenizer.ggml.*_token_id keys give them (the ids transformers
    builds its special_tokens_map from); a key the file lacks is left out."""
    return {k: v for k, v in _header_tokens(model_path).items() if k != ADD_BOS}


def _header_tokens(model_path) -> dict:
    p = Path(model_path).resolve()
    st = p.stat()
    return dict(_special_ids(str(p), st.st_size, st.st_mtime_ns))


PLAIN_ANSWER_CUE = "\n\nAnswer:"


def plain_prompt(model_path, bos_text: str | None, text: str, system: str | None = None) -> str:
    """The prompt for a model without a chat template (or a base model, --no-template): BOS when the
    vocabulary adds one, the system text and the user text as paragraphs, and an answer cue to continue."""
    bos = bos_text if bos_text and _header_tokens(model_path).get(ADD_BOS) else ""
    return bos + "\n\n".join(p for p in (system, text) if p) + PLAIN_ANSWER_CUE


# the instruction after a document compressed before any question (question-agnostic): its window scores the entries
GENERIC_SUFFIX = "Read the document above carefully: questions about it follow."


def user_message(document: str | None, instruction: str) -> str:
    return f"{document.strip()}\n\n{instruction.strip()}" if document else instruction.strip()


def build_prompt(session, document: str | None, instruction: str, system: str | None = None,
                 template: bool = True) -> str:
    """The chat-templated prompt; a plain-completion one (kvcli.templating.plain_prompt) when the model has no
    chat template or `template` is False (a base model)."""
    if not template or not session.chat_template():
        return plain_prompt(session.model_path, session.special_tokens().get("bos_token"),
                            user_message(document, instruction), system)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user_message(document, instruction)})
    return session.apply_chat_template(messages, add_assistant=True)
