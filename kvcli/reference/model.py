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
from kvcli.models import read_model_info

_LOADED: dict[tuple, "LoadedModel"] = {}


@dataclass
class LoadedModel:
    model: object          # transformers *ForCausalLM (MODEL_TYPES), eval mode, float32
    tokenizer: object      # transformers tokenizer rebuilt from the GGUF
    eog_ids: frozenset     # end-of-generation tokens, as llama.cpp's vocabulary marks them
    qk_permuted: bool      # the GGUF's Q/K rows are permuted for llama.cpp's "normal" RoPE (see hf_to_gguf_dims)


# The tokens llama.cpp's vocabulary loader marks as end-of-generation by their text (the common
# ones of its list in src/llama-vocab.cpp); the GGUF's eos id is always one.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
             "<|end_of_text|>", "<EOT>")


# transformers model types of the architectures kvcli.models accepts; every one calls the registered
# attention function with post-RoPE Q/K and the module's layer_idx
MODEL_TYPES = ("llama", "qwen2", "qwen3", "phi3")
# llama.cpp's converter permutes Q/K rows only where llama.cpp rotates adjacent pairs ("normal" RoPE);
# the others (NEOX RoPE) keep transformers' (j, j + d/2) order in the file
PERMUTED_QK = ("llama",)


def load(path) -> LoadedModel:
    path = Path(path).resolve()
    info = read_model_info(path)
    if info.sliding_layers:
        raise KvcliError(f"the reference engine does not run models with sliding-window layers ({info.architecture}: "
                         f"{len(info.sliding_layers)} of {info.n_layer_model} layers slide); use the native engine")
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _LOADED:
        _LOADED[key] = _load(path)
    return _LOADED[key]


def _config(path: Path):
    """transformers' config of the GGUF, with the head size the file states: its GGUF mapping does not read
    `attention.key_length`, so a qwen3 model would get Qwen3Config's default head_dim (128) whatever the file says."""
    from transformers import AutoConfig  # noqa: PLC0415


    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if hasattr(config, "head_dim"):
        config.head_dim = read_model_info(path).head_dim
    return config


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
                                                         attn_implementation=attn, config=_config(path))
    except Exception as e:  # transformers raises many kinds for a GGUF it cannot convert
        raise KvcliError(f"transformers could not load {path.name}: {str(e).splitlines()[0][:200]}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.utils.logging.enable_progress_bar()
    model.eval()
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise KvcliError(f"the reference engine supports {', '.join(MODEL_TYPES)} models, {path.name} is {model_type}")
    vocab = tok.get_vocab()
    eog = {i for t, i in vocab.items() if t in EOG_TEXTS}
    if tok.eos_token_id is not None:
        eog.add(int(tok.eos_token_id))
    return LoadedModel(model=model, tokenizer=tok, eog_ids=frozenset(eog), qk_permuted=model_type in PERMUTED_QK)
