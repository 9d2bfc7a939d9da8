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
    from kvcli.plan import Plan  # noqa: PLC0415

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
