"""Evaluation samples generated locally (no download at run time), sized in tokens of the model used.

- `niah`: needle in a haystack. The haystack is the station logbook of kvcli/evaluation/logbook.py (text
  written for kvcli); the needle is one planted fact "The <object> of <place> is <4 digits>." at a
  chosen depth; the question asks for it.
- RULER-style tasks (Hsieh et al. 2024, "RULER: What's the real context size of your long-context
  language models?"), rewritten from the paper's description: `niah_single` and `niah_multikey`
  (magic numbers in RULER's repeated "noise" haystack, with distractor keys), `vt` (variable tracking:
  one chain of 4 hops), `cwe` (common-word extraction: 10 words repeated 30 times among words
  repeated 3 times). Each prompt ends with RULER's answer prefix after the assistant turn starts.
- Scoring is RULER's string match: `string_match_all` (share of the references found in the
  prediction, case-insensitive) for every task here, in percent.

Every generator takes a target length in tokens and a tokenizer (the session's), and builds a
prompt of that length within a few percent; the length actually reached is reported per sample.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass, field

from kvcli.errors import KvcliError
from kvcli.evaluation import logbook as md
from kvcli.templating import GENERIC_SUFFIX, user_message

TASKS = ("niah", "niah_single", "niah_multikey", "vt", "cwe")
RULER_TASKS = ("niah_single", "niah_multikey", "vt", "cwe")
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# simple, single-token-ish English words for keys and for common-word extraction
WORDS = ("apple river stone cloud garden silver candle forest window bridge anchor violet copper meadow harbor "
         "lantern pepper marble falcon orchard thunder velvet canyon saddle island ribbon walnut pillow shadow "
         "basket castle dragon feather glacier hammer jungle kettle ladder magnet needle oyster parrot quartz "
         "rocket spider tunnel umbrella valley wagon yogurt zebra bucket carpet dolphin engine fountain "
         "giraffe helmet igloo jacket kitten lemon mirror napkin ostrich pencil rabbit saucer tomato violin "
         "whistle acorn barrel cactus donkey eagle funnel goblet hazel insect jigsaw koala lizard mango "
         "nutmeg olive pebble quiver raisin spoon tulip urchin vessel walrus").split()
ADJECTIVES = ("quiet bright ancient bitter brave calm clever dusty eager fancy gentle hollow icy jolly lucky "
              "mighty narrow odd proud rapid shy tidy vivid wild young").split()


@dataclass
class Sample:
    task: str
    length: int                     # target prompt length (tokens)
    prompt: str                     # fully templated prompt, answer prefix included
    answers: list[str]
    max_tokens: int
    depth: float | None = None
    index: int = 0
    n_tokens: int = 0               # measured prompt length
    meta: dict = field(default_factory=dict)
    # the prompt's parts, for the question-agnostic layout (kvcli eval --agnostic: the document compressed
    # before the question is seen): the user turn is `document` + the question, and the assistant's
    # answer starts with `answer_prefix`
    document: str = ""
    question: str = ""
    answer_prefix: str = ""


def string_match_all(pred: str, refs: list[str]) -> float:
    """RULER's string_match_all for one sample: share of references contained in the prediction."""
    p = pred.lower()
    return sum(1.0 for r in refs if r.lower() in p) / len(refs)


# ------------------------------------------------------------------------------ the logbook haystack
def _fit(build, target: int, count_tokens, start: int) -> tuple[str, int, dict]:
    """Find the size parameter `n` of `build(n) -> (prompt, meta)` whose prompt is closest to `target`
    tokens without exceeding it (secant steps on the measured token count)."""
    n, best = max(1, start), None
    for _ in range(8):
        prompt, meta = build(n)
        t = count_tokens(prompt)
        if t <= target and (best is None or t > best[1]):
            best = (prompt, t, meta)
        if abs(t - target) <= max(8, target // 100) and t <= target:
            break
        n = max(1, int(n * target / max(t, 1)) - (1 if t > target else 0))
    # The secant steps can stall just above the target: the generators grow in whole sentences or
    # entries, so small steps of n may not change the text at all. Then shrink n by 3% a step until
    # the prompt fits (only reached when no step fitted, so every prompt found above is unchanged).
    tries = 0
    while best is None and n > 1 and tries < 40:
        n, tries = max(1, int(n * 0.97)), tries + 1
        prompt, meta = build(n)
        t = count_tokens(prompt)
        if t <= target:
            best = (prompt, t, meta)
    if best is None:
        raise KvcliError(f"cannot build a prompt of {target} tokens: even the smallest one is longer")
    return best


def _chat(session, user: str, answer_prefix: str = "") -> str:
    return session.apply_chat_template([{"role": "user", "content": user}], add_assistant=True) + answer_prefix


# ------------------------------------------------------------------------------ the conversation layouts
# (eval chat's modes, and eval niah/ruler --agnostic)
def render(session, document: str, history: list[tuple[str, str]], question: str, agnostic: bool = False) -> str:
    """The conversation's prompt: question-aware, the document and the first question in one user turn (as `run`
    and re-selection lay it out); agnostic, the document and the generic instruction, then every question as its
    own turn (as compress-once chat lays it out)."""
    qs = [q for q, _ in history] + [question]
    if agnostic:
        msgs = [{"role": "user", "content": user_message(document, GENERIC_SUFFIX)}, {"role": "user", "content": qs[0]}]
    else:
        msgs = [{"role": "user", "content": user_message(document, qs[0])}]
    for (_, a), q in zip(history, qs[1:]):
        msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": q}]
    return session.apply_chat_template(msgs, add_assistant=True)


def prefix_text(session, document: str, agnostic: bool) -> str:
    """The prompt every question's prompt starts with: the template's head and the document (agnostic: and the
    generic instruction)."""
    text = render(session, document, [], "KVCLIPROBEQUESTION", agnostic)
    end = document.strip()
    cut = text.index(end) + len(end)
    if agnostic:
        cut = text.index(GENERIC_SUFFIX, cut) + len(GENERIC_SUFFIX)
    return text[:cut]


def niah_sample(session, length: int, depth: float, index: int, seed: int = 0) -> Sample:
    def build(words):
        text, planted = md.make_document(words, seed=seed * 100003 + index * 7919 + int(depth * 1000),
                                         depths=[depth])
        fact = planted[0]
        q = f"{fact['question']} Answer with the number only."
        user = f"{text.strip()}\n\n{q}"
        return _chat(session, user, "The answer is"), (fact, text.strip(), q)

    prompt, n_tok, (fact, doc, q) = _fit(build, length, lambda p: len(session.tokenize(p)), int(length / 1.35))
    return Sample("niah", length, prompt, [fact["answer"]], max_tokens=12, depth=depth, index=index, n_tokens=n_tok,
                  meta={"needle": fact["sentence"]}, document=doc, question=q, answer_prefix="The answer is")


# ------------------------------------------------------------------------------ RULER-style tasks
def _key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(WORDS)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _insert(sentences: list[str], items: list[tuple[float, str]]) -> str:
    out = list(sentences)
    for depth, s in sorted(items, key=lambda x: -x[0]):
        out.insert(int(round(depth * len(out))), s)
    return " ".join(out)


def ruler_sample(session, task: str, length: int, depth: float | None, index: int, seed: int = 0) -> Sample:
    rng0 = random.Random(f"{seed}:{task}:{length}:{index}:{depth}")
    count = lambda p: len(session.tokenize(p))  # noqa: E731
    state = rng0.getstate()
    if task in ("niah_single", "niah_multikey"):
        n_keys = 1 if task == "niah_single" else 4
        keys, vals = [], []
        while len(keys) < n_keys:
            k = _key(rng0)
            if k not in keys:
                keys.append(k)
                vals.append(_number(rng0))
        d = rng0.random() if depth is None else depth
        others = [rng0.random() for _ in range(n_keys - 1)]

        def build(n):
            hay = [NOISE] * n
            needles = [(d, f"One of the special magic numbers for {keys[0]} is: {vals[0]}.")]
            needles += [(o, f"One of the special magic numbers for {k} is: {v}.")
                        for o, k, v in zip(others, keys[1:], vals[1:])]
            doc = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                   "I will quiz you about the numbers afterwards.\n" + _insert(hay, needles))
            return _chat(session, f"{doc}\n{question}", prefix), doc
        question = f"What is the special magic number for {keys[0]} mentioned in the provided text?"
        prefix = f"The special magic number for {keys[0]} mentioned in the provided text is"
        prompt, n_tok, doc = _fit(build, length, count, length // 25)
        return Sample(task, length, prompt, [vals[0]], max_tokens=16, depth=d, index=index, n_tokens=n_tok,
                      meta={"key": keys[0], "distractors": n_keys - 1}, document=doc, question=question,
                      answer_prefix=prefix)
    if task == "vt":
        value = str(rng0.randint(10000, 99999))
        names = []
        while len(names) < 5:  # one chain: VAR A = value, then 4 hops
            v = "".join(rng0.choice(string.ascii_uppercase) for _ in range(5))
            if v not in names:
                names.append(v)
        lines = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
        spots = sorted(rng0.random() for _ in lines)

        def build(n):
            hay = [NOISE] * n
            doc = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n" +
                   _insert(hay, list(zip(spots, lines))))
            return _chat(session, f"{doc}\n{question}", prefix), doc
        question = f"Question: Find all variables that are assigned the value {value} in the text above."
        prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, "
                  f"5 variables are assigned the value {value}, they are:")
        prompt, n_tok, doc = _fit(build, length, count, length // 25)
        return Sample(task, length, prompt, names, max_tokens=30, depth=None, index=index, n_tokens=n_tok,
                      document=doc, question=question, answer_prefix=prefix)
    if task == "cwe":
        rng0.setstate(state)
        pool = list(WORDS)
        rng0.shuffle(pool)
        common, rare = pool[:10], pool[10:]

        # RULER repeats the 10 common words 30 times; short prompts cannot hold that many, so fewer
        freq = max(4, min(30, length // 130))

        def build(n_rare):
            rng = random.Random(f"{seed}:cwe:{length}:{index}")
            words = [w for w in common for _ in range(freq)]
            words += [rare[i % len(rare)] + ("" if i < len(rare) else str(i // len(rare)))
                      for i in range(n_rare) for _ in range(3)]
            rng.shuffle(words)
            listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
            doc = ("Below is a numbered list of words. In these words, some appear more often than others. "
                   f"Memorize the ones that appear most often.\n{listing}")
            return _chat(session, f"{doc}\n{question}", prefix), doc
        question = "Question: What are the 10 most common words in the above list?"
        prefix = "Answer: The top 10 words that appear most often in the list are:"
        prompt, n_tok, doc = _fit(build, length, count, max(1, (length - 40 * freq) // 12))
        return Sample(task, length, prompt, common, max_tokens=60, depth=None, index=index, n_tokens=n_tok,
                      meta={"common_freq": freq, "rare_freq": 3}, document=doc, question=question,
                      answer_prefix=prefix)
    raise KvcliError(f"unknown task '{task}': choose from {', '.join(TASKS)}")
