"""Calibration texts generated locally: haystacks, needles (with their question and answer span) and prompts.

Everything here is written for kvcli from templates (no third-party text), reproducible from a
seed. The genre (a botanist's travel journal) is deliberately different from the station logbook
of kvcli/evaluation/logbook.py, which the retrieval evaluation uses: calibrating on the evaluation's own
texts would flatter CompressKV (the paper calibrates on LongBench itself; we do not).

A needle is one sentence holding a short multi-word answer, like the paper's "The best thing to do
in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

TOWNS = ["Marrowby", "Quillhaven", "Ostrava Vale", "Penfold Cove", "Larkmoor", "Tessaly", "Brackwater",
         "Fenwick Hollow", "Aldermere", "Saltmarsh End", "Ivydale", "Corrin Bay"]
NAMES = ["Ottilie", "Barnaby", "Sefa", "Ingrid", "Tobiah", "Marisol", "Kwame", "Liesel", "Ansel", "Noor",
         "Evander", "Perpetua"]
PLANTS = ["wild thyme", "sea holly", "marsh marigold", "bog myrtle", "creeping willow", "moonwort", "sundew",
          "water mint", "yellow rattle", "harebell", "sweet cicely", "cloudberry", "lady fern", "butterwort"]
TERRAIN = ["a shingle beach", "a peat bog", "the edge of a birch wood", "a limestone pavement", "a river meadow",
           "a sheltered gully", "the dunes", "an abandoned orchard", "a heather slope", "the old drove road"]
WEATHER = ["a thin drizzle", "low cloud", "bright sun", "a gusty south wind", "a light frost", "warm haze",
           "steady rain", "sea fog"]
ACTS = ["pressed two specimens", "sketched the leaves", "measured the stems", "noted the soil colour",
        "counted the flower heads", "labelled the seed packets", "photographed the roots",
        "recorded the altitude", "wrote up the morning notes", "dried the samples by the stove"]
MOODS = ["content", "weary", "hopeful", "distracted", "cheerful", "anxious about the ferry"]

# (needle template, question template, answer template); answers are several words, so copying
# them takes several decoding steps (the score sums attention over those steps).
ACTIVITIES = ["eat warm oatcakes and watch the herring boats come in", "climb the bell tower at dawn and count "
              "the gulls", "swim in the green pool below the waterfall", "buy smoked cheese at the Friday market",
              "walk the cliff path to the ruined chapel", "listen to the fiddlers in the ferry inn",
              "row across the lake to the heron island", "drink cider in the walled garden at sunset"]
DESSERTS = ["baked apples with cinnamon cream", "a rhubarb tart with ginger custard", "honey cake with toasted "
            "almonds", "plum dumplings with brown butter", "a lemon pudding with blackberries"]
WORDS = ["velvet", "harbour", "copper", "lantern", "thistle", "marble", "juniper", "falcon", "saffron", "pebble"]
DOGS = ["Captain Biscuit", "Professor Mudge", "Little Admiral Pip", "Sir Wobbleton", "Duchess Marmalade"]
NEEDLES = [
    ("The best thing to do in {town} is {a}.", "What is the best thing to do in {town}?", "{a}", ("town", "a")),
    ("{name}'s favourite dessert is {d}.", "What is {name}'s favourite dessert?", "{d}", ("name", "d")),
    ("The secret password of the {town} rowing club is {w1} {w2} {w3}.",
     "What is the secret password of the {town} rowing club?", "{w1} {w2} {w3}", ("town", "w")),
    ("The lighthouse keeper of {town} named her dog {dog}.", "What did the lighthouse keeper of {town} name her dog?",
     "{dog}", ("town", "dog")),
]


@dataclass
class Needle:
    sentence: str
    question: str
    answer: str


@dataclass
class Probe:
    """One needle-in-a-haystack prompt: the chat-templated text and where the answer sits in it."""

    key: str                 # stable id (length, depth, needle index): resume and reports use it
    length: int              # target haystack length in tokens
    depth: float             # where the needle sits, 0 = start, 1 = end of the haystack
    needle: Needle
    prompt: str              # the full prompt (chat template applied)
    answer_start: int        # character span of the answer inside `prompt`
    answer_end: int


def make_needle(rng: random.Random, kind: int) -> Needle:
    tmpl, q, a, _ = NEEDLES[kind % len(NEEDLES)]
    w = rng.sample(WORDS, 3)
    fill = {"town": rng.choice(TOWNS), "a": rng.choice(ACTIVITIES), "name": rng.choice(NAMES),
            "d": rng.choice(DESSERTS), "w1": w[0], "w2": w[1], "w3": w[2], "dog": rng.choice(DOGS)}
    return Needle(tmpl.format(**fill), q.format(**fill), a.format(**fill))


def haystack_sentences(rng: random.Random, n: int) -> list[str]:
    """`n` journal sentences, grouped into daily entries."""
    out = []
    day = 1
    while len(out) < n:
        a, b = rng.sample(NAMES, 2)
        entry = [f"Day {day} of the journey.",
                 f"We walked to {rng.choice(TERRAIN)} near {rng.choice(TOWNS)} under {rng.choice(WEATHER)}.",
                 f"{a} found {rng.choice(PLANTS)} growing beside {rng.choice(PLANTS)} and {rng.choice(ACTS)}.",
                 f"{b} {rng.choice(ACTS)} while the light held.",
                 f"We covered {rng.randint(3, 24)} miles and camped at {rng.randint(40, 900)} feet.",
                 f"By evening everyone was {rng.choice(MOODS)}."]
        if rng.random() < 0.4:
            entry.append(f"The {rng.choice(PLANTS)} here flowers {rng.randint(2, 6)} weeks later than in the south.")
        out.extend(entry)
        day += 1
    return out[:n]


def user_text(haystack: str, question: str) -> str:
    return (f"Read this travel journal.\n\n{haystack}\n\nAnswer the question using the journal, in a few "
            f"words.\nQuestion: {question}")


def build_probe(tokenizer_len, template, length: int, depth: float, kind: int, seed: int) -> Probe:
    """A probe whose prompt is about `length` tokens long (measured with `tokenizer_len`).

    `template(user_text) -> prompt` applies the model's chat template; `tokenizer_len(text)` counts
    tokens. The needle goes in at a sentence boundary at fraction `depth` of the haystack.
    """
    rng = random.Random(f"{seed}:{length}:{depth:.4f}:{kind}")
    needle = make_needle(rng, kind)
    sentences = haystack_sentences(rng, max(8, length // 8))
    # grow or shrink the haystack until the whole prompt is close to `length` tokens
    overhead = tokenizer_len(template(user_text("", needle.question))) + tokenizer_len(needle.sentence)
    per = max(1.0, tokenizer_len(" ".join(sentences)) / len(sentences))
    want = max(4, int((length - overhead) / per))
    while len(sentences) < want:
        sentences.extend(haystack_sentences(rng, want - len(sentences)))
    sentences = sentences[:want]
    at = min(len(sentences), int(round(depth * len(sentences))))
    text = " ".join(sentences[:at] + [needle.sentence] + sentences[at:])
    prompt = template(user_text(text, needle.question))
    start = prompt.index(needle.sentence) + needle.sentence.index(needle.answer)
    return Probe(key=f"L{length}-d{depth:.3f}-n{kind}", length=length, depth=depth, needle=needle, prompt=prompt,
                 answer_start=start, answer_end=start + len(needle.answer))


def depths(n: int) -> list[float]:
    """`n` needle depths spread over [0, 1] (the paper: 10 depths, linspace(0, 100))."""
    return [0.5] if n == 1 else [i / (n - 1) for i in range(n)]


_WORD = re.compile(r"[a-z0-9]+")


def rouge1_recall(answer: str, response: str) -> float:
    """Fraction of the answer's words (with multiplicity) found in the response: ROUGE-1 recall."""
    want = _WORD.findall(answer.lower())
    got = _WORD.findall(response.lower())
    if not want:
        return 0.0
    pool: dict[str, int] = {}
    for w in got:
        pool[w] = pool.get(w, 0) + 1
    hit = 0
    for w in want:
        if pool.get(w, 0) > 0:
            pool[w] -= 1
            hit += 1
    return hit / len(want)


def error_profile_text(length: int, index: int, seed: int, template, tokenizer_len) -> str:
    """A prompt for the layer error profile: a journal of about `length` tokens and a request whose
    answer needs the whole text (a summary), so the generated tokens attend all over it."""
    rng = random.Random(f"err:{seed}:{length}:{index}")
    asks = ["Summarise the journal above in a few sentences.", "Which plants did the travellers find, and where?",
            "Describe the weather during the journey.", "Who were the travellers and what did they do each day?"]
    ask = asks[index % len(asks)]
    sentences = haystack_sentences(rng, max(8, length // 8))
    per = max(1.0, tokenizer_len(" ".join(sentences)) / len(sentences))
    overhead = tokenizer_len(template(f"Read this travel journal.\n\n\n\n{ask}"))
    want = max(4, int((length - overhead) / per))
    while len(sentences) < want:
        sentences.extend(haystack_sentences(rng, want - len(sentences)))
    return template(f"Read this travel journal.\n\n{' '.join(sentences[:want])}\n\n{ask}")
