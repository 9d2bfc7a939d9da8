"""The station-logbook generator: long documents with facts planted at known depths.

Used by `kvcli eval niah`, the calibration probes, the benchmark documents and
examples/make_docs.py. The text comes from templates written for kvcli (no text from elsewhere);
with a seed the output is reproducible. Each planted fact is a sentence "The <object> of <place>
is <value>." at a chosen depth (fraction of the document). About 1.3 SmolLM2 tokens per word.
"""
from __future__ import annotations

import random

NAMES = ["Amara", "Bogdan", "Chen", "Dalia", "Emeka", "Freya", "Gustavo", "Hana", "Ilya", "Jonas", "Keiko", "Luis",
         "Maren", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Sven", "Tamar", "Umar", "Vera", "Wen", "Yusuf"]
PLACES = ["the north ridge", "the east hut", "the lower lake", "the radio mast", "the glacier tongue",
          "the supply depot", "the weather field", "the old quarry", "the boathouse", "the greenhouse"]
WEATHER = ["clear and still", "overcast with light snow", "windy from the west", "foggy until noon",
           "bright but bitterly cold", "wet, with sleet in the afternoon", "calm after a stormy night"]
TASKS = ["checked the anemometer", "repaired the fence", "logged the snow depth", "serviced the generator",
         "counted the bird colony", "recalibrated the thermometers", "cleared the path", "sorted the food stores",
         "replaced a cracked window", "tested the backup radio", "measured the ice thickness",
         "collected water samples"]
FEELINGS = ["in good spirits", "tired but cheerful", "quiet and focused", "restless", "pleased with the progress",
            "worried about the forecast"]
OBJECTS = ["access code", "spare key number", "radio frequency", "emergency channel", "locker number",
           "password", "serial number", "meeting hour"]


def paragraph(rng: random.Random, day: int) -> str:
    a, b = rng.sample(NAMES, 2)
    s = [f"Day {day}. The weather was {rng.choice(WEATHER)}.",
         f"{a} {rng.choice(TASKS)} at {rng.choice(PLACES)} while {b} {rng.choice(TASKS)}.",
         f"The temperature at noon was {rng.randint(-31, 4)} degrees and the wind reached {rng.randint(2, 70)} "
         f"kilometres per hour.",
         f"In the evening the team was {rng.choice(FEELINGS)}; {rng.choice(NAMES)} cooked and "
         f"{rng.choice(NAMES)} wrote letters home."]
    if rng.random() < 0.5:
        s.append(f"A note for the next shift: {rng.choice(TASKS)} again before day {day + rng.randint(2, 9)}.")
    return " ".join(s)


def make_document(words: int, facts: int = 0, seed: int = 0, depths: list[float] | None = None):
    rng = random.Random(seed)
    paras, count, day = [], 0, 1
    while count < words:
        p = paragraph(rng, day)
        paras.append(p)
        count += len(p.split())
        day += 1
    planted = []
    depths = depths or ([(i + 0.5) / facts for i in range(facts)] if facts else [])
    used = set()
    for depth in depths:
        while True:
            obj, place = rng.choice(OBJECTS), rng.choice(PLACES)
            if (obj, place) not in used:
                used.add((obj, place))
                break
        value = str(rng.randint(1000, 9999))
        at = min(len(paras), int(round(depth * len(paras))))
        sentence = f"The {obj} of {place} is {value}."
        paras.insert(at, sentence)
        planted.append({"depth": depth, "paragraph": at, "sentence": sentence, "question":
                        f"What is the {obj} of {place}?", "answer": value})
    title = "Logbook of the Halvard Research Station"
    return title + "\n\n" + "\n\n".join(paras) + "\n", planted
