"""Seeded, offline long-context retrieval tasks: passkey retrieval (Mohtashami & Jaggi,
arXiv 2305.16300), needle in a haystack (Kamradt, 2023) in real WikiText text, and a subset
of RULER (Hsieh et al., arXiv 2404.06654): single- and multi-key needles in noise, variable
tracking, common-words extraction. Each builds a prompt of about ``length`` tokens with the
needle at ``depth`` (0 = start, 1 = end) and the references its answer must contain.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = (
    "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on "
    "a sunny day."
)
WORDS = (
    "apple river stone cloud maple tiger silver garden lantern harbor violet candle "
    "meadow falcon copper island thunder velvet orchard pebble"
).split()


@dataclass(frozen=True)
class Sample:
    prompt: str
    references: list[str]


def fill(tokenizer, unit: str | list[str], budget: int, rng: random.Random) -> list[str]:
    """Pieces of filler (``unit`` repeated, or consecutive sentences) of ~``budget`` tokens."""
    units = [unit] if isinstance(unit, str) else unit
    pieces, used, start = [], 0, rng.randrange(len(units))
    while used < budget:
        piece = units[(start + len(pieces)) % len(units)]
        pieces.append(piece)
        used += len(tokenizer(piece, add_special_tokens=False)["input_ids"])
    return pieces


def place(pieces: list[str], depth: float, needle: str) -> str:
    """Join filler pieces with ``needle`` inserted at fraction ``depth`` of them."""
    at = round(depth * len(pieces))
    return "".join(pieces[:at]) + " " + needle + " " + "".join(pieces[at:])


def _budget(tokenizer, length: int, *fixed: str) -> int:
    return length - sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in fixed)


def passkey(tokenizer, length, depth, rng, haystack) -> Sample:
    key = str(rng.randint(10000, 99999))
    head = (
        "There is an important piece of information hidden inside a lot of irrelevant "
        "text. Find it and memorize it.\n"
    )
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    tail = "\nWhat is the pass key? The pass key is"
    pieces = fill(tokenizer, NOISE, _budget(tokenizer, length, head, needle, tail), rng)
    return Sample(head + place(pieces, depth, needle) + tail, [key])


def needle(tokenizer, length, depth, rng, haystack) -> Sample:
    tail = (
        "\nQuestion: What is the best thing to do in San Francisco?\nAnswer: The best thing to do"
    )
    pieces = fill(tokenizer, haystack, _budget(tokenizer, length, NEEDLE, tail), rng)
    return Sample(place(pieces, depth, NEEDLE) + tail, ["sandwich", "Dolores Park"])


def niah_multikey(tokenizer, length, depth, rng, haystack, keys: int = 4) -> Sample:
    names = rng.sample(WORDS, keys)
    values = [str(rng.randint(1000000, 9999999)) for _ in names]
    pairs = zip(names, values, strict=True)
    needles = [f"One of the special magic numbers for {n} is: {v}." for n, v in pairs]
    tail = (
        f"\nWhat is the special magic number for {names[0]} mentioned in the provided "
        f"text? The special magic number for {names[0]} mentioned in the provided text is"
    )
    pieces = fill(tokenizer, NOISE, _budget(tokenizer, length, *needles, tail), rng)
    for other in needles[1:]:  # distractor keys at random depths
        pieces.insert(rng.randrange(len(pieces) + 1), " " + other + " ")
    return Sample(place(pieces, depth, needles[0]) + tail, [values[0]])


def niah_single(tokenizer, length, depth, rng, haystack) -> Sample:
    return niah_multikey(tokenizer, length, depth, rng, haystack, keys=1)


def variable_tracking(tokenizer, length, depth, rng, haystack, hops: int = 4) -> Sample:
    value = str(rng.randint(10000, 99999))
    names = [
        "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(hops + 1)
    ]
    chain = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)
    ]
    tail = (
        f"\nQuestion: Find all variables that are assigned the value {value} in the text "
        f"above. Answer: According to the chain(s) of variable assignment in the text "
        f"above, {hops + 1} variables are assigned the value {value}, they are:"
    )
    pieces = fill(tokenizer, NOISE, _budget(tokenizer, length, *chain, tail), rng)
    step = max(1, len(pieces) // (hops + 1))
    start = round(depth * max(0, len(pieces) - step * hops))
    for i, statement in enumerate(chain):  # in order, from the depth on
        pieces.insert(min(start + i * step + i, len(pieces)), " " + statement + " ")
    return Sample("".join(pieces) + tail, names)


def common_words(tokenizer, length, depth, rng, haystack, top: int = 5) -> Sample:
    frequent = rng.sample(WORDS, top)
    rare = [w for w in WORDS if w not in frequent]
    count = max(4 * top, (length - 80) // 4)  # a numbered item is about four tokens
    items = [rng.choice(frequent) if rng.random() < 0.5 else rng.choice(rare) for _ in range(count)]
    counts = {w: items.count(w) for w in set(items)}
    expected = sorted(counts, key=counts.get, reverse=True)[:top]
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    tail = (
        f"\nQuestion: What are the {top} most common words in the above list? Answer: The "
        f"top {top} words that appear most often in the list are:"
    )
    return Sample("Below is a numbered list of words.\n" + listing + tail, expected)


TASKS: dict[str, Callable[..., Sample]] = {
    "passkey": passkey,
    "needle": needle,
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
}


def score(answer: str, references: list[str]) -> float:
    """RULER's string match: the fraction of references found in the answer (any case)."""
    lowered = answer.lower()
    return sum(ref.lower() in lowered for ref in references) / len(references)
