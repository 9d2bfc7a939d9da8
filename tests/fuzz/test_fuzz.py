"""CI mode of the command-line fuzz harness (kvcli/testing/fuzz.py): a few dozen random cases on a tiny model,
fixed seed; every case must end ok or with a clean one-line error (no internal error, crash or hang)."""
from kvcli.testing import fuzz


def test_classify():
    assert fuzz.classify(0, "") == "ok"
    assert fuzz.classify(2, "kvcli: error: --budget: 'x' is not an integer\n") == "clean error"
    assert fuzz.classify(2, "Usage: kvcli run\nTry 'kvcli run --help'\nError: bad\n") == "internal"
    assert fuzz.classify(1, "kvcli: internal error: ValueError: x\n") == "internal"
    assert fuzz.classify(0, "Traceback (most recent call last):\n  ...\n") == "internal"
    assert fuzz.classify(-11, "") == "crash"
    assert fuzz.classify(None, "") == "hang"


def test_cases_are_fixed_by_the_seed(tmp_path):
    fx = fuzz.Fixtures(tmp_path, tmp_path / "m.gguf", {k: tmp_path / k for k in (
        "doc", "long", "empty", "spaces", "unicode", "binary", "latin1", "adir", "missing", "good_kvc", "cut_kvc",
        "junk_kvc", "empty_kvc", "bad_model", "text_model")})
    a = [c.argv for c in fuzz.make_cases(7, 50, fx)]
    assert a == [c.argv for c in fuzz.make_cases(7, 50, fx)]
    assert a != [c.argv for c in fuzz.make_cases(8, 50, fx)]
    assert {c[0] for c in a} >= {"run", "chat", "compress"}


def test_fuzz_ci(tmp_path):
    report = fuzz.run(seed=0, n=30, workdir=tmp_path, timeout=240)
    assert report["counts"]["ok"] > 0 and report["counts"]["clean error"] > 0
    assert not report["failures"], fuzz.format_report(report)
