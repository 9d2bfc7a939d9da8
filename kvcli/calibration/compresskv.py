"""`kvcli calibrate compresskv`: find a model's semantic retrieval heads and layer error profile, store them.

Two stages on the reference engine's model (torch, float32):
  1. heads: needle-in-a-haystack probes at every (length, depth, needle) -> head scores
     (kvcli/calibration/heads.py);
  2. layers: calibration texts, each layer squeezed to 32 entries chosen by the heads of stage 1
     -> normalised error profile (kvcli/calibration/layers.py).
Progress is saved after every probe/text in `<out>.partial.json` (atomically), so an interrupted run
resumes where it stopped when started again with the same model and settings; the result is
written atomically (temporary file + rename) only when everything is done.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from kvcli import __version__
from kvcli.calibration import store
from kvcli.calibration.heads import ProbeResult, head_scores, run_probe
from kvcli.calibration.layers import layer_profile, text_errors
from kvcli.calibration.probes import NEEDLES, build_probe, depths as spread_depths, error_profile_text
from kvcli.calibration.store import rank_heads
from kvcli.errors import KvcliError
from kvcli.models import model_hash, read_model_info


@dataclass
class Settings:
    lengths: tuple[int, ...] = ()        # probe prompt lengths in tokens (empty: chosen from the model's context)
    depths: int = 5                      # needle depths per length, spread over [0, 1]
    needles: int = 2                     # needle kinds per (length, depth)
    max_new_tokens: int = 24             # greedy answer length limit per probe
    min_recall: float = 0.5              # a probe counts when ROUGE-1 recall of the answer exceeds this
    samples: int = 4                     # texts for the layer error profile
    gen_tokens: int = 32                 # decoding steps per error-profile text
    error_budget: int = 32               # entries per layer when squeezing (24 chosen + 8 window)
    window: int = 8
    kernel: int = 5
    srh_k: int = 4
    seed: int = 0

    def as_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def default_lengths(n_ctx_train: int) -> tuple[int, ...]:
    """Doubling lengths from 512 up to the usable context: the training context, capped at 4096
    tokens so calibration stays within minutes on a laptop CPU (pass --lengths to go further)."""
    top = min(n_ctx_train - 64 if n_ctx_train else 4096, 4096)
    out, L = [], 512
    while L <= top:
        out.append(L)
        L *= 2
    return tuple(out) or (max(64, top),)


def check_settings(s: Settings, n_ctx_train: int, n_head: int) -> None:
    if not s.lengths:
        raise KvcliError("--lengths is empty")
    for L in s.lengths:
        if L < 64:
            raise KvcliError(f"--lengths: {L} is too short (at least 64 tokens: the prompt has a question and a "
                             "chat template)")
        if n_ctx_train and L + s.max_new_tokens > n_ctx_train:
            raise KvcliError(f"--lengths: {L} tokens (+{s.max_new_tokens} to answer) exceed the model's context "
                             f"of {n_ctx_train}")
    if s.depths < 1 or s.needles < 1 or s.samples < 1:
        raise KvcliError("--depths, --needles and --samples must be at least 1")
    if s.srh_k > n_head:
        raise KvcliError(f"srh_k {s.srh_k} is more than the model's {n_head} query heads")
    if s.error_budget <= s.window:
        raise KvcliError(f"the error budget ({s.error_budget}) must exceed the window ({s.window})")


@dataclass
class Checkpoint:
    path: Path
    key: dict                                   # model hash + settings: a checkpoint resumes only the same run
    probes: dict = field(default_factory=dict)  # probe key -> ProbeResult json
    texts: dict = field(default_factory=dict)   # text key -> {"errors": [...], "steps": n}
    seconds: float = 0.0

    @classmethod
    def open(cls, path: Path, key: dict, warn) -> "Checkpoint":
        if path.is_file():
            try:
                d = json.loads(path.read_text())
                if d.get("key") == key:
                    cp = cls(path, key, d.get("probes", {}), d.get("texts", {}), float(d.get("seconds", 0.0)))
                    warn(f"resuming from {path}: {len(cp.probes)} probes and {len(cp.texts)} texts already done")
                    return cp
                warn(f"ignoring {path}: it was made with other settings or another model (starting over)")
            except (OSError, ValueError):
                warn(f"ignoring unreadable progress file {path} (starting over)")
        return cls(path, key)

    def save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": self.key, "probes": self.probes, "texts": self.texts,
                                   "seconds": self.seconds}))
        os.replace(tmp, self.path)


def calibrate(model_path: Path, out: Path | None = None, settings: Settings | None = None, progress: bool = True,
              warn=None) -> store.Calibration:
    """Run both stages for `model_path` and write the side-car; returns what was written."""
    from kvcli.calibration.runner import load_lm, sdpa  # noqa: PLC0415 (imports torch)

    warn = warn or (lambda msg: print(f"kvcli: {msg}", file=sys.stderr, flush=True))
    s = settings or Settings()
    info = read_model_info(model_path)
    if not s.lengths:
        s.lengths = default_lengths(info.n_ctx_train)
    check_settings(s, info.n_ctx_train, info.n_head)
    mhash = model_hash(model_path)
    out = Path(out) if out else store.default_output(model_path, mhash)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(out.parent, os.W_OK):
        raise KvcliError(f"cannot write to {out.parent}: choose another place with -o")
    cp = Checkpoint.open(out.with_name(out.name + ".partial.json"),
                         {"model_hash": mhash, "method_version": store.METHOD_VERSION, "settings": s.as_json()}, warn)

    t_start = time.perf_counter() - cp.seconds
    lm = load_lm(model_path)
    # the needle kind rotates with length and depth, so even --needles 1 sees every kind
    probe_plan = [(L, d, (li + di * s.needles + k) % len(NEEDLES)) for li, L in enumerate(s.lengths)
                  for di, d in enumerate(spread_depths(s.depths)) for k in range(s.needles)]
    text_plan = [(s.lengths[i % len(s.lengths)], i) for i in range(s.samples)]
    total = sum(L + s.max_new_tokens for L, _, _ in probe_plan) + sum(L + s.gen_tokens for L, _ in text_plan)
    bar = _bar(total, progress)

    def tick(n, **post):
        cp.seconds = time.perf_counter() - t_start
        cp.save()
        if bar is not None:
            bar.update(n)
            bar.set_postfix(post, refresh=False)

    try:
        with sdpa(lm.model):
            # stage 1: heads
            results: list[ProbeResult] = []
            for L, d, k in probe_plan:
                probe = build_probe(lm.n_tokens, lm.template, L, d, k, s.seed)
                if probe.key in cp.probes:
                    results.append(ProbeResult.from_json(cp.probes[probe.key]))
                    tick(L + s.max_new_tokens, stage="heads", ok=sum(r.ok for r in results))
                    continue
                r = run_probe(lm, probe, s.max_new_tokens, s.min_recall)
                results.append(r)
                cp.probes[probe.key] = r.as_json()
                tick(L + s.max_new_tokens, stage="heads", ok=sum(r.ok for r in results))
            scores, n_ok = head_scores(results, lm.n_layer, lm.n_head)
            srh = [int(h) for h in rank_heads(scores)[:, :s.srh_k].reshape(-1)] if n_ok else []
            if not n_ok:
                warn(f"no probe was answered (0 of {len(results)}): the semantic retrieval heads cannot be "
                     "identified for this model; its calibration will hold the layer profile only and compresskv "
                     "will score with every head (shorter --lengths may help)")
            # stage 2: layers (squeezed with the heads just found)
            per_text = []
            for L, i in text_plan:
                key = f"L{L}-t{i}"
                if key not in cp.texts:
                    prompt = error_profile_text(L, i, s.seed, lm.template, lm.n_tokens)
                    tokens = lm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
                    err, steps = text_errors(lm, tokens, srh, s.srh_k, s.gen_tokens, s.error_budget, s.window,
                                             s.kernel)
                    cp.texts[key] = {"errors": err.tolist(), "steps": steps, "length": len(tokens)}
                per_text.append(np.asarray(cp.texts[key]["errors"]))
                tick(L + s.gen_tokens, stage="layers")
    finally:
        if bar is not None:
            bar.close()
    try:
        profile = layer_profile(per_text)
    except ValueError as e:
        raise KvcliError(f"calibration failed: {e}") from None
    cal = store.Calibration(
        model_hash=mhash, model_name=info.name, n_layer=info.n_layer, n_head=info.n_head, n_head_kv=info.n_head_kv,
        head_scores=scores, layer_scores=profile, probes=len(results), probes_ok=n_ok,
        settings=s.as_json() | {"probe_lengths_tokens": sorted({r.length for r in results})},
        kvcli_version=__version__, created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        seconds=round(time.perf_counter() - t_start, 1), source=str(out))
    store.write(cal, out)
    cp.path.unlink(missing_ok=True)
    return cal


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm  # noqa: PLC0415
    # tokens processed is what the time goes into, so the estimate is in tokens
    return tqdm(total=total, desc="calibrate compresskv", unit="tok", file=sys.stderr, dynamic_ncols=True,
                smoothing=0.1)


