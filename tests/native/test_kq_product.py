"""The few-rows path's K^T Q kernel (native/src/kvcli_kq.cpp): a question's window sums and logits are ggml's product's
(KVCLI_KQ=ggml) to float rounding, with both of its kernels (AVX-512 where the CPU has it, and AVX2), K in F16 and
F32, head widths 16 and 64, one and two threads, over a whole cache and a compacted one (both attended as 256 or 512
cells), and over the ragged layout's trimmed layers, whose cells (225, 241) end inside the kernel's tile of 16 or 32;
the last graph shows which product ran, so a test cannot pass by comparing ggml with itself."""
from __future__ import annotations

import numpy as np
import pytest

from kvcli.drivers.compress import prefill_and_compress, resolve
from kvcli.native import cache


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    except OSError:
        return set()


FLAGS = _cpu_flags()
HAS_AVX2 = {"avx2", "fma", "f16c"} <= FLAGS
TOL = {"f32": 1e-4, "f16": 1e-3}   # as tests/native/test_attention_path.py
KERNELS = ["auto", "avx2"] if HAS_AVX2 else []


def _use(kernel, monkeypatch):
    """KVCLI_KQ for `kernel`: ggml, avx2, or unset (auto: the widest kernel the CPU runs)."""
    if kernel == "auto":
        monkeypatch.delenv("KVCLI_KQ", raising=False)
    else:
        monkeypatch.setenv("KVCLI_KQ", kernel)


def _question(make, model, kernel, monkeypatch, cache_type, n_threads, budget):
    """Window sums and logits of a 6-row observed question over a 290-token document (compressed to `budget` first
    when given), and how many nodes of the last graph the kernel named."""
    _use(kernel, monkeypatch)
    rng = np.random.default_rng(11)
    doc = [int(t) for t in rng.integers(10, 200, 290)]
    question = [int(t) for t in rng.integers(10, 200, 6)]
    s = make(model, n_ctx=1024, cache_type=cache_type, n_threads=n_threads)
    if budget:
        prefill_and_compress(s, doc, resolve(s.model_path, "snapkv", budget, {}))
    else:
        s.prefill(doc, seq=0)
    obs = s.prefill(question, seq=0, observe=("window",), window=6)
    return obs.window_sums.copy(), s.logits(0).copy(), cache.last_graph_count(s.ctx, "kvcli_kq")


@pytest.mark.skipif(not KERNELS, reason="the kernel needs x86-64 with AVX2, FMA and F16C")
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cache_type", ["f16", "f32"])
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("budget", [0, 37])
def test_the_kernel_gives_ggml_products(session_factory, tiny_model, tiny_model_64, monkeypatch, kernel, cache_type,
                                       n_threads, budget):
    for model in (tiny_model, tiny_model_64):
        sums_g, logits_g, named_g = _question(session_factory, model, "ggml", monkeypatch, cache_type, n_threads,
                                              budget)
        sums_k, logits_k, named_k = _question(session_factory, model, kernel, monkeypatch, cache_type, n_threads,
                                              budget)
        assert named_g == 0 and named_k > 0
        assert np.isfinite(logits_k).all() and sums_k.sum() > 0
        # the same products (Q rounded to F16 for an F16 K, as ggml rounds it), summed in another order; in an F16
        # cache a question row's K and V, written after the layers below it attended, can round to the next half
        tol = TOL[cache_type]
        np.testing.assert_allclose(sums_k, sums_g, rtol=tol, atol=tol)
        np.testing.assert_allclose(logits_k, logits_g, rtol=tol, atol=tol)


@pytest.mark.skipif(not KERNELS, reason="the kernel needs x86-64 with AVX2, FMA and F16C")
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_kernel_gives_ggml_products_where_the_cells_end_inside_a_tile(session_factory, tiny_model, monkeypatch,
                                                                        kernel):
    from test_layout import _compacted

    out = {}
    for k in ("ggml", kernel):
        _use(k, monkeypatch)
        # an F32 cache: no question row's K or V rounds to a neighbouring half, so the tolerance is the products'
        s = _compacted(session_factory, tiny_model, "ragged", monkeypatch, [40, 9, 25], cache_type="f32")
        assert cache.layout_fronts(s.ctx) == [0, 31, 15]      # layers 1 and 2 attend 256 - 31 and 256 - 15 cells
        obs = s.prefill(list(range(20, 26)), seq=0, observe=("window",), window=6)
        out[k] = (obs.window_sums.copy(), s.logits(0).copy(), cache.last_graph_count(s.ctx, "kvcli_kq"))
    (sums_g, logits_g, named_g), (sums_k, logits_k, named_k) = out["ggml"], out[kernel]
    assert named_g == 0 and named_k > 0
    np.testing.assert_allclose(sums_k, sums_g, rtol=TOL["f32"], atol=TOL["f32"])
    np.testing.assert_allclose(logits_k, logits_g, rtol=TOL["f32"], atol=TOL["f32"])
