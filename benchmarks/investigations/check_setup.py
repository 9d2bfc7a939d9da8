"""The setup benchmarks/investigations/check_same_plan.py and check_layer_swap.py share: their optional DOC [DOC_TOKENS]
arguments (after two of their own), the prompt's tokens as kvcli check builds them, and a native
session whose context holds them."""
from pathlib import Path

from kvcli.drivers.check import CheckSettings, build_tokens
from kvcli.native.session import NativeSession

DEFAULT_DOC, DEFAULT_TOKENS = "examples/station-log.txt", 2000


def native_prompt(argv: list[str], model_path, budget: int):
    """(native session with a context for the prompt, tokens, result-file tag) from argv[3:] = [DOC [DOC_TOKENS]];
    DOC_TOKENS 0 takes the whole document; the tag is empty for the defaults."""
    doc_path = argv[3] if len(argv) > 3 else DEFAULT_DOC
    doc_tokens = int(argv[4]) if len(argv) > 4 else DEFAULT_TOKENS
    settings = CheckSettings(budget=budget, doc_tokens=doc_tokens or None)
    tag = "" if (doc_path, doc_tokens) == (DEFAULT_DOC, DEFAULT_TOKENS) else f"-{Path(doc_path).stem}-{doc_tokens}"
    nat = NativeSession(model_path, n_ctx=0, cache_type="f16", flash_attn=True)
    toks = build_tokens(nat, Path(doc_path).read_text(), settings)
    nat.create_context(-(-(len(toks) + 24) // 256) * 256)
    return nat, toks, tag
