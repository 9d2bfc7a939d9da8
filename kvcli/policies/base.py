"""What a registry entry is: a policy's name, paper, parameters, needs and documented deviations.

The one source of policy parameters: defaults, ranges and validation live here (and in each
policy's module), nowhere else. `PolicySpec.validate` turns `--policy-arg key=value` into the typed,
complete dict the torch planner (kvcli/reference/policies/) takes; `PolicySpec.native_params` renders
the same dict, with the closed-form layer schedules computed here, as the `key=value;key=value` text
the C++ planner (native/src/plan/) parses. The C++ side declares no parameter: no default, no range;
a missing parameter is an error there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from kvcli.errors import KvcliError
from kvcli.planning.formats import Kind, check_kinds


@dataclass(frozen=True)
class Param:
    """One parameter of a policy."""

    name: str
    type: str                       # "int" | "float" | "choice" | "ints" | "floats" (comma-separated lists)
    default: Any
    doc: str
    paper_default: Any = None       # the value (or a short phrase) the paper / authors' code uses
    min: float | None = None        # inclusive bounds for int/float
    max: float | None = None
    choices: tuple[str, ...] = ()   # for "choice"
    odd: bool = False               # ints that must be odd (pooling kernels)

    def parse(self, policy: str, raw: Any) -> Any:
        """The typed value of `raw` (a str from the command line, or already typed), or a clear error."""
        where = f"policy '{policy}': parameter {self.name}"
        if self.type == "choice":
            val = str(raw).strip().lower()
            if val not in self.choices:
                raise KvcliError(f"{where} must be one of {', '.join(self.choices)} (got '{raw}')")
            return val
        if self.type in ("ints", "floats"):
            return self._parse_list(where, raw)
        if self.type == "int":
            try:
                if isinstance(raw, bool):
                    raise ValueError
                if isinstance(raw, float):
                    if not raw.is_integer():
                        raise ValueError
                    val = int(raw)
                else:
                    val = int(str(raw).strip(), 10)
            except ValueError:
                raise KvcliError(f"{where} must be an integer (got '{raw}')") from None
        elif self.type == "float":
            try:
                val = float(str(raw).strip())
            except ValueError:
                raise KvcliError(f"{where} must be a number (got '{raw}')") from None
            if not math.isfinite(val):
                raise KvcliError(f"{where} must be finite (got '{raw}')")
        else:  # pragma: no cover - registry bug
            raise AssertionError(f"unknown parameter type {self.type}")
        if self.min is not None and val < self.min:
            raise KvcliError(f"{where} must be >= {_num(self.min)} (got {raw})")
        if self.max is not None and val > self.max:
            raise KvcliError(f"{where} must be <= {_num(self.max)} (got {raw})")
        if self.odd and val % 2 == 0:
            raise KvcliError(f"{where} must be odd (got {raw}): the pooling is centred on each slot")
        return val

    def _parse_list(self, where: str, raw: Any) -> tuple:
        items = [x.strip() for x in raw.split(",")] if isinstance(raw, str) else list(raw)
        items = [x for x in items if not (isinstance(x, str) and x == "")]
        out = []
        for x in items:
            try:
                if self.type == "ints":
                    if isinstance(x, float) and not x.is_integer():
                        raise ValueError
                    v = int(x) if not isinstance(x, str) else int(x, 10)
                else:
                    v = float(x)
                    if not math.isfinite(v):
                        raise ValueError
            except (TypeError, ValueError):
                kind = "integers" if self.type == "ints" else "finite numbers"
                raise KvcliError(f"{where} must be a comma-separated list of {kind} (bad item '{x}')") from None
            if (self.min is not None and v < self.min) or (self.max is not None and v > self.max):
                raise KvcliError(f"{where}: item {x} outside [{_num(self.min)}, {_num(self.max)}]")
            out.append(v)
        return tuple(out)

    def render(self, val: Any) -> str:
        if self.type == "ints":
            return ",".join(str(int(v)) for v in val)
        if self.type == "floats":
            return ",".join(repr(float(v)) for v in val)    # repr round-trips exactly through strtod
        return repr(float(val)) if self.type == "float" else str(val)

    def shown_default(self) -> str:
        if self.type in ("ints", "floats"):
            return self.render(self.default) or "(empty)"
        return str(self.default)

    def range_text(self) -> str:
        if self.type == "choice":
            return "|".join(self.choices)
        if self.type in ("ints", "floats"):
            return f"comma-separated {'integers' if self.type == 'ints' else 'numbers'}"
        lo = "-inf" if self.min is None else _num(self.min)
        hi = "inf" if self.max is None else _num(self.max)
        return f"{self.type} in [{lo}, {hi}]" + (", odd" if self.odd else "")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class Paper:
    title: str
    arxiv: str = ""
    venue: str = ""
    code: str = ""

    def cite(self) -> str:
        bits = [self.title]
        if self.venue:
            bits.append(self.venue)
        if self.arxiv:
            bits.append(f"arXiv:{self.arxiv}")
        return ", ".join(bits)


@dataclass
class PassResult:
    """What a second pass observed: `scores` (the Observation field of its `kind`), its seconds, and the most cells
    it held beyond the sequence while it ran."""
    scores: Any
    seconds: float
    longest: int


class SecondPass:
    """A pass after the prefill that observes what the prefill cannot: the model is fed more tokens with the
    observation of `kind` armed, then rolled back (`PolicySpec.second_pass`; kvcli/policies/reconstruction.py is
    one). The drivers (one prefill, bounded reading, Shared, re-selection, kvcli check) call these hooks without
    knowing which policy has one."""

    kind: str = ""       # the observation kind (Observation field) it fills; the prefill itself does not observe it
    name: str = ""       # how messages name it
    scoring: str = ""    # the chunk_scoring a document read in chunks reports

    def run(self, session, tokens: list[int], seq: int, params: dict, *, start: int = 0, end: int | None = None,
            restore_logits: bool = True, bounded: bool = False) -> PassResult:
        """Run over `tokens[start:end]`, the last tokens prefilled into `seq` (every slot the sequence holds is
        scored); the sequence is left as it was (with the logits of `tokens[end - 1]` when `restore_logits`).
        `bounded`: bounded reading (its memory bound)."""
        raise NotImplementedError

    def shared(self, params_list) -> dict:
        """The parameters one pass serving several configurations (these parameters) runs with."""
        raise NotImplementedError

    def room(self, n_prompt: int, params: dict) -> int:
        """Cells the pass needs in the context beyond a prompt (or, in bounded reading, a chunk) of n_prompt."""
        raise NotImplementedError

    def held(self, session, params: dict, chunk: int) -> int:
        """Bounded reading: the most cells a pass over a chunk holds beyond the kept entries and the chunk."""
        raise NotImplementedError

    def merge(self, scores, carried):
        """Bounded reading: a chunk's scores combined with those the kept entries carry (the first slots)."""
        raise NotImplementedError

    def refusal(self, info) -> str | None:
        """Why a model (kvcli.models.ModelInfo) cannot run the pass ("does not support ..."), or None."""
        return None


@dataclass(frozen=True)
class PolicySpec:
    """A registry entry. `observe(params)` tells the engines what to capture before planning.

    What one policy needs beyond observe -> plan -> compact hangs off its spec as hooks the drivers, apps and
    commands call without knowing its name: `second_pass` (an observation made after the prefill), `model_args`
    (arguments completed for a model, from files kept for it), `model_check` (parameters checked against the model's
    header), `resolve_instruction` (parameters resolved from the question), `widest` / `schedule` (layer schedules),
    `agnostic` (scores without the question)."""

    name: str
    summary: str                                    # one line for `kvcli policies`
    keeps: str                                      # what the policy keeps, for --explain
    paper: Paper | None
    params: tuple[Param, ...] = ()
    needs: tuple[Kind, ...] = ()                    # observation kinds (kvcli.planning.formats.KINDS)
    window_param: str | None = None                 # which parameter is the observation window w
    budget_above: str | None = None                 # the parameter the budget must exceed (kept inside it)
    deviations: tuple[str, ...] = ()                # every documented difference from the paper/code
    budget_note: str = ("per-layer budgets sum to budget x n_layer; the observation window counts "
                        "inside the budget")
    agnostic: bool = False                          # scores without the question (kvzip): chat compresses once
    native: bool = True                             # implemented in C++ (native/src/policies/)
    reference: bool = True                          # implemented in torch (kvcli/reference/policies/)
    resolve: Callable[[dict], dict] | None = None   # fills values that depend on other params
    # fills values that depend on the instruction text (windowkv's task=auto), before `resolve`; gets
    # (params, instruction or None) and must raise KvcliError when it needs an instruction that is None
    resolve_instruction: Callable[[dict, str | None], dict] | None = None
    check: Callable[[dict, int], None] | None = None  # further budget-dependent checks (params, budget)
    # the closed-form per-layer schedule, computed once here for the native planner:
    # (params, budget, n_layer, n) -> {key: int or list of ints}, rendered after the parameters
    # (params, n_layer, n, budget) -> the entries the widest (layer, KV head) of a plan over n > budget entries
    # keeps, where the layer schedule alone decides it (None where the scores do): a document read in chunks
    # is refused before its prefill when that leaves no room to read on (kvcli.drivers.chunked.check_room)
    widest: Callable[[dict, int, int, int], int | None] | None = None
    schedule: Callable[[dict, int, int, int], dict] | None = None
    resolved_away: tuple[str, ...] = ()             # parameters the native planner never reads: `resolve` or
                                                    # `schedule` turned them into others
    # an observation made after the prefill by feeding more tokens (its kind, in `needs`, the prefill leaves out)
    second_pass: SecondPass | None = None
    # "module:function" (model_path, {key: value}) -> {key: value}: the --policy-arg items completed for the model
    # from files kept for it, before they are validated; imported where it is called (planning), as it may live in
    # a layer above the policies (compresskv's calibration: kvcli.calibration.lookup)
    model_args: str | None = None
    # (params, ModelInfo) -> None: parameters that depend on the model's shape checked against its header, before
    # the model loads (KvcliError if not)
    model_check: Callable[[dict, Any], None] | None = None
    # the module of the commands of an offline step the policy needs once per model (`kvcli calibrate`): its
    # COMMANDS join that group, its UNCALIBRATED says what runs without it (kvcli info)
    calibrate: str | None = None

    def __post_init__(self):
        check_kinds(self.needs)   # kinds both engines and the C API know, or the registry fails to load
        if self.second_pass is not None and self.second_pass.kind not in self.needs:
            raise ValueError(f"policy '{self.name}': its second pass observes {self.second_pass.kind!r}, not in needs")

    # -- parameters ---------------------------------------------------------------
    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def defaults(self) -> dict:
        return self.validate({})

    def validate(self, args: dict | list | tuple | None = None, instruction: str | None = None) -> dict:
        """Typed, complete parameters from user input.

        `args` is a dict {key: value} or a list of "key=value" strings (repeatable
        --policy-arg). Unknown keys, malformed items and out-of-range values raise KvcliError
        with the list of valid keys. `instruction` is the user's instruction/question text, for
        policies whose parameters depend on it (windowkv task=auto); the result never does
        again, so validating it a second time needs no instruction.
        """
        given = parse_policy_args(args, self.name) if not isinstance(args, dict) else dict(args)
        known = {p.name: p for p in self.params}
        unknown = [k for k in given if k not in known]
        if unknown:
            valid = ", ".join(known) if known else "none (this policy takes no parameters)"
            raise KvcliError(f"policy '{self.name}' has no parameter '{unknown[0]}'; valid keys: {valid}")
        out = {p.name: p.parse(self.name, given[p.name]) if p.name in given else p.default for p in self.params}
        if self.resolve_instruction is not None:
            out = self.resolve_instruction(out, instruction)
        if self.resolve is not None:
            out = self.resolve(out)
        return out

    def render(self, params: dict) -> str:
        """The validated parameters as `key=value;key=value` text (every one of them)."""
        return ";".join(f"{p.name}={p.render(params[p.name])}" for p in self.params if p.name in params)

    def native_params(self, params: dict, budget: int, n_layer: int, n: int) -> str:
        """What the C++ planner (kvcli_plan_make) parses for an observation of n_layer layers and n slots:
        every parameter it reads, resolved (it declares no default), then the closed-form schedule computed
        here. `params` is the dict from `validate` (complete: the C++ side errs on a missing key)."""
        items = {p.name: p.render(params[p.name]) for p in self.params if p.name not in self.resolved_away}
        if self.schedule is not None:
            for key, val in self.schedule(params, int(budget), int(n_layer), int(n)).items():
                items[key] = ",".join(str(int(v)) for v in val) if isinstance(val, (list, tuple)) else str(int(val))
        return ";".join(f"{k}={v}" for k, v in items.items())

    def check_budget(self, budget: int, params: dict) -> None:
        """Budget-dependent validation, the only one (neither planner repeats it): budget >= 1 and larger
        than the `budget_above` parameter (a window kept inside the budget), then `check`; KvcliError if not."""
        if int(budget) < 1:
            raise KvcliError(f"policy '{self.name}': budget must be >= 1 (got {budget})")
        if self.budget_above is not None and int(budget) <= int(params[self.budget_above]):
            key = self.budget_above
            raise KvcliError(f"policy '{self.name}': budget {budget} must be larger than {key}={params[key]} (its "
                             f"entries are kept inside the budget); lower it with --policy-arg {key}=N")
        if self.check is not None:
            self.check(params, int(budget))

    # -- what to observe ------------------------------------------------------------
    def observe(self, params: dict) -> tuple[tuple[str, ...], int]:
        """(kinds, window) for Session.prefill(observe=kinds, window=window)."""
        w = int(params[self.window_param]) if self.window_param and ("window" in self.needs or "query" in self.needs) \
            else 0
        return self.needs, w

    def prefill_kinds(self, params: dict) -> tuple[str, ...]:
        """The kinds the prefill itself observes: those of `observe` less the second pass's."""
        kinds, _ = self.observe(params)
        return tuple(k for k in kinds if self.second_pass is None or k != self.second_pass.kind)

    def room_after(self, n_prompt: int, params: dict | None = None) -> int:
        """Cells the second pass needs in the context beyond a prompt of n_prompt tokens (0 without one);
        `params`: the validated parameters (default: the defaults)."""
        if self.second_pass is None:
            return 0
        return self.second_pass.room(n_prompt, self.defaults() if params is None else params)

    def compresses(self, n: int, budget: int) -> bool:
        """False when the prompt fits the budget: every policy then keeps everything."""
        return self.name != "full" and n > budget

    # -- text ---------------------------------------------------------------------
    def line(self) -> str:
        return f"{self.name:<13} {self.summary}"

    def explain(self) -> str:
        out = [f"{self.name}: {self.summary}", ""]
        if self.paper is not None:
            out.append(f"Paper: {self.paper.cite()}")
            if self.paper.code:
                out.append(f"Authors' code: {self.paper.code}")
        else:
            out.append("Paper: none (baseline)")
        out.append(f"Keeps: {self.keeps}")
        needs = ", ".join(self.needs) if self.needs else "nothing (positions only)"
        out.append(f"Observes: {needs}")
        out.append(f"Budget: {self.budget_note}")
        engines = [e for e, ok in (("native", self.native), ("reference", self.reference)) if ok]
        out.append(f"Engines: {', '.join(engines)}")
        out.append("")
        if self.params:
            out.append("Parameters (--policy-arg key=value):")
            for p in self.params:
                paper = "" if p.paper_default is None else f"; paper: {p.paper_default}"
                out.append(f"  {p.name} = {p.shown_default()}  ({p.range_text()}{paper})")
                out.append(f"      {p.doc}")
        else:
            out.append("Parameters: none")
        if self.deviations:
            out.append("")
            out.append("Deviations from the paper / authors' code:")
            for d in self.deviations:
                out.append(f"  - {d}")
        return "\n".join(out)


def split_policy_arg(item) -> tuple[str | None, str, str]:
    """One --policy-arg item -> (policy or None, key, value): "key=value" or "policy.key=value" (no parameter
    name holds a dot, so a dot before the '=' names the policy). The one parser of --policy-arg for every command."""
    if not isinstance(item, str) or "=" not in item:
        raise KvcliError(f"--policy-arg expects key=value or policy.key=value (got '{item}')")
    lhs, value = item.split("=", 1)
    pol, dot, key = lhs.strip().rpartition(".") if "." in lhs else ("", "", lhs.strip())
    key, pol = key.strip(), pol.strip().lower()
    if not key or (dot and not pol):
        raise KvcliError(f"--policy-arg expects key=value or policy.key=value (got '{item}')")
    if ";" in value or ";" in lhs:
        raise KvcliError(f"--policy-arg values may not contain ';' (got '{item}')")
    return (pol if dot else None), key, value.strip()


def parse_policy_args(items: list | tuple | None, policy: str | None = None) -> dict:
    """["k=v", "policy.k=v", ...] -> {k: v} for `policy`, the policy in use: an item naming another policy is
    refused (one line naming both), as are a malformed item and a repeated key. Without `policy`, only "k=v"."""
    out: dict[str, str] = {}
    for item in items or ():
        pol, k, v = split_policy_arg(item)
        if pol is not None and pol != (policy or "").lower():
            using = f"the policy in use is '{policy.lower()}'" if policy else "no policy is named here"
            raise KvcliError(f"--policy-arg {item.split('=', 1)[0].strip()} is a parameter of policy '{pol}', but "
                             f"{using}")
        if k in out:
            raise KvcliError(f"--policy-arg {k} given twice")
        out[k] = v
    return out


def parse_scoped_args(items) -> dict[str, dict]:
    """--policy-arg POLICY.KEY=VALUE (repeatable; bench and eval, which run several policies) ->
    {policy: {key: value}}; an item without its policy, and a repeated key, are refused."""
    out: dict[str, dict] = {}
    for item in items or ():
        pol, k, v = split_policy_arg(item)
        if pol is None:
            raise KvcliError(f"--policy-arg expects POLICY.KEY=VALUE here, as several policies run (e.g. "
                             f"snapkv.window=32), got '{item}'")
        args = out.setdefault(pol, {})
        if k in args:
            raise KvcliError(f"--policy-arg {pol}.{k} given twice")
        args[k] = v
    return out


# Parameters several policies share, so their docs and bounds read the same everywhere.
def window_param(default: int, paper: Any, doc: str | None = None) -> Param:
    return Param("window", "int", default, doc or "observation window: the last `window` prompt tokens score the "
                 "others and are always kept", paper_default=paper, min=1, max=4096)


def kernel_param(default: int, paper: Any) -> Param:
    return Param("kernel", "int", default, "1-D pooling kernel over the window scores (stride 1, centred; "
                 "1 = no pooling)", paper_default=paper, min=1, max=255, odd=True)


def pool_param(default: str, paper: Any) -> Param:
    return Param("pool", "choice", default, "pooling: max (pads with -inf) or avg (pads with 0 and divides by "
                 "the kernel, PyTorch's count_include_pad)", paper_default=paper, choices=("max", "avg"))


def gqa_param(default: str = "mean") -> Param:
    return Param("gqa", "choice", default, "how the scores of the query heads that share a KV head are combined "
                 "into that KV head's score (selection is per KV head)",
                 paper_default="per query head (cache repeated to query heads)", choices=("mean", "max", "sum"))
