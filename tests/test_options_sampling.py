"""The shared options (kvcli/commands/options.py), one-line usage errors, and llama.cpp's sampler chain
(kvcli/generate.py) on a tiny model."""
from __future__ import annotations

import math

import numpy as np
import pytest


@pytest.mark.parametrize("args, line", [
    (["run", "--budget", "abc", "x"], "kvcli: error: --budget: 'abc' is not an integer"),
    (["run", "--budget", "2.5", "x"], "kvcli: error: --budget: '2.5' is not an integer"),
    (["run", "--chunk", "-1", "x"], "kvcli: error: --chunk: -1 is not in the range x>=0"),
    (["run", "--cache", "/tmp", "x"],
     "kvcli: error: /tmp is a directory, neither a .kvc file nor a store folder (no store.json)"),
    (["run", "--temperature", "nan", "x"], "kvcli: error: --temperature: nan is not a finite number"),
    (["run", "--seed", "-1", "x"], "kvcli: error: --seed: -1 is out of range [0, 4294967294]"),
    (["chat", "--top-p", "1.5", "--doc", "README.md"], "kvcli: error: --top-p: 1.5 is out of range [0.0, 1.0]"),
    (["run", "--bogus", "x"], "kvcli: error: No such option '--bogus'. Did you mean '--out'?"),
    (["run"], "kvcli: error: no question: give INSTRUCTION, --question TEXT or --questions FILE"),
    (["compress", "-o", "x.kvc", "--policy", "snapkv", "-b", "64", "--policy-arg", "window=8",
      "--policy-arg", "window=16"], "kvcli: error: --policy-arg window given twice"),
    (["run", "--policy", "snapkv", "-b", "64", "--policy-arg", "window=8", "--policy-arg", "window=16", "x"],
     "kvcli: error: --policy-arg window given twice"),
    (["bench", "--docs", "README.md", "--policy-arg", "snapkv.window=8", "--policy-arg", "snapkv.window=9"],
     "kvcli: error: --policy-arg snapkv.window given twice"),
    (["eval", "niah", "--budgets", "x"], None),
])
def test_bad_flags_are_one_line_and_exit_2(run_kvcli, args, line):
    r = run_kvcli(*args, input="")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("kvcli: error: "), r.stderr
    if line:
        assert r.stderr.strip() == line


def test_help_is_click_help(cli_runner):
    from kvcli.cli import cli
    r = cli_runner.invoke(cli, ["run", "--help"])
    assert r.exit_code == 0 and r.output.startswith("Usage: cli run [OPTIONS] [INSTRUCTION]")
    for flag in ("--repeat-penalty", "--dry-multiplier", "--policy-arg", "--max-cache", "--chunk-scoring"):
        assert flag in r.output
    assert "[default: 0.8]" in r.output   # the DRY default is shown


def test_same_flags_everywhere(cli_runner):
    """run, chat and compress take the same policy, chunking and cache-type flags; run and chat the same sampling."""
    from kvcli.cli import cli
    def flags(cmd):
        return {o for p in cli.commands[cmd].params for o in p.opts if o.startswith("--")}
    shared = {"--policy", "--budget", "--policy-arg", "--chunk", "--max-cache", "--chunk-scoring", "--cache-type"}
    sampling = {"--max-tokens", "--temperature", "--seed", "--top-k", "--top-p", "--min-p", "--repeat-penalty",
                "--repeat-last-n", "--presence-penalty", "--frequency-penalty", "--dry-multiplier", "--dry-base",
                "--dry-allowed-length", "--dry-penalty-last-n"}
    for cmd in ("run", "chat", "compress"):
        assert shared <= flags(cmd), cmd
    assert sampling <= flags("run") and sampling <= flags("chat")


def test_sampling_validate():
    from kvcli.errors import KvcliError
    from kvcli.generate import Sampling
    Sampling().validate()
    for bad in (dict(temperature=math.nan), dict(temperature=-1.0), dict(seed=-1), dict(top_p=2.0),
                dict(repeat_penalty=0.0), dict(dry_base=0.5), dict(presence_penalty=math.inf)):
        with pytest.raises(KvcliError):
            Sampling(**bad).validate()


class _Vocab:
    """Enough of a session for the sampler: n_vocab and the model (for the DRY sampler's vocabulary)."""

    def __init__(self, model_path):
        self.model_path, self.vocab = model_path, None
        from kvcli.models import read_model_info
        self.n_vocab = read_model_info(model_path).n_vocab


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return _Vocab(write_tiny_llama(tmp_path_factory.mktemp("s") / "tiny.gguf", n_layer=1))


def _picks(sampling, session, logits_seq):
    from kvcli.generate import TokenPicker
    pick = TokenPicker(sampling, session, len(logits_seq))
    try:
        return [pick(z) for z in logits_seq]
    finally:
        pick.close()


def test_greedy_is_argmax_with_or_without_the_chain(tiny):
    """Plain greedy is numpy's argmax; llama.cpp's chain with penalties that change nothing picks the same
    (ties go to the lower id in both)."""
    from kvcli.generate import Sampling
    rng = np.random.default_rng(0)
    zs = [rng.standard_normal(tiny.n_vocab).astype(np.float32) for _ in range(20)]
    zs[3][[5, 9]] = 100.0   # a tie
    want = [int(np.argmax(z)) for z in zs]
    assert _picks(Sampling.greedy(), tiny, zs) == want
    neutral = Sampling(repeat_penalty=1.0, dry_multiplier=0.0, presence_penalty=1e-30)
    assert _picks(neutral, tiny, zs) == want


def test_penalties_move_off_a_repeated_token(tiny):
    from kvcli.generate import Sampling
    z = np.zeros(tiny.n_vocab, dtype=np.float32)
    z[7], z[8] = 5.0, 4.0
    assert _picks(Sampling.greedy(), tiny, [z, z]) == [7, 7]
    assert _picks(Sampling(repeat_penalty=2.0, dry_multiplier=0.0), tiny, [z, z]) == [7, 8]


def test_dry_breaks_a_loop(tiny):
    """A model that wants to say 10 11 12 10 11 12 ... : DRY stops extending the repeat."""
    from kvcli.generate import Sampling
    cycle = [10, 11, 12]
    zs = []
    for i in range(12):
        z = np.zeros(tiny.n_vocab, dtype=np.float32)
        z[cycle[i % 3]] = 3.0
        z[20 + i] = 2.0
        zs.append(z)
    assert _picks(Sampling.greedy(), tiny, zs) == [cycle[i % 3] for i in range(12)]
    got = _picks(Sampling(), tiny, zs)
    assert got != [cycle[i % 3] for i in range(12)] and got[:4] == [10, 11, 12, 10]


def test_seeded_sampling_is_reproducible(tiny):
    from kvcli.generate import Sampling
    rng = np.random.default_rng(1)
    zs = [rng.standard_normal(tiny.n_vocab).astype(np.float32) for _ in range(30)]
    s = Sampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3, dry_multiplier=0.0)
    a, b = _picks(s, tiny, zs), _picks(s, tiny, zs)
    assert a == b and a != [int(np.argmax(z)) for z in zs]
    from dataclasses import replace
    assert _picks(replace(s, seed=4), tiny, zs) != a


def test_options_outside_the_groups_stay_with_the_command(cli_runner, tmp_path):
    """check has its own --budget and --cache-type beside the shared chunk/threads groups."""
    from kvcli.cli import cli
    from kvcli.testing.tiny_gguf import write_tiny_llama
    m = write_tiny_llama(tmp_path / "m.gguf", n_layer=1)
    r = cli_runner.invoke(cli, ["check", "--model", str(m), "--threshold", "bogus=1"])
    assert r.exit_code == 2 and "unknown threshold" in r.output


def test_run_out_into_a_missing_folder_is_refused_first(run_kvcli, tmp_path):
    """Found by the fuzz harness (seed 1): --out into a missing folder was an internal error after generating."""
    (tmp_path / "adir").mkdir()
    for out in (tmp_path / "adir" / "x" / "y", tmp_path / "adir"):
        r = run_kvcli("run", "Hi", "--out", out, input="Ferries leave at nine.")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("kvcli: error: --out:"), \
            r.stderr
