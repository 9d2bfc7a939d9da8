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
import math
import os
from dataclasses import dataclass
from pathlib import Path

from kvcli.errors import KvcliError
from kvcli.models import LongRope, header_values, longrope, read_f32_tensor, read_model_info

_LOADED: dict[tuple, "LoadedModel"] = {}


@dataclass
class LoadedModel:
    model: object          # transformers *ForCausalLM (MODEL_TYPES), eval mode, float32
    tokenizer: object      # transformers tokenizer rebuilt from the GGUF
    eog_ids: frozenset     # end-of-generation tokens, as llama.cpp's vocabulary marks them
    qk_permuted: bool      # the GGUF's Q/K rows are permuted for llama.cpp's "normal" RoPE (see hf_to_gguf_dims)
    longrope: LongRope | None = None   # phi3's LongRoPE pair: the context's size picks the factors (use_rope_context)
    inv_freq: object = None            # the rotary embedding's inverse frequencies before LongRoPE's factors


# The tokens llama.cpp's vocabulary loader marks as end-of-generation by their text (the common
# ones of its list in src/llama-vocab.cpp); the GGUF's eos id is always one.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
             "<|end_of_text|>", "<EOT>", "</s>", "<eos>")


# transformers model types of the architectures kvcli.models accepts; every one calls the registered
# attention function with post-RoPE Q/K and the module's layer_idx (the model's layer index)
MODEL_TYPES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
# llama.cpp's converter permutes Q/K rows only where llama.cpp rotates adjacent pairs ("normal" RoPE);
# the others (NEOX RoPE) keep transformers' (j, j + d/2) order in the file
PERMUTED_QK = ("llama",)


def load(path) -> LoadedModel:
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _LOADED:
        _LOADED[key] = _load(path)
    return _LOADED[key]


def _config(path: Path):
    """transformers' config of the GGUF, corrected where its GGUF mapping reads the file otherwise than llama.cpp:
    the head size (it does not read `attention.key_length`, so a qwen3 model would get Qwen3Config's default
    head_dim, 128, whatever the file says) and, for gemma2/gemma3, `_gemma_config`."""
    from transformers import AutoConfig  # noqa: PLC0415

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    info = read_model_info(path)
    if hasattr(config, "head_dim"):
        config.head_dim = info.head_dim
    if info.architecture in GEMMA_27B_LAYERS:
        _gemma_config(config, info)
    else:
        config.rope_parameters = _rope_parameters(info)
    return config


def _rope_parameters(info) -> dict:
    """transformers' rope_parameters for RoPE as llama.cpp computes it from the file (llama_model::load_hparams and
    llama_context's constructor; ggml's rope_yarn), where transformers' GGUF mapping reads only `rope.freq_base`:
    - freq_scale = 1 / `rope.scaling.factor` (or the older `rope.scale_linear`): transformers' "linear" type;
    - YaRN: llama.cpp takes beta_fast 32, beta_slow 1 and ext_factor 1 from its defaults (it does not read the file's
      yarn_* keys for these architectures), the original context from `rope.scaling.original_context_length` (else
      the trained one), and scales cos/sin by `rope.scaling.attn_factor` x (1 + 0.1 ln factor): transformers'
      "yarn" type with those values;
    - LongRoPE (phi3's `rope_factors_long/short`; type "longrope" or none): no frequency scaling beyond a file's factor;
      the factors are applied per context (use_rope_context), the attn_factor as outside YaRN.
    A `rope.scaling.attn_factor` outside YaRN scales cos/sin alike (`_apply_file_rope`); so do `rope_freqs`."""
    meta = gguf_scalars(info.path, ("rope.scaling.type", "rope.scaling.factor", "rope.scale_linear",
                                    "rope.scaling.original_context_length", "rope.scaling.attn_factor"))
    scaling = str(meta.get("rope.scaling.type") or "linear")     # llama.cpp's default
    factor = float(meta.get("rope.scaling.factor") or meta.get("rope.scale_linear") or 0.0) or 1.0
    theta = float(info.rope_theta)
    if scaling not in ("none", "linear", "yarn", "longrope"):
        raise KvcliError(f"{info.path.name}: RoPE scaling type {scaling!r} is not supported by the reference engine")
    if scaling == "yarn":
        attn = float(meta.get("rope.scaling.attn_factor", 1.0))
        return {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": int(meta.get("rope.scaling.original_context_length")
                                                        or info.n_ctx_train),
                "attention_factor": attn * (1.0 + 0.1 * math.log(factor) if factor > 1.0 else 1.0)}
    if scaling == "none" or factor == 1.0:
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "linear", "factor": factor, "rope_theta": theta}


# Architectures whose llama.cpp graph divides each RoPE frequency by the file's `rope_freqs` tensor (ggml_rope_ext's
# freq_factors; src/models/llama.cpp): the converter writes it for every Llama 3.1/3.2/3.3 (rope_type "llama3").
# qwen2/qwen3/gemma pass no factors; phi3 has LongRoPE's pair of tensors instead.
ROPE_FREQS_ARCHS = ("llama",)


def _apply_file_rope(model, info) -> None:
    """What llama.cpp's RoPE takes from the file and no transformers rope type does, set on the loaded model's rotary
    embedding: pair i rotates by theta_i / rope_freqs[i] (ggml_rope_cache_init; transformers' "llama3" type would
    recompute the factors from constants the GGUF does not keep), and outside YaRN cos/sin are scaled by
    `rope.scaling.attn_factor` (llama.cpp's mscale). K re-rotation (KeyRotation) uses the same embedding, as
    llama.cpp's K-shift uses the same factors and mscale."""
    import torch  # noqa: PLC0415
    rotary = model.model.rotary_emb
    factors = read_f32_tensor(info.path, "rope_freqs.weight") if info.architecture in ROPE_FREQS_ARCHS else None
    if factors is not None:
        if factors.shape != rotary.inv_freq.shape:
            raise KvcliError(f"{info.path.name}: rope_freqs has {factors.size} factors, not head_dim / 2 = "
                             f"{rotary.inv_freq.numel()}")
        for name in ("inv_freq", "original_inv_freq"):
            setattr(rotary, name, getattr(rotary, name) / torch.from_numpy(factors))
    attn = float(gguf_scalars(info.path, ("rope.scaling.attn_factor",)).get("rope.scaling.attn_factor", 1.0))
    if attn != 1.0 and model.config.rope_parameters.get("rope_type") != "yarn":   # YaRN's is in attention_factor
        if info.architecture in GEMMA_27B_LAYERS:
            raise KvcliError(f"{info.path.name}: the reference engine does not scale a gemma model's RoPE by "
                             "rope.scaling.attn_factor")
        rotary.attention_scaling = attn


# llama.cpp's gemma model types with another attention scale (src/models/gemma2.cpp, gemma3.cpp: LLM_TYPE_27B)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's defaults where a gemma2 file has no soft-capping keys (llama_hparams)
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


def _gemma_config(config, info) -> None:
    """What llama.cpp's gemma2/gemma3 loaders (src/models/gemma2.cpp, gemma3.cpp, llama_model::load_hparams) read
    and transformers' GGUF mapping does not (transformers 5.23 takes a tiny gemma3's every layer as sliding, its
    period of 6 counted the other way round, 256 as query_pre_attn_scalar, 10000 as gemma3's sliding RoPE base,
    neither RoPE scaling nor the file's soft-capping):
    - which layers slide: kvcli.models reads them as llama.cpp does (`sliding_layers`); the window is the file's;
    - Q is scaled by 1/sqrt(head_dim), by 1/sqrt(n_embd / n_head) for the 27B models only;
    - gemma3: the global layers rotate with `rope.freq_base` and the file's linear scaling factor, the sliding
      ones with `rope.freq_base_swa` (default 10000) unscaled (its rope_freq_scale_train_swa is 1);
      `final_logit_softcapping` when the file has one; no attention soft-capping;
    - gemma2: every layer rotates alike (its sliding base and scale default to the global ones); the attention
      scores and the logits are soft-capped, with the file's caps or llama.cpp's defaults (50, 30)."""
    meta = gguf_scalars(info.path, ("rope.freq_base_swa", "rope.dimension_count", *GEMMA2_SOFTCAPS))
    rot = int(meta.get("rope.dimension_count") or info.head_dim)
    if rot != info.head_dim:
        raise KvcliError(f"the reference engine rotates whole heads: {info.path.name} rotates {rot} of "
                         f"{info.head_dim} dimensions")
    config.layer_types = ["sliding_attention" if il in info.sliding_layers else "full_attention"
                          for il in range(info.n_layer_model)]
    if info.sliding_window:
        config.sliding_window = info.sliding_window
    config.query_pre_attn_scalar = (info.n_embd // info.n_head
                                    if info.n_layer_model == GEMMA_27B_LAYERS[info.architecture] else info.head_dim)
    full = _rope_parameters(info)
    if full["rope_type"] == "yarn":
        raise KvcliError(f"{info.path.name}: YaRN RoPE scaling is not supported by the reference engine for "
                         f"{info.architecture} (the native engine runs it)")
    if info.architecture == "gemma2":
        if float(meta.get("rope.freq_base_swa", info.rope_theta)) != float(info.rope_theta):
            raise KvcliError(f"the reference engine rotates every layer of a gemma2 model alike: {info.path.name} "
                             "gives its sliding layers another RoPE base")
        for key, default in GEMMA2_SOFTCAPS.items():
            setattr(config, key, float(meta.get(key, default)))
        config.rope_parameters = full
        return
    config.attn_logit_softcapping = None
    config.final_logit_softcapping = float(meta["final_logit_softcapping"]) \
        if meta.get("final_logit_softcapping") else None
    sliding = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base_swa") or 10000.0)}
    config.rope_parameters = {"full_attention": full, "sliding_attention": sliding}


def gguf_scalars(path: Path, names) -> dict:
    """The `{architecture}.NAME` scalars of a GGUF header that are present."""
    info = read_model_info(path)
    values = header_values(path)
    return {n: values[f"{info.architecture}.{n}"] for n in names
            if values.get(f"{info.architecture}.{n}") is not None}


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
            config = _config(path)
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                         attn_implementation=attn, config=config)
    except KvcliError:
        raise
    except Exception as e:  # transformers raises many kinds for a GGUF it cannot convert
        raise KvcliError(f"transformers could not load {path.name}: {str(e).splitlines()[0][:200]}") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.utils.logging.enable_progress_bar()
    model.eval()
    info = read_model_info(path)
    _apply_file_rope(model, info)
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise KvcliError(f"the reference engine supports {', '.join(MODEL_TYPES)} models, {path.name} is {model_type}")
    vocab = tok.get_vocab()
    eog = {i for t, i in vocab.items() if t in EOG_TEXTS}
    if tok.eos_token_id is not None:
        eog.add(int(tok.eos_token_id))
    loaded = LoadedModel(model=model, tokenizer=tok, eog_ids=frozenset(eog), qk_permuted=model_type in PERMUTED_QK,
                         longrope=longrope(path))
    if loaded.longrope:
        loaded.inv_freq = model.model.rotary_emb.inv_freq.clone()
        use_rope_context(loaded, info.n_ctx_train)
    return loaded


def use_rope_context(loaded: LoadedModel, n_ctx: int) -> None:
    """Rotate as llama.cpp does in a context of `n_ctx` cells: a LongRoPE model's frequencies divided by its long
    factors above the original context, by its short ones otherwise (llama_model::get_rope_factors). The weights
    are shared by a process's sessions, so each sets its own context's factors before it runs the model."""
    lr = loaded.longrope
    if lr is None:
        return
    import torch  # noqa: PLC0415
    rotary = loaded.model.model.rotary_emb
    regime = lr.regime(n_ctx)
    if getattr(rotary, "kvcli_rope", None) == regime:
        return
    factors = lr.factors(n_ctx)
    inv_freq = loaded.inv_freq if factors is None else loaded.inv_freq / torch.from_numpy(factors)
    for name in ("inv_freq", "original_inv_freq"):
        setattr(rotary, name, inv_freq.clone())
    rotary.kvcli_rope = regime


def forward_cached(model, ids, position_ids, cache):
    """`model(...)` for the last logit of `ids` at `position_ids`, appending to `cache`. transformers 5.24
    renamed the cache argument (past_key_values -> cache, the old name deprecated): pass the name this
    version's forward declares, so neither version warns."""
    import inspect  # noqa: PLC0415
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    return model(input_ids=ids, position_ids=position_ids, use_cache=True, logits_to_keep=1, **{name: cache})
