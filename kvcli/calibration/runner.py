"""The torch side of calibration: run the reference engine's model and look at its attention.

The model is the reference engine's (kvcli.reference.model.load: the same GGUF, dequantised to
float32). For speed the forward passes use PyTorch's fused attention (sdpa), and a forward hook on
every attention module recomputes, for the few query rows calibration needs, the post-RoPE query
and its softmax attention over the layer's cached post-RoPE keys: exactly the probabilities eager
attention would give (scale 1/sqrt(head_dim), GQA map q -> q // group), without materialising the
full prefill attention. The hook also has V and o_proj at hand for the layer error profile.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from kvcli.errors import KvcliError
from kvcli.reference.model import forward_cached, use_rope_context
from kvcli.templating import plain_prompt, render_chat


@dataclass
class LM:
    model: object
    tokenizer: object
    eog_ids: frozenset
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    # model index of each layer kvcli compresses (ModelInfo.kv_layers): every layer, or a sliding-window model's
    # global ones; calibration scores and squeezes these (layer l of its arrays is model layer layers[l])
    layers: tuple = ()
    model_path: str = ""
    loaded: object = None    # kvcli.reference.model.LoadedModel (LongRoPE factors per context)

    @property
    def group(self) -> int:
        return self.n_head // self.n_head_kv

    def template(self, user: str) -> str:
        """The prompt `kvcli run` would give the model: its chat template, or the plain-completion prompt of a
        model without one (gemma-3-270m)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            return plain_prompt(self.model_path, self.tokenizer.bos_token, user)
        return render_chat(self.tokenizer.chat_template, [{"role": "user", "content": user}],
                           special_tokens=self.tokenizer.special_tokens_map)

    def n_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def piece(self, token: int) -> str:
        return self.tokenizer.decode([int(token)], skip_special_tokens=True)


def load_lm(model_path) -> LM:
    from kvcli.models import read_model_info  # noqa: PLC0415
    from kvcli.reference.model import load  # noqa: PLC0415
    info = read_model_info(model_path)
    if info.architecture == "gemma2":
        # the probes run with fused attention (sdpa), which has no soft-capping
        raise KvcliError("compresskv calibration does not support gemma2 yet: its attention soft-caps the scores, "
                         "which the fused attention calibration runs with does not")
    loaded = load(model_path)
    cfg = loaded.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return LM(loaded.model, loaded.tokenizer, loaded.eog_ids, info.n_layer, int(cfg.num_attention_heads),
              int(cfg.num_key_value_heads), int(head_dim), tuple(info.kv_layers), str(model_path), loaded)


@contextlib.contextmanager
def sdpa(model):
    """Run the shared (cached) reference model with fused attention for the duration; put back the
    kvcli attention afterwards, since ReferenceSession objects share the same model object."""
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


LayerFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, object], None]


class QueryHook:
    """Forward hooks on each attention module. After the module ran (the cache now holds this
    step's keys), `fn(layer, q, K, V, module)` gets the last `rows` post-RoPE queries
    q [n_head, rows, d] and the layer's whole cache K, V [n_head_kv, n, d]; `layer` counts the compressed
    layers only (a sliding-window layer is not hooked: kvcli never compresses it)."""

    def __init__(self, lm: LM, fn: LayerFn):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: PLC0415
        self.lm, self.fn, self.rows = lm, fn, 1
        self.cache = None  # the DynamicCache the hooked forward writes into (set by Runner)
        self._plan_layer = {il: l for l, il in enumerate(lm.layers)}
        self._rope = apply_rotary_pos_emb
        self._handles = []

    def __enter__(self):
        for il, layer in enumerate(self.lm.model.model.layers):
            if il in self._plan_layer:
                self._handles.append(layer.self_attn.register_forward_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, module, args, kwargs, output):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        r = min(self.rows, hs.shape[1])
        d = self.lm.head_dim
        q = _queries(module, hs[:, -r:], d)
        q, _ = self._rope(q, q, cos[:, -r:], sin[:, -r:])
        # the cache object is ours, not read from kwargs: transformers renamed that argument
        # (past_key_values -> cache in 5.24)
        layer = self.cache.layers[module.layer_idx]
        self.fn(self._plan_layer[module.layer_idx], q[0], layer.keys[0], layer.values[0], module)


def _queries(module, x: torch.Tensor, d: int) -> torch.Tensor:
    """The pre-RoPE queries [1, n_head, rows, d] the attention module makes of hidden states x, as its own
    forward does: a Q projection (qwen2: with its bias) or the Q rows of a fused QKV one (phi3), and the
    per-head Q norm where there is one (qwen3)."""
    if hasattr(module, "q_proj"):
        q = module.q_proj(x)
    else:
        q = module.qkv_proj(x)[..., : module.config.num_attention_heads * d]
    q = q.view(*x.shape[:2], -1, d)
    if hasattr(module, "q_norm"):
        q = module.q_norm(q)
    return q.transpose(1, 2)


def attention_probs(lm: LM, q: torch.Tensor, K: torch.Tensor, scaling: float) -> torch.Tensor:
    """softmax(q K^T * scaling) with a causal mask inside the last rows: q [n_head, r, d] are the
    queries of the last r positions of the n keys K [n_head_kv, n, d] -> [n_head, r, n] float32."""
    k = K.repeat_interleave(lm.group, dim=0)
    logits = torch.matmul(q, k.transpose(1, 2)) * scaling
    r, n = q.shape[1], k.shape[1]
    if r > 1:
        qpos = torch.arange(n - r, n)[:, None]
        logits = logits.masked_fill(torch.arange(n)[None, :] > qpos, float("-inf"))
    return torch.softmax(logits.float(), dim=-1)


class Runner:
    """One sequence at a time: prefill a prompt, then greedy-decode, with a QueryHook armed."""

    def __init__(self, lm: LM, fn: LayerFn):
        self.lm = lm
        self.hook = QueryHook(lm, fn)
        self.cache = None
        self.n = 0

    def start(self, tokens: list[int], rows: int = 1) -> int:
        """Prefill `tokens` with the last `rows` queries hooked; returns the greedy next token."""
        from transformers import DynamicCache  # noqa: PLC0415
        self.cache = DynamicCache(config=self.lm.model.config)
        self.n = 0
        # a LongRoPE model rotates as in a context sized to the prompt, what `kvcli run` reads it in
        use_rope_context(self.lm.loaded, len(tokens))
        return self._forward(tokens, rows)

    def step(self, token: int) -> int:
        return self._forward([int(token)], 1)

    def _forward(self, tokens: list[int], rows: int) -> int:
        ids = torch.tensor([tokens], dtype=torch.int64)
        pos = torch.arange(self.n, self.n + len(tokens), dtype=torch.int64)[None]
        self.hook.rows, self.hook.cache = rows, self.cache
        with torch.no_grad(), self.hook:
            out = forward_cached(self.lm.model, ids, pos, self.cache)
        self.n += len(tokens)
        return int(torch.argmax(out.logits[0, -1]))
