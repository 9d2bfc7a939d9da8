"""The checks issue #17 asks of a lent GPU, in one process, each section saved as soon as it ends.

    python benchmarks/gpu/gpu_check.py --out DIR [--lengths 8192,32768] [--budget 256] [--decode 128] [--rounds 3]

Run on the device machine by benchmarks/gpu/run_on_device.sh (a CUDA build of the patched library); it runs on a
CPU build too (every section then says the cache is on the CPU), which is how it is tried before a lease.

Sections (DIR/gpu_check.json):
- paths: where the cache lives and the attention path compressed layers take, with every layer on the GPU and
  with none (n_gpu_layers=0).
- agreement: one plan per policy (made on the GPU from a 1,024-token prompt, budget 128, a random llama of head_dim
  64, the smallest head size ggml-cuda's flash attention takes) applied in three sessions: GPU with the split path,
  GPU with the mask path (that layer's attention falls back to the CPU) and CPU only; the logits of 4 decoded tokens
  compared, beside the same GPU-vs-CPU difference of the uncompressed cache (what the backends differ by anyway).
- placement: the scheduler's own assignment (GGML_SCHED_DEBUG=2, llama.cpp's log) of the first decode graph after
  compaction, split path and mask path: the splits per backend and the ops of the CPU splits.
- speed: per prompt length, a random model of qwen2.5-0.5B's shape (24 layers, 14 query / 2 KV heads of 64, FFN
  4864, f16; the default model's 49,152-token vocabulary): full cache vs snapkv at --budget (split path; mask path
  at the first length): prefill, observation, planning and compaction seconds, decode tok/s (interleaved rounds,
  median), the GPU memory nvidia-smi reports for this process after each step, and the compaction's seconds on
  the path it takes by itself (auto: the device path on a GPU) beside the host path's (KVCLI_COMPACT=host).
Random weights: what is measured is arithmetic and placement, not answers.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import machine  # noqa: E402

from kvcli import policies  # noqa: E402
from kvcli.drivers.compress import _prefill_kinds, prefill_and_compress  # noqa: E402
from kvcli.native import build_info, load_llama_cpp  # noqa: E402
from kvcli.native.session import NativeSession  # noqa: E402
from kvcli.planning.planner import make_plan, resolve  # noqa: E402
from kvcli.testing.tiny_gguf import write_tiny  # noqa: E402

QWEN05_SHAPE = dict(n_layer=24, n_head=14, n_head_kv=2, head_dim=64, n_ff=4864, dtype="f16", rope_theta=1e6)
# Llama-3-8B's attention (32 query / 8 KV heads of 128) in 8 layers with a narrow FFN: a decode that attention
# weighs on (8x qwen2.5-0.5B's K/V per token and layer), not a model anyone runs
ATTN8B_SHAPE = dict(n_layer=8, n_head=32, n_head_kv=8, head_dim=128, n_ff=2048, dtype="f16", rope_theta=5e5)
SHAPES = {"qwen05": QWEN05_SHAPE, "attn8b": ATTN8B_SHAPE}
AGREE_SHAPE = dict(n_layer=4, n_head=8, n_head_kv=2, head_dim=64, n_ff=256, dtype="f32")
AGREE_N, AGREE_BUDGET, AGREE_STEPS = 1024, 128, (42, 7, 1234, 99)
# random weights give dissimilar keys: low codebook thresholds make spindlekv merge (as tests/native do)
POLICY_ARGS = {"spindlekv": {"theta_k": 0.2, "theta_v": 0.2}}


# ---------------------------------------------------------------------------------------------- llama.cpp's log
SPLIT_RE = re.compile(r"## SPLIT #(\d+): (\S+)")     # ggml-backend.cpp, ggml_backend_sched_print_assignments
NODE_RE = re.compile(r"node #\s*\d+ \(\s*([^)]*)\): +(\S+)")


class LogCapture:
    """llama.cpp's (and ggml's) log through our own callback: kept only while `on`."""

    def __init__(self, L):
        self.on, self.parts = False, []
        self._cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(self._sink)
        L.llama_log_set(self._cb, None)

    def _sink(self, level, text, user_data):
        if self.on:
            self.parts.append(text.decode("utf-8", "replace"))

    def take(self) -> str:
        out, self.parts = "".join(self.parts), []
        return out


def sched_summary(log: str) -> list[dict]:
    """Per graph the scheduler printed (GGML_SCHED_DEBUG=2): its splits, each with its backend, node count and ops
    (nodes named by op and tensor name)."""
    graphs, cur = [], None
    for line in log.splitlines():
        m = SPLIT_RE.match(line)
        if m:
            if int(m.group(1)) == 0 or cur is None:
                cur = []
                graphs.append(cur)
            cur.append({"backend": m.group(2), "nodes": 0, "ops": {}, "names": []})
            continue
        m = NODE_RE.match(line)
        if m and cur:
            op, name = m.group(1).strip(), m.group(2)
            sp = cur[-1]
            sp["nodes"] += 1
            sp["ops"][op] = sp["ops"].get(op, 0) + 1
            if len(sp["names"]) < 40:
                sp["names"].append(f"{op}:{name}")
    return graphs


# ---------------------------------------------------------------------------------------------- GPU memory
def gpu_mem() -> dict:
    """GPU memory in use (MiB) by this process and by the whole GPU, as nvidia-smi reports them (None without one)."""
    out = {"process_MiB": None, "gpu_used_MiB": None}
    try:
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        for line in q.stdout.splitlines():
            pid, mem = (x.strip() for x in line.split(","))
            if pid == str(os.getpid()):
                out["process_MiB"] = int(mem)
        g = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        out["gpu_used_MiB"] = int(g.stdout.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    return out


# ---------------------------------------------------------------------------------------------- helpers
def sync(s: NativeSession) -> None:
    s.L.llama_synchronize(s.ctx)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(200, 40000, size=n).tolist()


def decode_logits(s: NativeSession, steps=AGREE_STEPS) -> np.ndarray:
    out = []
    for t in steps:
        s.step({0: t})
        out.append(s.logits().copy())
    return np.array(out)


def decode_speed(s: NativeSession, n: int, first: int) -> float:
    s.step({0: first})   # warm-up step: builds the decode graph
    t0 = time.perf_counter()
    for _ in range(n):
        s.step({0: int(np.argmax(s.logits()))})
    return n / (time.perf_counter() - t0)


def interleaved_decode(sessions: dict, n: int, rounds: int) -> dict:
    """Decode tok/s of every session, round after round (each round rolled back), median and range."""
    firsts = {k: int(np.argmax(s.logits())) for k, s in sessions.items()}
    speeds = {k: [] for k in sessions}
    for _ in range(rounds):
        for k, s in sessions.items():
            speeds[k].append(decode_speed(s, n, firsts[k]))
            s.rollback(0, n + 1)
    return {k: {"tok_s": round(float(np.median(v)), 1), "min": round(min(v), 1), "max": round(max(v), 1)}
            for k, v in speeds.items()}


# ---------------------------------------------------------------------------------------------- sections
def section_paths(model: Path) -> dict:
    L = load_llama_cpp()
    out = {"gpu_offload_supported": bool(L.llama_supports_gpu_offload())}
    for label, ngl in (("all_layers_on_gpu", None), ("no_layer_on_gpu", 0)):
        s = NativeSession(model, n_ctx=256, n_threads=None, n_gpu_layers=ngl)
        try:
            out[label] = {"path": s.attn_path[0], "why": s.attn_path[1]}
        finally:
            s.close()
    return out


def section_agreement(model: Path) -> dict:
    toks = tokens(AGREE_N, 1)
    rows = {}
    # the backends' own difference: the uncompressed cache decoded on the GPU and on the CPU
    base = {}
    for label, ngl in (("gpu", None), ("cpu", 0)):
        s = NativeSession(model, n_ctx=AGREE_N + 64, n_threads=1, n_gpu_layers=ngl)
        try:
            s.prefill(toks)
            base[label] = decode_logits(s)
        finally:
            s.close()
    rows["full (uncompressed)"] = {"gpu_vs_cpu_max_abs": float(np.abs(base["gpu"] - base["cpu"]).max()),
                                   "logit_scale_max_abs": float(np.abs(base["cpu"]).max())}
    for policy in [p for p in policies.available() if p != "full"]:
        row = {}
        try:
            # the plan, made on the GPU; then every session prefills alike (a prefill with the observation armed
            # decodes its last window apart, which moves f16 K/V by rounding) and applies that one plan
            s = NativeSession(model, n_ctx=AGREE_N + 64, n_threads=1)
            try:
                cfg = resolve(s.model_path, policy, AGREE_BUDGET, POLICY_ARGS.get(policy, {}))
                plan = prefill_and_compress(s, toks, cfg, instruction="Where is the key?").plan
            finally:
                s.close()
            others = {}
            for label, path, ngl in (("split_gpu", "split", None), ("mask_gpu", "mask", None), ("cpu", "auto", 0)):
                os.environ["KVCLI_ATTN_PATH"] = path
                s = NativeSession(model, n_ctx=AGREE_N + 64, n_threads=1, n_gpu_layers=ngl)
                try:
                    s.prefill(toks)
                    s.apply_plan(plan)
                    others[label] = decode_logits(s)
                    row[f"{label}_layers"] = sorted(set(map(str, s.attn_paths_taken())))
                    row["kv_cells"] = s.stats()["kv_cells"]
                finally:
                    s.close()
            split = others["split_gpu"]
            row["split_vs_mask_gpu_max_abs"] = float(np.abs(split - others["mask_gpu"]).max())
            row["split_gpu_vs_cpu_max_abs"] = float(np.abs(split - others["cpu"]).max())
            row["greedy_same_as_cpu"] = bool((split.argmax(1) == others["cpu"].argmax(1)).all())
        except Exception as e:  # noqa: BLE001 (one policy's failure is recorded, the others still run)
            row["error"] = f"{type(e).__name__}: {e}"
        finally:
            os.environ.pop("KVCLI_ATTN_PATH", None)
        rows[policy] = row
        print(f"[gpu_check] agreement {policy}: {row}", file=sys.stderr, flush=True)
    return rows


def section_placement(model: Path, cap: LogCapture, budget: int, out_dir: Path) -> dict:
    toks = tokens(2048, 2)
    out = {}
    for path in ("split", "mask"):
        os.environ["KVCLI_ATTN_PATH"] = path
        os.environ["GGML_SCHED_DEBUG"] = "2"   # read when the context's scheduler is made
        try:
            s = NativeSession(model, n_ctx=2048 + 64)
        finally:
            os.environ.pop("GGML_SCHED_DEBUG", None)
        try:
            prefill_and_compress(s, toks, resolve(s.model_path, "snapkv", budget, {}), instruction="Where is the key?")
            cap.take()
            cap.on = True
            s.step({0: 42})
            s.step({0: 43})
            cap.on = False
            raw = cap.take()
            (out_dir / f"sched-{path}.log").write_text(raw)
            graphs = sched_summary(raw)
            g = graphs[0] if graphs else []
            out[path] = {
                "layers": sorted(set(map(str, s.attn_paths_taken()))),
                "graphs_printed": len(graphs),
                "splits": [{"backend": sp["backend"], "nodes": sp["nodes"]} for sp in g],
                "cpu_split_ops": [sp["ops"] for sp in g if sp["backend"].upper().startswith("CPU")],
                "cpu_split_nodes": [sp["names"] for sp in g if sp["backend"].upper().startswith("CPU")][:3],
                "attention_ops_on_cpu": sum(sp["ops"].get(op, 0) for sp in g if sp["backend"].upper().startswith("CPU")
                                            for op in ("FLASH_ATTN", "SOFT_MAX")),  # %10.10s: FLASH_ATTN_EXT
            }
        finally:
            cap.on = False
            s.close()
            os.environ.pop("KVCLI_ATTN_PATH", None)
        print(f"[gpu_check] placement {path}: {out[path]['splits']} attention ops on CPU "
              f"{out[path]['attention_ops_on_cpu']}", file=sys.stderr, flush=True)
    return out


def section_speed(model: Path, n: int, budget: int, n_decode: int, rounds: int, with_mask: bool) -> dict:
    toks = tokens(n, 3)
    row = {"prompt_tokens": n, "budget": budget, "mem_start": gpu_mem()}
    n_ctx = n + n_decode + 64
    sessions = {}
    try:
        s = NativeSession(model, n_ctx=n_ctx)
        sessions["full"] = s
        row["mem_full_context"] = gpu_mem()
        t0 = time.perf_counter()
        s.prefill(toks)
        sync(s)
        row["full_prefill_s"] = round(time.perf_counter() - t0, 4)
        row["mem_full_prefilled"] = gpu_mem()

        s = NativeSession(model, n_ctx=n_ctx)    # the path llama.cpp's placement picks: split on a GPU
        sessions["snapkv"] = s
        row["mem_snapkv_context"] = gpu_mem()
        cfg = resolve(s.model_path, "snapkv", budget, {})
        kinds, window = cfg.observe
        t0 = time.perf_counter()
        obs = s.prefill(toks, observe=_prefill_kinds(kinds), window=window)
        sync(s)
        row["snapkv_prefill_observed_s"] = round(time.perf_counter() - t0, 4)
        t0 = time.perf_counter()
        plan = make_plan(cfg.spec, cfg.params, cfg.budget, obs, "native")
        row["plan_s"] = round(time.perf_counter() - t0, 4)
        del obs
        t0 = time.perf_counter()
        s.apply_plan(plan)
        sync(s)
        row["compaction_s"] = round(time.perf_counter() - t0, 4)
        row["compaction_pct_of_full_prefill"] = round(100 * row["compaction_s"] / row["full_prefill_s"], 2)
        row["compaction_path"] = s.compact_path_taken()
        row["mem_snapkv_compacted"] = gpu_mem()
        t0 = time.perf_counter()
        s.resize_context(budget + n_decode + 64)   # what run/chat do: the KV buffer sized by what is kept
        row["resize_s"] = round(time.perf_counter() - t0, 4)
        row["mem_snapkv_resized"] = gpu_mem()
        row["snapkv_kv_cells"] = s.stats()["kv_cells"]
        # the same plan applied through host memory (KVCLI_COMPACT=host), the path before the device one
        os.environ["KVCLI_COMPACT"] = "host"
        h = NativeSession(model, n_ctx=n_ctx)
        try:
            h.prefill(toks)
            sync(h)
            t0 = time.perf_counter()
            h.apply_plan(plan)
            sync(h)
            row["compaction_host_s"] = round(time.perf_counter() - t0, 4)
            row["compaction_host_path"] = h.compact_path_taken()
            row["compaction_host_pct_of_full_prefill"] = round(100 * row["compaction_host_s"]
                                                               / row["full_prefill_s"], 2)
        finally:
            os.environ.pop("KVCLI_COMPACT", None)
            h.close()
        row["decode"] = interleaved_decode(sessions, n_decode, rounds)
        row["snapkv_layers"] = sorted(set(map(str, s.attn_paths_taken())))
        if with_mask:   # the path read at every graph build: measured on its own, after the others
            os.environ["KVCLI_ATTN_PATH"] = "mask"
            m = NativeSession(model, n_ctx=n_ctx)
            sessions["snapkv_mask_path"] = m
            m.prefill(toks)
            m.apply_plan(plan)
            m.resize_context(budget + n_decode + 64)
            row["decode"].update(interleaved_decode({"snapkv_mask_path": m}, n_decode, rounds))
            row["mask_path_layers"] = sorted(set(map(str, m.attn_paths_taken())))
            os.environ.pop("KVCLI_ATTN_PATH", None)
        row["snapkv_vs_full_decode"] = round(row["decode"]["snapkv"]["tok_s"] / row["decode"]["full"]["tok_s"], 3)
    finally:
        os.environ.pop("KVCLI_ATTN_PATH", None)
        for s in sessions.values():
            s.close()
    row["mem_end"] = gpu_mem()
    print(f"[gpu_check] speed {n}: {json.dumps(row)}", file=sys.stderr, flush=True)
    return row


def gpu_name() -> str | None:
    """nvidia-smi's name, memory and driver of the GPU (None without nvidia-smi)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except OSError:
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sections", default="paths,agreement,placement,speed")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen05", help="the speed model's shape")
    ap.add_argument("--shape-layers", type=int, default=None,
                    help="layers of the speed model (fewer to try the script on a CPU)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    L = load_llama_cpp()
    cap = LogCapture(L)
    res = {"machine": machine(host=platform.node(), build=build_info(), gpu=gpu_name()),
           "args": {k: str(v) for k, v in vars(a).items()}, "sections": {}}
    dest = a.out / "gpu_check.json"

    def save():
        tmp = dest.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=2))
        tmp.replace(dest)

    lengths = [int(x) for x in a.lengths.split(",")]
    t0 = time.perf_counter()
    agree_model = write_tiny(Path("/tmp/kvcli_gpu_agree.gguf"), "llama", seed=5, **AGREE_SHAPE)
    shape = dict(SHAPES[a.shape])
    shape["n_layer"] = a.shape_layers or shape["n_layer"]
    speed_model = write_tiny(Path(f"/tmp/kvcli_gpu_{a.shape}.gguf"), "qwen2" if a.shape == "qwen05" else "llama",
                             seed=6, n_ctx_train=max(lengths) + a.decode + 256, **shape)
    res["models_written_s"] = round(time.perf_counter() - t0, 1)
    save()
    wanted = a.sections.split(",")
    for name, fn in (("paths", lambda: section_paths(speed_model)),
                     ("agreement", lambda: section_agreement(agree_model)),
                     ("placement", lambda: section_placement(speed_model, cap, a.budget, a.out)),
                     ("speed", lambda: [section_speed(speed_model, n, a.budget, a.decode, a.rounds, i == 0)
                                        for i, n in enumerate(lengths)])):
        if name not in wanted:
            continue
        t0 = time.perf_counter()
        try:
            res["sections"][name] = fn()
        except Exception as e:  # noqa: BLE001 (a failed section is recorded; the next ones still run)
            res["sections"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        res["sections"][name + "_s"] = round(time.perf_counter() - t0, 1)
        save()
        print(f"[gpu_check] {name} done in {res['sections'][name + '_s']} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
