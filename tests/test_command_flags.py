"""Every command that loads a model takes the shared flags (threads, cache type, policy, budget, --policy-arg,
chunking, sampling where it decodes) from the one options module, kvcli/commands/options.py, with the same help.

The walk goes over every command of `kvcli` (groups included) through `--help`, so a new command that takes
--model must be listed here with the shared flags it takes, and a shared flag defined by a command itself fails.
"""
from __future__ import annotations

import click
import pytest

from kvcli.cli import cli
from kvcli.commands.options import SharedOption, model_option, request_options

PENALTIES = {"--repeat-penalty", "--repeat-last-n", "--presence-penalty", "--frequency-penalty", "--dry-multiplier",
             "--dry-base", "--dry-allowed-length", "--dry-penalty-last-n"}
SAMPLING = {"--max-tokens", "--temperature", "--seed", "--top-k", "--top-p", "--min-p", *PENALTIES}
CHUNKING = {"--chunk", "--max-cache", "--chunk-scoring"}
# one document, one policy: run, chat, compress, batch
SINGLE = {"--model", "--threads", "--cache-type", "--policy", "--budget", "--policy-arg", *CHUNKING}
# sweeps over policies and budgets: bench, eval
SWEEP = {"--model", "--threads", "--policies", "--budgets", "--policy-arg"}

# the shared flags each command that loads a model takes (sampling only where it decodes an answer)
EXPECTED = {
    "run": SINGLE | SAMPLING,
    "chat": SINGLE | SAMPLING,
    "batch": SINGLE | SAMPLING,
    # no chunking: prompts held whole
    "serve": {"--model", "--threads", "--cache-type", "--policy", "--budget", "--policy-arg"} | SAMPLING,
    "compress": SINGLE,                                    # compresses and saves; decodes nothing
    "bench": SWEEP | {"--chunk", "--chunk-scoring"},       # decodes teacher-forced: no sampling
    "eval niah": SWEEP | {"--cache-type", "--chunk", "--chunk-scoring"} | PENALTIES,   # greedy (+ penalties)
    "eval ruler": SWEEP | {"--cache-type", "--chunk", "--chunk-scoring"} | PENALTIES,
    "eval fidelity": SWEEP | {"--cache-type"},             # teacher-forced agreement, one prefill
    "eval chat": SWEEP | {"--cache-type"},                 # greedy answers, scored
    "eval corpus ask": SWEEP | {"--cache-type"},           # greedy answers, scored
    "check": {"--model", "--threads", "--cache-type", "--chunk", "--chunk-scoring"},   # greedy in both engines
    "calibrate compresskv": {"--model", "--threads"},      # the reference engine (torch threads)
}
# commands that take a model but do not run it
NOT_RUN = {"info": "reads the GGUF header and the native library's identity; runs nothing",
           "calibrate show": "reads the model's calibration side-car; runs nothing",
           "eval corpus build": "tokenizes the corpus's documents to count them; runs nothing"}

# flags with a shared name that a command defines itself, and why
OWN = {
    ("bench", "--cache-type"): "a comma list: bench crosses every cache type with every policy",
    ("check", "--policy"): "several policies (default: every one), checked one by one at one budget",
    ("check", "--budget"): "the one budget of every checked policy (default 256)",
    ("calibrate compresskv", "--seed"): "the seed of the generated calibration texts, not a sampler's",
    ("eval niah", "--seed"): "the seed of the generated haystacks and needles, not a sampler's",
    ("eval ruler", "--seed"): "the seed of the generated tasks, not a sampler's",
    ("eval chat", "--seed"): "the seed of the generated logbooks and facts, not a sampler's",
}
# shared flags whose help a command refines through request_options' *_help arguments, and why
HELP_OVERRIDES = {
    ("run", "--cache-type"): "the reference engine has no cache type",
    ("chat", "--cache-type"): "a --cache file brings its own",
    ("batch", "--max-tokens"): "reserved in the cache for every held document",
    ("serve", "--max-tokens"): "the default of a request that gives no max_tokens",
    ("bench", "--chunk"): "every document, and it implies --no-share-prefill",
    ("eval niah", "--chunk"): "every prompt, and the truncation baseline",
    ("eval ruler", "--chunk"): "every prompt, and the truncation baseline",
    ("eval fidelity", "--chunk"): "only prefixes past the context (--max-context) are read in chunks",
    ("eval niah", "--cache-type"): "no help: the choice lists it",
    ("eval fidelity", "--policies"): "it reads POLICY:KEY=VALUE labels (corpus_eval.split_variant)",
    ("eval corpus ask", "--policies"): "it reads POLICY:KEY=VALUE labels (corpus_eval.split_variant)",
    ("eval ruler", "--cache-type"): "no help: the choice lists it",
    ("eval fidelity", "--cache-type"): "no help: the choice lists it",
    ("eval chat", "--cache-type"): "no help: the choice lists it",
    ("eval corpus ask", "--cache-type"): "no help: the choice lists it",
    ("check", "--cache-type"): "the native engine's; f32 for the tightest agreement",
    ("check", "--chunk"): "both engines, L1 at every planning step",
    ("check", "--threads"): "both engines",
    ("calibrate compresskv", "--threads"): "torch's threads: calibration runs the reference engine",
}


def walk(group: click.Group, prefix: str = ""):
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        full = f"{prefix}{name}"
        if isinstance(cmd, click.Group):
            yield from walk(cmd, full + " ")
        else:
            yield full, cmd


COMMANDS = dict(walk(cli))


def longs(param) -> list[str]:
    return [o for o in (*param.opts, *param.secondary_opts) if o.startswith("--")]


def flags(cmd) -> dict[str, click.Parameter]:
    return {o: p for p in cmd.params if isinstance(p, click.Option) for o in longs(p)}


def takes_model(cmd) -> bool:
    return "--model" in flags(cmd) or any(isinstance(p, click.Argument) and p.name == "model" for p in cmd.params)


@click.command()
@model_option
@request_options("policy", "sampling", "cache_type", "chunking", "threads")
def _single(req, model):
    pass


@click.command()
@request_options("policies", "penalties", "chunk")
def _sweep(req):
    pass


def canonical_help() -> dict[str, set]:
    out: dict[str, set] = {}
    for cmd in (_single, _sweep):
        for flag, p in flags(cmd).items():
            out.setdefault(flag, set()).add(p.help)
    return out


SHARED_NAMES = set(canonical_help())


def test_every_command_that_takes_a_model_is_listed():
    loading = {name for name, cmd in COMMANDS.items() if takes_model(cmd)}
    assert loading == set(EXPECTED) | set(NOT_RUN), "a command that loads a model: list its shared flags in EXPECTED"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_model_commands_take_the_shared_flags_from_the_options_module(name, cli_runner):
    cmd = COMMANDS[name]
    r = cli_runner.invoke(cli, [*name.split(), "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    have = flags(cmd)
    for flag in sorted(EXPECTED[name]):
        assert flag in have and flag in r.output, f"kvcli {name} lacks {flag}"
    canon = canonical_help()
    for flag, p in have.items():
        if flag not in SHARED_NAMES or flag == "--json":
            continue
        if (name, flag) in OWN:
            assert not isinstance(p, SharedOption), f"kvcli {name} {flag} is shared now: drop it from OWN"
            continue
        assert isinstance(p, SharedOption), \
            f"kvcli {name} defines {flag} itself: take it from kvcli/commands/options.py (request_options)"
        if (name, flag) in HELP_OVERRIDES:
            assert p.help not in canon[flag], f"kvcli {name} {flag}: the override is gone, drop it from the list"
        else:
            assert p.help in canon[flag], f"kvcli {name} {flag}: help differs from kvcli/commands/options.py's"


def test_shared_flags_have_one_type_everywhere():
    """A shared flag parses the same way in every command (a --cache-type's choices may be narrower)."""
    canon = {f: p for cmd in (_single, _sweep) for f, p in flags(cmd).items()}
    for name in EXPECTED:
        for flag, p in flags(COMMANDS[name]).items():
            if isinstance(p, SharedOption) and flag in canon and flag != "--cache-type":
                assert repr(p.type) == repr(canon[flag].type), (name, flag)
                assert p.multiple == canon[flag].multiple, (name, flag)


@pytest.mark.parametrize("name", ["chat", "compress", "run", "batch", "check", "calibrate compresskv"])
def test_threads_is_accepted(name, cli_runner):
    """`--threads 1` parses on every command with a model (it used to be refused by chat and compress)."""
    r = cli_runner.invoke(cli, [*name.split(), "--threads", "1", "--help"])
    assert r.exit_code == 0, r.output


def test_threads_reach_the_session(cli_runner, monkeypatch, tmp_path):
    """--threads gets to the llama.cpp context: chat and compress (--doc) and chat and run (--cache)."""
    import kvcli.commands.chat as chat_mod  # noqa: PLC0415
    import kvcli.commands.run as run_mod  # noqa: PLC0415
    from kvcli.errors import KvcliError  # noqa: PLC0415

    def seen(*a, n_threads=None, **kw):
        raise KvcliError(f"n_threads={n_threads}")

    monkeypatch.setattr(chat_mod, "open_native", seen)
    monkeypatch.setattr(chat_mod.Conversation, "from_kvc", seen)
    monkeypatch.setattr(run_mod.Conversation, "from_kvc", seen)
    doc = tmp_path / "d.txt"
    doc.write_text("A short document.")
    cache = tmp_path / "c.kvc"
    cache.write_bytes(b"")
    for args in (["chat", "--doc", doc], ["compress", "--doc", doc, "-o", tmp_path / "o.kvc"],
                 ["chat", "--cache", cache], ["run", "--cache", cache, "Why?"]):
        r = cli_runner.invoke(cli, [*map(str, args), "--threads", "3"], input="")
        assert r.exit_code == 2 and "n_threads=3" in r.output, (args, r.output)
