"""The small sample sets shipped in `eval/data/`, generated here (ours, not GSM8K's or MMLU's).

Owns the templated arithmetic word problems (answers computed, GSM8K format)
and the hand-written general-knowledge questions (MMLU format). Deterministic:
`python -m kvsplice.eval.workloads.sample_data` rewrites the same bytes.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path

from kvsplice.eval.workloads.math_problems import DATA_DIR, MATH_SAMPLE
from kvsplice.eval.workloads.multiple_choice import MC_SAMPLE

logger = logging.getLogger(__name__)

SOURCE = "kvsplice-generated"
SEED = 20250
NUM_PER_TEMPLATE = 5
NAMES = ("Maya", "Tom", "Priya", "Leo", "Ana", "Sam", "Ines", "Omar", "Lena", "Kofi")

# Each template draws its numbers and returns (question, worked steps, final answer).
WordProblem = tuple[str, list[str], int]


def _packs(rng: random.Random, name: str) -> WordProblem:
    have, packs, per_pack = rng.randint(3, 30), rng.randint(2, 9), rng.randint(4, 12)
    bought = packs * per_pack
    question = (
        f"{name} has {have} stickers. {name} buys {packs} packs with {per_pack} stickers "
        f"in each pack. How many stickers does {name} have now?"
    )
    steps = [f"{packs} * {per_pack} = {bought}", f"{have} + {bought} = {have + bought}"]
    return question, steps, have + bought


def _wages(rng: random.Random, name: str) -> WordProblem:
    rate, hours, days = rng.randint(9, 25), rng.randint(3, 8), rng.randint(2, 6)
    question = (
        f"{name} earns ${rate} per hour and works {hours} hours a day for {days} days. "
        f"How many dollars does {name} earn in total?"
    )
    steps = [
        f"{rate} * {hours} = {rate * hours}",
        f"{rate * hours} * {days} = {rate * hours * days}",
    ]
    return question, steps, rate * hours * days


def _trip(rng: random.Random, name: str) -> WordProblem:
    speed1, hours1 = rng.randint(40, 90), rng.randint(1, 4)
    speed2, hours2 = rng.randint(20, 60), rng.randint(1, 3)
    leg1, leg2 = speed1 * hours1, speed2 * hours2
    question = (
        f"{name} drives at {speed1} km per hour for {hours1} hours, then at {speed2} km per "
        f"hour for {hours2} hours. How many kilometres does {name} drive in all?"
    )
    steps = [
        f"{speed1} * {hours1} = {leg1}",
        f"{speed2} * {hours2} = {leg2}",
        f"{leg1} + {leg2} = {leg1 + leg2}",
    ]
    return question, steps, leg1 + leg2


def _marbles(rng: random.Random, name: str) -> WordProblem:
    friends, each = rng.randint(2, 6), rng.randint(3, 9)
    given = friends * each
    start = given + rng.randint(1, 40)
    question = (
        f"{name} had {start} marbles and gave {each} marbles to each of {friends} friends. "
        f"How many marbles does {name} have left?"
    )
    steps = [f"{friends} * {each} = {given}", f"{start} - {given} = {start - given}"]
    return question, steps, start - given


def _boxes(rng: random.Random, name: str) -> WordProblem:
    per_box, boxes = rng.randint(6, 24), rng.randint(3, 12)
    total = per_box * boxes
    eaten = rng.randint(1, per_box)
    question = (
        f"A box holds {per_box} apples. {name} fills {boxes} boxes and then eats {eaten} "
        f"of the apples. How many apples are left?"
    )
    steps = [f"{per_box} * {boxes} = {total}", f"{total} - {eaten} = {total - eaten}"]
    return question, steps, total - eaten


def _shares(rng: random.Random, name: str) -> WordProblem:
    people, each = rng.randint(2, 8), rng.randint(3, 15)
    cookies = people * each
    question = (
        f"{name} baked {cookies} cookies and shared them equally among {people} children. "
        f"How many cookies did each child get?"
    )
    return question, [f"{cookies} / {people} = {each}"], each


TEMPLATES: tuple[Callable[[random.Random, str], WordProblem], ...] = (
    _packs, _wages, _trip, _marbles, _boxes, _shares,
)  # fmt: skip


def math_records(seed: int = SEED) -> list[dict]:
    """~30 GSM8K-format records: `answer` holds the worked steps, then `#### <number>`."""
    rng = random.Random(seed)
    records = []
    for index in range(NUM_PER_TEMPLATE * len(TEMPLATES)):
        template = TEMPLATES[index % len(TEMPLATES)]
        question, steps, result = template(rng, rng.choice(NAMES))
        answer = "\n".join(steps) + f"\n#### {result}"
        records.append({"question": question, "answer": answer, "source": SOURCE})
    return records


# Hand-written; the correct option's index is the last field.
MC_QUESTIONS: tuple[tuple[str, tuple[str, str, str, str], int], ...] = (
    ("What is the chemical symbol for gold?", ("Ag", "Au", "Gd", "Go"), 1),
    ("Which planet is closest to the Sun?", ("Venus", "Earth", "Mercury", "Mars"), 2),
    ("How many sides does a hexagon have?", ("Six", "Five", "Seven", "Eight"), 0),
    ("Water boils at what temperature at sea level, in degrees Celsius?", ("90", "50", "120", "100"), 3),
    ("Which gas do plants take in from the air for photosynthesis?", ("Oxygen", "Carbon dioxide", "Nitrogen", "Helium"), 1),
    ("What is the largest ocean on Earth?", ("Atlantic", "Indian", "Arctic", "Pacific"), 3),
    ("Which organ pumps blood through the human body?", ("Heart", "Liver", "Lung", "Kidney"), 0),
    ("What is 12 multiplied by 12?", ("124", "132", "144", "154"), 2),
    ("Which of these is a prime number?", ("21", "27", "31", "35"), 2),
    ("What is the freezing point of water in degrees Fahrenheit?", ("0", "32", "100", "212"), 1),
    ("Which continent is Egypt in?", ("Asia", "Europe", "South America", "Africa"), 3),
    ("How many minutes are in two hours?", ("120", "100", "60", "180"), 0),
    ("Which instrument measures air pressure?", ("Thermometer", "Barometer", "Hygrometer", "Anemometer"), 1),
    ("What do bees collect from flowers to make honey?", ("Pollen only", "Sap", "Nectar", "Dew"), 2),
    ("Which language has the most native speakers?", ("English", "Spanish", "Hindi", "Mandarin Chinese"), 3),
    ("In computing, what does CPU stand for?", ("Central Processing Unit", "Computer Power Unit", "Core Program Utility", "Central Print Unit"), 0),
    ("Which shape has three sides?", ("Square", "Triangle", "Pentagon", "Circle"), 1),
    ("What is the square root of 81?", ("7", "8", "9", "11"), 2),
    ("Which metal is liquid at room temperature?", ("Iron", "Mercury", "Copper", "Aluminium"), 1),
    ("How many legs does a spider have?", ("Six", "Ten", "Four", "Eight"), 3),
)  # fmt: skip


def mc_records() -> list[dict]:
    """~20 MMLU-format records: `choices` are four strings, `answer` the index 0–3."""
    return [
        {"question": q, "choices": list(choices), "answer": answer, "source": SOURCE}
        for q, choices, answer in MC_QUESTIONS
    ]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)
    path.write_text(text, encoding="utf-8")
    return path


def write_samples(data_dir: Path = DATA_DIR) -> list[Path]:
    """(Re)write both sample files into `data_dir`; returns their paths."""
    return [
        write_jsonl(data_dir / MATH_SAMPLE.name, math_records()),
        write_jsonl(data_dir / MC_SAMPLE.name, mc_records()),
    ]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    for written in write_samples():
        logger.info("wrote %s", written)
