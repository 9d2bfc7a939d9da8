"""Options the commands share, parsed once into a `Request` so that a flag means the same everywhere.

Usage (the API `kvcli batch` and every other command use):

    @click.command("run")
    @request_options("policy", "sampling", "chunking", max_tokens=256)
    def run_cmd(req: Request, ...): ...

`request_options(*groups, **defaults)` adds the options of each group to the command and hands the
function one keyword argument `req` (a `Request`) in their place; the other options arrive as usual.
Groups:
    policy      --policy/-p, --budget/-b, --policy-arg [POLICY.]KEY=VALUE (repeatable; a repeated key is refused,
                POLICY must be --policy's)
    policies    --policies, --budgets (comma lists), --policy-arg POLICY.KEY=VALUE (bench, eval)
    chunking    --chunk, --max-cache, --chunk-scoring
    chunk       --chunk, --chunk-scoring (commands without a cache cap)
    sampling    --max-tokens/-n, --temperature/-t, --seed, --top-k, --top-p, --min-p, --repeat-penalty,
                --repeat-last-n, --presence-penalty, --frequency-penalty, --dry-multiplier, --dry-base,
                --dry-allowed-length, --dry-penalty-last-n (names as in llama.cpp; kvcli.generate.Sampling)
    penalties   the repetition and DRY flags of `sampling` alone, off by default (eval: greedy decoding)
    cache_type  --cache-type (one of f16, q8_0, q4_0, f32)
    threads     --threads
`defaults` overrides a group's default by parameter name (max_tokens=512, budget=256, policies="...") and a few
help texts (max_tokens_help, chunk_help, cache_type_help, threads_help).
Bad values are refused before any model loads, with one line (kvcli.errors.KvcliError, exit 2).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import click

from kvcli import config, policies
from kvcli.errors import KvcliError
from kvcli.evaluation.measure import parse_int_list, parse_list
from kvcli.generate import Sampler, Sampling
from kvcli.planning.planner import resolve
from kvcli.policies import parse_policy_args, parse_scoped_args

class SharedOption(click.Option):
    """An option built here, in the one module of the shared flags (tests/test_command_flags.py checks that every
    command that loads a model takes its shared flags from here, with the same help)."""


def shared_option(*decls, **attrs):
    """click.option for the shared flags: the same option class, so that a command's shared flags can be told
    from its own."""
    return click.option(*decls, cls=SharedOption, **attrs)


model_option = shared_option("--model", "-m", metavar="PATH.gguf|NAME", default=None,
                             help="GGUF model file, or the name of a pulled model (kvcli models). Default: "
                                  "$KVCLI_MODEL, else the bundled SmolLM2-135M-Instruct Q4_1.")
json_option = shared_option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
threads_option = shared_option("--threads", type=click.IntRange(1, 1024), default=None,
                               help="CPU threads of llama.cpp. Default: $KVCLI_THREADS, else the CPUs this process "
                                    "may use (affinity, cgroup quota). On a busy machine fewer threads are faster: "
                                    "ggml's threads spin at every node while one waits for a core.")

chunk_scoring_option = shared_option(
    "--chunk-scoring", type=click.Choice(["question", "chunk"]), default="question", show_default=True,
    help="For a document read in chunks, the queries that score each chunk (window policies): 'question' = the "
         "prompt's last window (the question), prefilled after the chunk and rolled back, as FINCH does; "
         "'chunk' = the chunk's own last window.")

CACHE_TYPES = ("f16", "q8_0", "q4_0", "f32")


def complete_policy(ctx, param, incomplete):
    """Shell completion of --policy values (click's _KVCLI_COMPLETE)."""
    return [n for n in policies.available() if n.startswith(incomplete.lower())]


policy_option = shared_option("--policy", "-p", default=config.default("policy", "full"),
                              shell_complete=complete_policy,
                              help="KV-cache policy (kvcli policies lists them). Default: $KVCLI_POLICY, else the "
                                   "config file, else full.")


@dataclass
class Request:
    """What a command was asked to do, from the shared options (fields of groups not used keep their defaults)."""

    policy: str = "full"
    budget: int | None = None            # None for the full cache
    policy_args: dict = field(default_factory=dict)
    policies: list[str] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    scoped_args: dict[str, dict] = field(default_factory=dict)   # --policy-arg POLICY.KEY=VALUE
    chunk: int | None = None
    max_cache: int | None = None
    chunk_scoring: str = "question"
    max_tokens: int = 256
    sampling: object = None              # kvcli.generate.Sampling
    cache_type: str = "f16"
    threads: int | None = None

    def sampler(self):
        """A kvcli.generate.Sampler with these settings."""
        return Sampler(self.sampling)

    def compression(self, model_path, instruction: str | None = None):
        """The compression asked for (--policy, --budget, --policy-arg), checked once here, at the command's
        boundary, and completed for the model at `model_path` (kvcli.planning.planner.resolve; `instruction`: the
        question, for a policy that resolves parameters from it): the value the command passes down to the apps and
        drivers."""
        return resolve(model_path, self.policy, self.budget, self.policy_args, instruction)


def _sampling_options(d: dict, penalties_only: bool = False) -> list:
    s = Sampling.greedy() if penalties_only else Sampling()

    def num(name, typ, help_, short=None):
        decls = [f"--{name.replace('_', '-')}"] + ([short] if short else [])
        value = d.get(name, getattr(s, name))
        default = config.default(name, value) if name in config.KEYS else value
        return shared_option(*decls, name, type=typ, default=default,
                             show_default=str(value) if name in config.KEYS else True, help=help_)

    sampling = [
        shared_option("--max-tokens", "-n", type=click.IntRange(1, 100000),
                      default=config.default("max_tokens", d.get("max_tokens", 256)),
                      show_default=str(d.get("max_tokens", 256)),
                      help=d.get("max_tokens_help", "Longest answer, in tokens.")),
        num("temperature", float, "0 = greedy.", "-t"),
        num("seed", int, "Seed of the sampler's random choice (temperature > 0)."),
        num("top_k", int, "Top-k sampling (temperature > 0); 0 = the whole vocabulary."),
        num("top_p", float, "Top-p (nucleus) sampling (temperature > 0); 1 = off."),
        num("min_p", float, "Min-p sampling (temperature > 0); 0 = off.")]
    return ([] if penalties_only else sampling) + [
        num("repeat_penalty", float, "Penalise tokens repeated in the last --repeat-last-n tokens of the answer; "
                                     "1 = off."),
        num("repeat_last_n", int, "Tokens of the answer --repeat-penalty looks back at; -1 = all."),
        num("presence_penalty", float, "Presence penalty; 0 = off."),
        num("frequency_penalty", float, "Frequency penalty; 0 = off."),
        num("dry_multiplier", float, "DRY penalty on tokens that extend a repeated sequence of the answer "
                                     "(stops runaway repetition); 0 = off."),
        num("dry_base", float, "DRY base: the penalty grows as base ^ (repeat length - allowed length)."),
        num("dry_allowed_length", int, "DRY: repeats up to this many tokens are free."),
        num("dry_penalty_last_n", int, "Tokens of the answer DRY looks back at; -1 = all."),
    ]


def _group_options(group: str, d: dict) -> list:
    if group == "policy":
        return [policy_option,
                shared_option("--budget", "-b", type=click.IntRange(1),
                              default=d.get("budget", config.default("budget")),
                              show_default="budget" in d,
                              help="Entries kept per layer and KV head, observation window included. Default: "
                                   "$KVCLI_BUDGET."),
                shared_option("--policy-arg", "policy_args", multiple=True, metavar="[POLICY.]KEY=VALUE",
                              help="Policy parameter, e.g. window=32 or snapkv.window=32 (repeatable; POLICY, "
                                   "if given, must be --policy).")]
    if group == "policies":
        return [shared_option("--policies", default=d.get("policies", "full,snapkv"), show_default=True,
                              help=d.get("policies_help", "Comma-separated policies.")),
                shared_option("--budgets", default="128,256,512", show_default=True,
                              help="Comma-separated budgets (entries kept per layer and KV head)."),
                shared_option("--policy-arg", "policy_args", multiple=True, metavar="POLICY.KEY=VALUE",
                              help="Policy parameter, e.g. snapkv.window=32 (repeatable).")]
    if group in ("chunking", "chunk"):
        out = [shared_option("--chunk", type=click.IntRange(0), default=None, metavar="N", help=d.get("chunk_help") or
                             "Read the document in chunks of N tokens, compressing to --budget after each and "
                             "re-indexing positions (peak cache: budget + N). Default: on, with 1024, when the "
                             "document does not fit the model's context or --max-cache; 0 = off.")]
        if group == "chunking":
            out.append(shared_option("--max-cache", type=click.IntRange(1), default=None, metavar="CELLS",
                                     help="Most cells the KV cache may hold; a longer document is read in chunks "
                                          "and compressed after each."))
        return out + [chunk_scoring_option]
    if group in ("sampling", "penalties"):
        return _sampling_options(d, penalties_only=group == "penalties")
    if group == "cache_type":
        return [shared_option("--cache-type", type=click.Choice(d.get("cache_types", CACHE_TYPES)), default="f16",
                              show_default=True, help=d.get("cache_type_help", "llama.cpp KV cache type."))]
    if group == "threads":
        return [threads_option] if "threads_help" not in d else \
            [shared_option("--threads", type=click.IntRange(1, 1024), default=None, help=d["threads_help"])]
    raise ValueError(f"unknown option group '{group}'")


# the parameters each group hands over as they are (the others are parsed in _request)
_PLAIN_NAMES = {"policy": ("policy", "budget"), "chunking": ("chunk", "max_cache", "chunk_scoring"),
                "chunk": ("chunk", "chunk_scoring"), "sampling": ("max_tokens",), "cache_type": ("cache_type",),
                "threads": ("threads",)}
_PENALTY_NAMES = ("repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "dry_multiplier",
                  "dry_base", "dry_allowed_length", "dry_penalty_last_n")
_SAMPLING_NAMES = ("temperature", "seed", "top_k", "top_p", "min_p", *_PENALTY_NAMES)


def _request(groups, kw: dict) -> Request:
    """Pop the shared options from the command's keyword arguments into a Request (checked)."""
    req = Request()
    for group in groups:
        for name in _PLAIN_NAMES.get(group, ()):
            setattr(req, name, kw.pop(name))
    if "sampling" in groups or "penalties" in groups:
        names = _SAMPLING_NAMES if "sampling" in groups else _PENALTY_NAMES
        req.sampling = replace(Sampling.greedy(), **{n: kw.pop(n) for n in names}).validate()
    if "policy" in groups:
        req.policy = (req.policy or "full").lower()
        req.policy_args = parse_policy_args(list(kw.pop("policy_args")), req.policy)
        if req.policy == "full":
            req.budget = None
    if "policies" in groups:
        req.policies = parse_list(kw.pop("policies"), "--policies", lambda s: s.lower())
        req.budgets = parse_int_list(kw.pop("budgets"), "--budgets")
        if any(p != "full" for p in req.policies) and not req.budgets:
            raise KvcliError("--budgets is needed for policies other than full")
        req.scoped_args = parse_scoped_args(kw.pop("policy_args"))
    return req


def request_options(*groups: str, **defaults):
    """Add the options of `groups` to a click command; the command receives them as one `req: Request`
    (see the module docstring for the groups and their flags)."""
    def deco(f):
        @functools.wraps(f)
        def wrapper(*a, **kw):
            return f(*a, req=_request(groups, kw), **kw)
        for group in reversed(groups):
            for opt in reversed(_group_options(group, defaults)):
                wrapper = opt(wrapper)
        return wrapper
    return deco
