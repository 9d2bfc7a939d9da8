"""--policy-arg's two forms (issue #48), one parser (kvcli.policies.parse_policy_args / parse_scoped_args) for every
command: `KEY=VALUE` and `POLICY.KEY=VALUE` where POLICY is the policy in use (run, chat, compress, batch; refused in
one line naming both policies otherwise), `POLICY.KEY=VALUE` only where several policies run (bench, eval)."""
from __future__ import annotations

import json

import pytest

from kvcli.cli import cli
from kvcli.errors import KvcliError
from kvcli.policies import get, parse_policy_args, parse_scoped_args

SNAP = ["--policy", "snapkv", "--budget", "64"]


@pytest.fixture()
def doc(word_doc):
    return word_doc(300, 3)


def test_parser_forms():
    assert parse_policy_args(["window=8", "snapkv.kernel=5", " Snapkv.pool = avg "], "snapkv") == \
        {"window": "8", "kernel": "5", "pool": "avg"}
    assert parse_policy_args(["ratio=0.5"], "x") == {"ratio": "0.5"}   # a dot in the value is a value's
    with pytest.raises(KvcliError, match="parameter of policy 'kvzip', but the policy in use is 'snapkv'"):
        parse_policy_args(["kvzip.alloc=global"], "snapkv")
    with pytest.raises(KvcliError, match="window given twice"):
        parse_policy_args(["window=8", "snapkv.window=9"], "snapkv")
    for bad in (".window=8", "snapkv.=8", "window"):
        with pytest.raises(KvcliError, match="key=value or policy.key=value"):
            parse_policy_args([bad], "snapkv")
    assert parse_scoped_args(["snapkv.window=8", "KVZIP.alloc=global"]) == \
        {"snapkv": {"window": "8"}, "kvzip": {"alloc": "global"}}
    with pytest.raises(KvcliError, match="POLICY.KEY=VALUE"):
        parse_scoped_args(["window=8"])
    # the registry's own validation reads both forms (a list of items, as /policy in a chat gives)
    assert get("kvzip").validate(["kvzip.alloc=global"])["alloc"] == "global"


def _invoke(cli_runner, command, tiny_2k, doc, tmp_path, *args):
    d = str(doc)
    extra = {"run": ["--doc", d, "-n", "2", "What?"],
             "chat": ["--doc", d, "-n", "2", "--quiet"],
             "compress": ["--doc", d, "-o", str(tmp_path / "c.kvc"), "--force", "--quiet"],
             "batch": ["--docs", d, "-n", "2", "--instruction", "What?", "--out", str(tmp_path / "b.jsonl"), "-q"],
             }[command]
    return cli_runner.invoke(cli, [command, "--model", str(tiny_2k), *SNAP, *args, *extra], input="Why?\n")


@pytest.mark.parametrize("command", ["run", "chat", "compress", "batch"])
def test_single_policy_commands_take_both_forms(cli_runner, tiny_2k, doc, tmp_path, command):
    r = _invoke(cli_runner, command, tiny_2k, doc, tmp_path, "--policy-arg", "snapkv.window=8")
    assert r.exit_code == 0, r.output
    # the scoped key reaches the policy: a window the budget cannot hold is refused by name
    r = _invoke(cli_runner, command, tiny_2k, doc, tmp_path, "--policy-arg", "snapkv.window=64")
    assert r.exit_code == 2 and "budget 64 must be larger than window=64" in r.output, r.output
    r = _invoke(cli_runner, command, tiny_2k, doc, tmp_path, "--policy-arg", "kvzip.alloc=global")
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == ["kvcli: error: --policy-arg kvzip.alloc is a parameter of policy "
                                             "'kvzip', but the policy in use is 'snapkv'"]


def test_documented_example_runs(cli_runner, tiny_2k, doc):
    """README / docs/results.md: `--policy-arg expected_attention.window=32` on run."""
    r = cli_runner.invoke(cli, ["run", "--model", str(tiny_2k), "--doc", str(doc), "--policy",
                                "expected_attention", "--budget", "64", "--policy-arg", "expected_attention.window=32",
                                "-n", "2", "--json", "What?"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout.strip().splitlines()[-1])["policy"] == "expected_attention"


def test_bench_and_eval_keep_the_scoped_form(cli_runner, tiny_2k, doc):
    common = ["--model", str(tiny_2k), "--policies", "snapkv", "--budgets", "64"]
    r = cli_runner.invoke(cli, ["bench", "--docs", str(doc), *common, "--policy-arg", "snapkv.window=8",
                                "--gen", "2", "--repeat", "1", "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    assert {row["status"] for row in json.loads(r.stdout)["rows"]} == {"ok"}
    r = cli_runner.invoke(cli, ["eval", "chat", *common, "--lengths", "1k", "--documents", "1", "--facts", "2",
                                "--modes", "once", "--policy-arg", "snapkv.window=8", "--json", "-q"])
    assert r.exit_code == 0, r.output
    for command in (["bench", "--docs", str(doc)], ["eval", "chat"]):
        r = cli_runner.invoke(cli, [*command, *common, "--policy-arg", "window=8"])
        assert r.exit_code == 2 and "POLICY.KEY=VALUE" in r.output, r.output
