"""Loading a GGUF into transformers (float32, CPU) with the kvcli attention, once per process.

`from_pretrained(dir, gguf_file=name)` dequantises every tensor to float32 and un-permutes the
Q/K rows that llama.cpp's converter permuted; its tokenizer is rebuilt from the GGUF's
`tokenizer.*` keys. Both take seconds (the gguf reader parses the 49k-token vocabulary each
time), so a process loads each file once: the weights are never modified (a session's cache
lives outside the model), so sessions can share them.
"""
from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from pathlib import Path

from kvcli.errors import KvcliError

_LOADED: dict[tuple, "LoadedModel"] = {}


@dataclass
class LoadedModel:
    model: object          # transformers LlamaForCausalLM, eval mode, float32
    tokenizer: object      # transformers tokenizer rebuilt from the GGUF
    eog_ids: frozenset     # end-of-generation tokens, as llama.cpp's vocabulary marks them


# The tokens llama.cpp's vocabulary loader marks as end-of-generation by their text (the common
# ones of its list in src/llama-vocab.cpp); the GGUF's eos id is always one.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
             "<|end_of_text|>", "<EOT>")


def load(path) -> LoadedModel:
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _LOADED:
        _LOADED[key] = _load(path)
    return _LOADED[key]


def _load(path: Path) -> LoadedModel:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    from kvcli.reference.attention import register  # noqa: PLC0415

    attn = register()
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()   # its GGUF loader logs progress bars and notices on stderr
    transformers.utils.logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # its tqdm bar ignores the verbosity setting
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                         attn_implementation=attn)
    except Exception as e:  # transformers raises many kinds for a GGUF it cannot convert
        raise KvcliError(f"transformers could not load {path.name}: {str(e).splitlines()[0][:200]}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.utils.logging.enable_progress_bar()
    model.eval()
    if getattr(model.config, "model_type", None) != "llama":
        raise KvcliError(f"the reference engine supports llama models, {path.name} is {model.config.model_type}")
    vocab = tok.get_vocab()
    eog = {i for t, i in vocab.items() if t in EOG_TEXTS}
    if tok.eos_token_id is not None:
        eog.add(int(tok.eos_token_id))
    return LoadedModel(model=model, tokenizer=tok, eog_ids=frozenset(eog))
