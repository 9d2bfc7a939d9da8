"""compresskv's stored calibration applied to a run (numpy only: kvcli run/chat/batch must not load torch to
read it). The calibration tool that writes it is kvcli/calibration/compresskv.py."""
from __future__ import annotations

import sys
from pathlib import Path

from kvcli.calibration import store
from kvcli.policies.base import parse_policy_args
from kvcli.policies.compresskv import SPEC

_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    """stderr, once per process: bench/eval/check resolve the policy once per configuration."""
    if msg not in _WARNED:
        _WARNED.add(msg)
        print(f"kvcli: warning: {msg}", file=sys.stderr, flush=True)


def policy_args(model_path, args: dict | None, warn=None) -> dict:
    """The --policy-arg dict for compresskv on `model_path`, calibration filled in.

    Explicit `srh` / `layer_scores` arguments win. Otherwise the model's calibration is found
    (store.find) and used; a calibration of another model is an error. Without any, the policy
    runs its documented fallback (every head scores, uniform budgets) and a warning says so.
    """
    warn = warn or _warn_once
    out = dict(args) if isinstance(args, dict) else parse_policy_args(args)
    if "srh" in out or "layer_scores" in out:
        return out
    cal = store.find(Path(model_path))
    if cal is None:
        warn(f"no compresskv calibration for {Path(model_path).name}: every head scores and layer budgets are "
             f"uniform (SnapKV-style fallback); run `kvcli calibrate compresskv --model {model_path}`")
        return out
    k = SPEC.param("srh_k").parse("compresskv", out["srh_k"]) if "srh_k" in out else SPEC.param("srh_k").default
    if cal.probes_ok:
        out["srh"] = ",".join(str(h) for h in cal.srh(k))
    else:
        warn(f"the compresskv calibration {cal.source} found no semantic retrieval heads (no probe answered): "
             "every head scores; layer budgets are calibrated")
    out["layer_scores"] = ",".join(repr(float(x)) for x in cal.layer_scores)
    return out
