"""Document + instruction -> (compressed) cache -> streamed answer, with stats from the cache.

The CLI commands are thin layers over `run_document`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from kvcli.errors import KvcliError
from kvcli.generate import Generation, Sampler, generate

CTX_PAD = 256


@dataclass
class RunResult:
    answer: str
    model: str
    policy: str
    budget: int | None
    stats: dict = field(default_factory=dict)
    stopped: str = "eog"

    def as_json(self) -> dict:
        return {"answer": self.answer, "model": self.model, "policy": self.policy, "budget": self.budget,
                "stopped": self.stopped, "stats": self.stats}


def user_message(document: str | None, instruction: str) -> str:
    return f"{document.strip()}\n\n{instruction.strip()}" if document else instruction.strip()


def build_prompt(session, document: str | None, instruction: str, system: str | None = None) -> str:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user_message(document, instruction)})
    return session.apply_chat_template(messages, add_assistant=True)


def context_size(n_prompt: int, max_tokens: int, n_ctx_train: int, compressed_to: int | None = None) -> int:
    """Cells to allocate: the prompt (it is prefilled in full before compression) plus the answer."""
    need = n_prompt + max_tokens
    padded = -(-need // CTX_PAD) * CTX_PAD
    return min(padded, n_ctx_train)


def check_fits(n_prompt: int, n_ctx_train: int) -> None:
    if n_prompt >= n_ctx_train:
        raise KvcliError(
            f"the prompt is {n_prompt} tokens but the model's context is {n_ctx_train} tokens: shorten the "
            "document, split it, or use a model with a longer context")


def progress_bar(total: int, enabled: bool, desc: str = "prefill"):
    """A tqdm bar on stderr (only on a terminal, unless forced); returns an update callable + closer."""
    if not enabled or total <= 0:
        return None, lambda: None
    from tqdm import tqdm  # noqa: PLC0415
    bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False, dynamic_ncols=True)
    return bar.update, bar.close


def run_document(session, document: str | None, instruction: str, *, policy: str = "full", budget: int | None = None,
                 policy_args: dict | None = None, max_tokens: int = 256, sampler: Sampler | None = None,
                 system: str | None = None, on_text=None, show_progress: bool = False) -> RunResult:
    """Prefill the templated prompt, compress it with `policy`, and generate the answer."""
    from kvcli import compress  # noqa: PLC0415

    prompt = build_prompt(session, document, instruction, system)
    tokens = session.tokenize(prompt)
    check_fits(len(tokens), session.n_ctx_train)
    if session.ctx is None:
        session.create_context(context_size(len(tokens), max_tokens, session.n_ctx_train))
    update, close = progress_bar(len(tokens), show_progress and len(tokens) > session.n_batch)
    try:
        report = compress.prefill_and_compress(session, tokens, policy, budget, policy_args or {}, seq=0,
                                               progress=update, instruction=instruction)
    finally:
        close()
    gen: Generation = generate(session, max_tokens, sampler, seq=0, on_text=on_text)
    stats = {"prompt_tokens": len(tokens), "generated_tokens": len(gen.tokens)}
    stats.update(session.stats(0))
    stats.update({"prefill_s": round(report.prefill_s, 4), "compress_s": round(report.compress_s, 4),
                  "decode_s": round(gen.decode_s, 4),
                  "decode_tok_s": round(gen.decode_tok_s, 2) if gen.decode_tok_s else None})
    if report.note:
        stats["note"] = report.note
    if report.params and "task" in report.params:
        stats["task"] = report.params["task"]  # what windowkv's task=auto picked
    return RunResult(answer=gen.text, model=str(session.model_path), policy=policy, budget=budget, stats=stats,
                     stopped=gen.stopped)


def timed(fn, *a, **kw):
    t0 = time.perf_counter()
    r = fn(*a, **kw)
    return r, time.perf_counter() - t0
