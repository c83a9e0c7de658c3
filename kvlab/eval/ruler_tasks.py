"""The 11 synthetic RULER tasks that need no external QA data (Hsieh et al., "RULER: What's
the Real Context Size of Your Long-Context Language Models?", arXiv 2404.06654), generated
offline and seeded, with RULER's templates: needles in a haystack (niah_single_1/2/3,
niah_multikey_1/2/3, niah_multivalue, niah_multiquery), variable tracking (vt), common
words (cwe) and frequent coded words (fwe) extraction. Essay haystacks are WikiText-2 text
(RULER uses Paul Graham's essays). Each item is split as kvpress's RULER set is: a context
(compressed), a question asked after it and an answer prefix; scored by RULER's
``string_match_all`` (:func:`kvlab.eval.longctx_tasks.score`).
"""

from __future__ import annotations

import random
import string
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvlab.eval.longctx_tasks import NOISE, fill

ADJECTIVES = (
    "abundant agreeable ancient bitter brave calm clever cloudy crooked curious damp eager "
    "fancy fierce fragile gentle gleaming hollow humble icy jolly lively lonely mighty "
    "narrow nervous odd polite proud quiet rapid rustic shaggy silent sleepy smooth sturdy "
    "tender tidy vast wary witty"
).split()
NOUNS = (
    "anchor badge barrel beacon blanket bucket cabin canyon cardigan carpet castle cobweb "
    "compass cottage cupboard dragon engine feather fountain garden helmet kettle ladder "
    "lantern meadow mirror needle orchard paddle pepper pillow quarry ribbon saddle "
    "spindle teapot thimble tunnel violin wagon whistle"
).split()
COMMON_WORDS = (
    "apple river stone cloud maple tiger silver garden lantern harbor violet candle meadow "
    "falcon copper island thunder velvet orchard pebble willow ember glacier harvest "
    "jasmine kettle lagoon marble nectar oyster prairie quartz raven saffron timber "
    "umber vessel walnut yonder zephyr amber bramble cinder dune fable grove heron ivory "
    "juniper"
).split()

NIAH = (
    "Some special magic {kind} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {kind} afterwards.\n"
)
NIAH_QUESTION = "What are all the special magic {kind} for {query} mentioned in the provided text?"
NIAH_ANSWER = "The special magic {kind} for {query} mentioned in the provided text are"


@dataclass(frozen=True)
class RulerItem:
    """One RULER example: ``context`` (compressed), ``question`` and ``answer_prefix``
    (asked after it), the ``references`` the answer must contain."""

    task: str
    context: str
    question: str
    answer_prefix: str
    references: list[str]

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _key(rng: random.Random, kind: str) -> str:
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _value(rng: random.Random, kind: str) -> str:
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return str(rng.randint(1_000_000, 9_999_999))


def _tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _needle(key: str, value: str, kind: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def niah(
    tokenizer, length, rng, haystack, *, hay: str, keys: str = "words", values: str = "numbers",
    num_k: int = 1, num_v: int = 1, num_q: int = 1,
) -> RulerItem:  # fmt: skip
    """RULER's needle in a haystack: ``num_k`` keys (``num_q`` of them asked), ``num_v``
    values per key, in a haystack of noise, essay sentences or other needles."""
    kind = "numbers" if values == "numbers" else "uuids"
    names = []
    while len(names) < num_k:
        name = _key(rng, keys)
        names.append(name) if name not in names else None
    answers = {k: [_value(rng, values) for _ in range(num_v)] for k in names}
    needles = [_needle(k, v, kind) for k in names for v in answers[k]]
    asked = names[:num_q]
    query = asked[0] if num_q == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    head = NIAH.format(kind=kind)
    question = NIAH_QUESTION.format(kind=kind, query=query)
    fixed = _tokens(tokenizer, head + question) + sum(_tokens(tokenizer, n) for n in needles)
    budget = length - fixed
    if hay == "noise":
        pieces = fill(tokenizer, NOISE, budget, rng)
    elif hay == "essay":
        pieces = fill(tokenizer, haystack, budget, rng)
    else:  # a haystack of needles of other keys
        others = [_needle(_key(rng, keys), _value(rng, values), kind) + " " for _ in range(400)]
        pieces = fill(tokenizer, others, budget, rng)
    for needle in needles:  # each at its own random depth
        pieces.insert(rng.randrange(len(pieces) + 1), " " + needle + " ")
    refs = [v for k in asked for v in answers[k]]
    answer = NIAH_ANSWER.format(kind=kind, query=query)
    return RulerItem("", head + "".join(pieces) + "\n", question, answer, refs)


def variable_tracking(tokenizer, length, rng, haystack, hops: int = 4) -> RulerItem:
    """RULER's vt: one chain VAR X1 = value, VAR X2 = VAR X1, ... in noise."""
    value = str(rng.randint(10000, 99999))
    names = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        names.append(name) if name not in names else None
    chain = [f"VAR {names[0]} = {value}."]
    chain += [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    head = (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    )
    question = (
        f"Question: Find all variables that are assigned the value {value} in the text above."
    )
    fixed = _tokens(tokenizer, head + question) + sum(_tokens(tokenizer, c) for c in chain)
    pieces = fill(tokenizer, NOISE, length - fixed, rng)
    spots = sorted(rng.sample(range(len(pieces) + 1), len(chain)))
    for offset, (spot, statement) in enumerate(zip(spots, chain, strict=True)):
        pieces.insert(spot + offset, " " + statement + " ")
    answer = (
        "Answer: According to the chain(s) of variable assignment in the text above, "
        f"{hops + 1} variables are assigned the value {value}, they are:"
    )
    return RulerItem("", head + "".join(pieces) + "\n", question, answer, names)


def common_words(tokenizer, length, rng, haystack, top: int = 10) -> RulerItem:
    """RULER's cwe: ``top`` words 30 times each among words seen 3 times each, numbered,
    as many of the rare ones as fit (none fit: the common ones less often)."""
    words = list(dict.fromkeys(COMMON_WORDS + ADJECTIVES + NOUNS))
    rng.shuffle(words)
    common, rare = words[:top], words[top:]
    head = (
        "Below is a numbered list of words. In these words, some appear more often than "
        "others. Memorize the ones that appear most often.\n"
    )
    question = f"Question: What are the {top} most common words in the above list?"
    room, frequency = length - _tokens(tokenizer, head + question), 30
    while True:
        items = common * frequency + rare * 3
        rng.shuffle(items)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        if _tokens(tokenizer, listing) <= room or (frequency <= 4 and not rare):
            break
        if rare:
            rare = rare[:-5]
        else:  # short lengths: the common words appear less often too
            frequency -= 2
    answer = f"Answer: The top {top} words that appear most often in the list are:"
    return RulerItem("", head + listing + "\n", question, answer, common)


def frequent_words(tokenizer, length, rng, haystack, alpha: float = 2.0) -> RulerItem:
    """RULER's fwe: coded words drawn from a Zipf(``alpha``) law; the 3 most frequent."""
    vocab = []
    while len(vocab) < 400:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6)))
        vocab.append(word) if word not in vocab else None
    weights = [1 / (rank + 1) ** alpha for rank in range(len(vocab))]
    head = (
        "Read the following coded text and track the frequency of each coded word. Find "
        "the three most frequently appeared coded words. "
    )
    question = (
        "Question: Do not provide any explanation. Please ignore the dots '....'. What are "
        "the three most frequently appeared words in the above coded text?"
    )
    room = length - _tokens(tokenizer, head + question)
    drawn = rng.choices(vocab, weights=weights, k=max(16, room // 3))
    text = " ".join(w if i % 10 else w + " ...." for i, w in enumerate(drawn, 1))
    while _tokens(tokenizer, text) > room:
        drawn = drawn[: int(len(drawn) * 0.95)]
        text = " ".join(w if i % 10 else w + " ...." for i, w in enumerate(drawn, 1))
    top = [w for w, _ in Counter(drawn).most_common(3)]
    answer = (
        "Answer: According to the coded text above, the three most frequently appeared words are:"
    )
    return RulerItem("", head + text + "\n", question, answer, top)


def _niah(**kwargs) -> Callable[..., RulerItem]:
    return lambda tokenizer, length, rng, haystack: niah(tokenizer, length, rng, haystack, **kwargs)


RULER_TASKS: dict[str, Callable[..., RulerItem]] = {
    "niah_single_1": _niah(hay="noise"),
    "niah_single_2": _niah(hay="essay"),
    "niah_single_3": _niah(hay="essay", values="uuids"),
    "niah_multikey_1": _niah(hay="essay", num_k=4),
    "niah_multikey_2": _niah(hay="needles", num_k=1),
    "niah_multikey_3": _niah(hay="needles", keys="uuids", values="uuids", num_k=1),
    "niah_multivalue": _niah(hay="essay", num_v=4),
    "niah_multiquery": _niah(hay="essay", num_k=4, num_q=4),
    "vt": variable_tracking,
    "cwe": common_words,
    "fwe": frequent_words,
}


def make_item(task: str, tokenizer, length: int, seed: int, index: int, haystack) -> RulerItem:
    """Item ``index`` of ``task`` at ~``length`` tokens; the same for the same arguments."""
    rng = random.Random(f"{task}/{length}/{seed}/{index}")
    item = RULER_TASKS[task](tokenizer, length, rng, haystack)
    return RulerItem(task, item.context, item.question, item.answer_prefix, item.references)


def prompt_ids(tokenizer, item: RulerItem) -> tuple[list[int], list[int]]:
    """(context ids, question ids) as kvpress's pipeline builds them: with a chat template,
    the context is the template's text up to the end of the user turn's content and the
    question is the rest of the turn + the assistant header + the answer prefix; without
    one, BOS + context, then the question after a newline."""
    context, suffix = item.context, "\n"
    if getattr(tokenizer, "chat_template", None):
        separator = "#" * (len(context) + 10)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + separator}],
            add_generation_prompt=True, tokenize=False,
        )  # fmt: skip
        context, suffix = text.split(separator)
    else:
        context = (getattr(tokenizer, "bos_token", "") or "") + context
    question = item.question + suffix + item.answer_prefix
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return encode(context), encode(question)
