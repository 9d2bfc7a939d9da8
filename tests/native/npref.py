"""An independent numpy forward pass of a tiny llama GGUF (the weights read with `gguf`), for one
decode step over an explicit list of cache entries per (layer, KV head). The native tests
compare llama.cpp's logits after a compaction with this: the entries are exactly the kept
ones, with their replacement rows and log-multiplicity bias.
"""
from __future__ import annotations

import functools

import numpy as np


class NpLlama:
    def __init__(self, path):
        import gguf  # noqa: PLC0415

        r = gguf.GGUFReader(str(path))

        def meta(key):
            return r.fields[key].contents()

        self.n_layer = int(meta("llama.block_count"))
        self.n_head = int(meta("llama.attention.head_count"))
        self.n_head_kv = int(meta("llama.attention.head_count_kv"))
        self.n_embd = int(meta("llama.embedding_length"))
        self.head_dim = self.n_embd // self.n_head
        self.eps = float(meta("llama.attention.layer_norm_rms_epsilon"))
        self.rope_base = float(meta("llama.rope.freq_base"))
        self.w = {t.name: np.array(t.data, dtype=np.float64) for t in r.tensors}
        self.out = self.w.get("output.weight", self.w["token_embd.weight"])

    def _norm(self, x, w):
        return x / np.sqrt(np.mean(x * x) + self.eps) * w

    def rope(self, x, pos):
        """llama.cpp's normal RoPE: rotate the pairs (2i, 2i+1) of each head by pos * base^(-2i/d)."""
        d = x.shape[-1]
        theta = pos * self.rope_base ** (-np.arange(0, d, 2) / d)
        c, s = np.cos(theta), np.sin(theta)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    def qkv(self, il, x_norm, pos):
        p = f"blk.{il}."
        q = (self.w[p + "attn_q.weight"] @ x_norm).reshape(self.n_head, self.head_dim)
        k = (self.w[p + "attn_k.weight"] @ x_norm).reshape(self.n_head_kv, self.head_dim)
        v = (self.w[p + "attn_v.weight"] @ x_norm).reshape(self.n_head_kv, self.head_dim)
        return self.rope(q, pos), self.rope(k, pos), v

    def rope_rows(self, x, pos):
        """rope() with one position per row: x [m, d], pos [m] (a RoPE rotation by pos; rotations compose,
        so rope_rows(rope_rows(x, a), b) == rope_rows(x, a + b))."""
        x = np.asarray(x, np.float64)
        d = x.shape[-1]
        theta = np.asarray(pos, np.float64)[:, None] * self.rope_base ** (-np.arange(0, d, 2) / d)
        c, s = np.cos(theta), np.sin(theta)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * c - x1 * s
        out[..., 1::2] = x0 * s + x1 * c
        return out

    def step(self, token: int, pos: int, entries, append: bool = False, record=None) -> np.ndarray:
        """Logits of `token` at `pos` attending to entries[l][h] = (K [m, d], V [m, d], bias [m]) of
        (layer l, KV head h) plus itself. append: add the token's own K/V to `entries` (so a next
        step attends to it, as the cache does). record: a list that receives, per layer, the attention
        probabilities [n_head, m + 1] (the entries, then the token itself)."""
        x = self.w["token_embd.weight"][token].copy()
        g = self.n_head // self.n_head_kv
        scale = 1.0 / np.sqrt(self.head_dim)
        for il in range(self.n_layer):
            p = f"blk.{il}."
            q, k, v = self.qkv(il, self._norm(x, self.w[p + "attn_norm.weight"]), pos)
            heads, probs = [], []
            for qh in range(self.n_head):
                h = qh // g
                K, V, b = entries[il][h]
                keys = np.vstack([K, k[h][None]])
                vals = np.vstack([V, v[h][None]])
                s = keys @ q[qh] * scale + np.concatenate([b, [0.0]])
                s = np.exp(s - s.max())
                probs.append(s / s.sum())
                heads.append(probs[-1] @ vals)
            if record is not None:
                record.append(np.array(probs))
            if append:
                for h in range(self.n_head_kv):
                    K, V, b = entries[il][h]
                    entries[il][h] = (np.vstack([K, k[h][None]]), np.vstack([V, v[h][None]]), np.append(b, 0.0))
            x = x + self.w[p + "attn_output.weight"] @ np.concatenate(heads)
            xn = self._norm(x, self.w[p + "ffn_norm.weight"])
            gate = self.w[p + "ffn_gate.weight"] @ xn
            up = self.w[p + "ffn_up.weight"] @ xn
            x = x + self.w[p + "ffn_down.weight"] @ (gate / (1.0 + np.exp(-gate)) * up)
        return self.out @ self._norm(x, self.w["output_norm.weight"])


@functools.lru_cache(maxsize=4)
def np_model(path) -> NpLlama:
    """NpLlama of `path`, read once (GGUFReader parses the 49k-token vocabulary in Python)."""
    return NpLlama(path)


def entries_from_plan(plan, keys, values):
    """entries[l][h] for NpLlama.step: the kept rows of the observation's keys/values (float64),
    replaced where the plan merges, with the plan's log_mult as bias."""
    offs = plan.offsets()
    rep = {int(e): r for r, e in enumerate(plan.replace_entry)}
    out = []
    for l in range(plan.n_layer):
        row = []
        for h in range(plan.n_head_kv):
            o, n = int(offs[l, h]), int(plan.n_kept[l, h])
            K = keys[l, h, plan.slots[o:o + n]].astype(np.float64)
            V = values[l, h, plan.slots[o:o + n]].astype(np.float64)
            for j in range(n):
                if o + j in rep:
                    K[j] = plan.replace_k[rep[o + j]]
                    V[j] = plan.replace_v[rep[o + j]]
            b = np.zeros(n) if plan.log_mult is None else plan.log_mult[o:o + n].astype(np.float64)
            row.append((K, V, b))
        out.append(row)
    return out


def random_plan(rng, n_layer, n_head_kv, n, head_dim, keys=None, values=None, merge=True):
    """Different counts per layer and KV head, random kept slots, some entries with a log(m) bias
    and (with keys/values) some replaced by the mean of their row and a dropped neighbour."""
    from kvcli.planning.formats import Plan  # noqa: PLC0415

    kept, lms = [], []
    for _ in range(n_layer):
        kl, ll = [], []
        for _ in range(n_head_kv):
            m = int(rng.integers(1, n + 1))
            kl.append(np.sort(rng.choice(n, size=m, replace=False)).astype(np.int32))
            ll.append(np.where(rng.random(m) < 0.3, np.log(rng.integers(2, 6, m)), 0.0).astype(np.float32))
        kept.append(kl)
        lms.append(ll)
    plan = Plan.from_lists(kept, lms if merge else None)
    if merge and keys is not None:
        ent = np.flatnonzero(rng.random(plan.slots.size) < 0.25).astype(np.int32)
        offs = plan.offsets()
        rk, rv = [], []
        for e in ent:
            # find (l, h) of entry e and average its row with a random other slot of the sequence
            flat = int(np.searchsorted(offs.reshape(-1), e, side="right") - 1)
            while plan.n_kept.reshape(-1)[flat] == 0 or offs.reshape(-1)[flat] > e:
                flat -= 1
            l, h = divmod(flat, n_head_kv)
            other = int(rng.integers(0, n))
            rk.append((keys[l, h, plan.slots[e]] + keys[l, h, other]) / 2)
            rv.append((values[l, h, plan.slots[e]] + values[l, h, other]) / 2)
        plan.replace_entry = ent
        plan.replace_k = np.array(rk, np.float32).reshape(-1, head_dim)
        plan.replace_v = np.array(rv, np.float32).reshape(-1, head_dim)
    return plan


def prompt_tokens(n: int, seed: int = 0) -> list[int]:
    """n random token ids of the SmolLM2 vocabulary (the tiny models share it)."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(100, 40000, n)]


class NpGemma:
    """An independent numpy forward pass of a tiny gemma3 or gemma2 GGUF (kvcli.testing.tiny_gguf): the embedding
    scaled by sqrt(n_embd), NEOX RoPE, Q scaled by 1/sqrt(head_dim), post-attention and post-FFN norms, a
    GELU-gated FFN; layer il slides over the last `n_swa` positions (llama.cpp's standard window: position p sees
    p' when p - p' < n_swa) unless il % pattern == pattern - 1.
    gemma3: RMS norms of each head's Q and K; a sliding layer's RoPE base is llama.cpp's default for them (10000).
    gemma2: one RoPE base; the attention scores are soft-capped, cap * tanh(s / cap), before the mask (the bias of
    a compacted entry) is added, as llama.cpp does, and so are the logits (`final_logit_softcapping`)."""

    def __init__(self, path):
        import gguf  # noqa: PLC0415

        r = gguf.GGUFReader(str(path))
        self.arch = str(r.fields["general.architecture"].contents())

        def meta(key, default=None):
            f = r.fields.get(f"{self.arch}.{key}")
            return default if f is None else f.contents()

        self.n_layer = int(meta("block_count"))
        self.n_head = int(meta("attention.head_count"))
        self.n_head_kv = int(meta("attention.head_count_kv"))
        self.n_embd = int(meta("embedding_length"))
        self.head_dim = int(meta("attention.key_length"))
        self.eps = float(meta("attention.layer_norm_rms_epsilon"))
        self.rope_base = float(meta("rope.freq_base"))
        self.rope_base_swa = 10000.0 if self.arch == "gemma3" else self.rope_base
        self.attn_cap = float(meta("attn_logit_softcapping", 0.0))
        self.final_cap = float(meta("final_logit_softcapping", 0.0))
        self.n_swa = int(meta("attention.sliding_window"))
        pattern = int(meta("attention.sliding_window_pattern"))
        self.sliding = [il % pattern < pattern - 1 for il in range(self.n_layer)]
        self.global_layers = [il for il in range(self.n_layer) if not self.sliding[il]]
        self.w = {t.name: np.array(t.data, dtype=np.float64) for t in r.tensors}

    def _norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    @staticmethod
    def _cap(x, cap):
        return cap * np.tanh(x / cap) if cap else x

    def _rope(self, x, pos, base):
        """NEOX RoPE: rotate the pairs (i, i + d/2) of each head by pos * base^(-2i/d)."""
        d = x.shape[-1]
        theta = pos * base ** (-np.arange(0, d, 2) / d)
        c, s = np.cos(theta), np.sin(theta)
        x0, x1 = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)

    def _qkv(self, il, x, pos):
        p = f"blk.{il}."
        xn = self._norm(x, self.w[p + "attn_norm.weight"])
        q = (self.w[p + "attn_q.weight"] @ xn).reshape(self.n_head, self.head_dim)
        k = (self.w[p + "attn_k.weight"] @ xn).reshape(self.n_head_kv, self.head_dim)
        if self.arch == "gemma3":
            q, k = self._norm(q, self.w[p + "attn_q_norm.weight"]), self._norm(k, self.w[p + "attn_k_norm.weight"])
        v = (self.w[p + "attn_v.weight"] @ xn).reshape(self.n_head_kv, self.head_dim)
        base = self.rope_base_swa if self.sliding[il] else self.rope_base
        return self._rope(q, pos, base) / np.sqrt(self.head_dim), self._rope(k, pos, base), v

    def step(self, token: int, pos: int, kv: list, global_entries=None, record=None) -> np.ndarray:
        """Logits of `token` at `pos`. kv[il]: the (position, K [n_head_kv, d], V) of every earlier token in layer
        il (this token's are appended). A sliding layer attends to the window of kv[il]; a global layer to all of
        kv[il], or, with global_entries, to global_entries[i][h] = (K [m, d], V [m, d], bias [m]) of its i-th
        global layer (a compacted cache) plus the token itself. record: a list that receives, per global layer,
        the attention probabilities of each query head (the earlier entries, then the token itself)."""
        x = self.w["token_embd.weight"][token] * np.sqrt(self.n_embd)
        g = self.n_head // self.n_head_kv
        for il in range(self.n_layer):
            p = f"blk.{il}."
            q, k, v = self._qkv(il, x, pos)
            kv[il].append((pos, k, v))
            heads, probs = [], []
            for qh in range(self.n_head):
                h = qh // g
                if global_entries is not None and not self.sliding[il]:
                    K, V, b = global_entries[self.global_layers.index(il)][h]
                    keys, vals, bias = np.vstack([K, k[h][None]]), np.vstack([V, v[h][None]]), np.append(b, 0.0)
                else:
                    rows = [(kk[h], vv[h]) for pp, kk, vv in kv[il] if not self.sliding[il] or pos - pp < self.n_swa]
                    keys, vals, bias = np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), 0.0
                s = self._cap(keys @ q[qh], self.attn_cap) + bias
                s = np.exp(s - s.max())
                probs.append(s / s.sum())
                heads.append(probs[-1] @ vals)
            if record is not None and not self.sliding[il]:
                record.append(probs)
            x = x + self._norm(self.w[p + "attn_output.weight"] @ np.concatenate(heads),
                               self.w[p + "post_attention_norm.weight"])
            xn = self._norm(x, self.w[p + "ffn_norm.weight"])
            gate = self.w[p + "ffn_gate.weight"] @ xn
            gelu = 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate ** 3)))
            ffn = self.w[p + "ffn_down.weight"] @ (gelu * (self.w[p + "ffn_up.weight"] @ xn))
            x = x + self._norm(ffn, self.w[p + "post_ffw_norm.weight"])
        return self._cap(self.w["token_embd.weight"] @ self._norm(x, self.w["output_norm.weight"]), self.final_cap)

    def prefill(self, tokens, records=None) -> tuple[list, np.ndarray]:
        """(kv, logits of the last token) after reading `tokens` at positions 0, 1, ...; records: a list that
        receives each token's `record` (step)."""
        kv = [[] for _ in range(self.n_layer)]
        logits = None
        for pos, t in enumerate(tokens):
            rec = [] if records is not None else None
            logits = self.step(t, pos, kv, record=rec)
            if records is not None:
                records.append(rec)
        return kv, logits


@functools.lru_cache(maxsize=2)
def np_gemma(path) -> NpGemma:
    return NpGemma(path)


def apply_random_plan(session, ref: NpGemma, n: int, seed: int):
    """Prefill n random tokens (seeded) into `session`, apply to its global layers a random plan with per-layer and
    per-head counts, merged rows and log(m) bias, and read the same tokens with numpy: (plan, kv, entries), kv and
    entries as NpGemma.step takes them."""
    rng = np.random.default_rng(seed)
    toks = prompt_tokens(n, seed)
    obs = session.prefill(toks, observe=("kv",)).with_kv_arrays()
    plan = random_plan(rng, len(ref.global_layers), ref.n_head_kv, n, ref.head_dim, obs.keys, obs.values)
    assert plan.replace_entry.size > 0 and len(set(plan.n_kept.reshape(-1).tolist())) > 1
    session.apply_plan(plan)
    kv, _ = ref.prefill(toks)
    return plan, kv, entries_from_plan(plan, obs.keys, obs.values)


def assert_gemma_logits_close(got, want):
    """llama.cpp's logits against NpGemma's: llama.cpp's CPU GELU reads an f16 table, so they agree to ~1e-3 of the
    logits' scale, not to float precision; and on the greedy token."""
    got = np.asarray(got, np.float64)
    assert np.abs(got - want).max() <= 2e-3 * max(1.0, np.abs(want).max()), np.abs(got - want).max()
    assert int(np.argmax(got)) == int(np.argmax(want))
