"""RULER's synthetic tasks as token rows: one haystack that holds the needles of many questions.

RULER (Hsieh et al. 2024) hides needles in filler and asks for them back. Here one haystack serves
every question of a cell, so it holds all their needles. The other questions' needles are then
the distractors. The tasks, after RULER's scripts/synthetic.yaml:
- niah_single: a key -> number needle per question in noise ("The grass is green. ...").
- niah_multikey: the same needles in a haystack made of needles. Every filler line is a needle of
  another key (RULER's niah_multikey_2).
- niah_multivalue: four numbers per key, all to be recalled (RULER's niah_multivalue, in noise).
- vt: variable tracking. A chain VAR A = 12345, VAR B = VAR A, ... of five variables per question,
  interleaved with the other chains in noise. The answer names all five.
Scoring is RULER's string_match_all: the share of a question's answers found, case-insensitive,
in the generated text. This module makes text and tokens. It runs no model (ruler.py does)."""

import zlib
from dataclasses import dataclass

import numpy as np

from picollama.chat_template import encode_chat, encode_with_specials, render_chat
from picollama.cli import UserError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic numbers for {key} is: {value}."
ADJECTIVES = (
    "able ancient bitter bold brave bright broad calm clever cold crisp curious damp dark dusty "
    "eager early faint fancy fierce fresh gentle giant glad golden grand green hidden hollow "
    "humble icy jolly keen lively lonely loud lucky mellow noble odd pale proud quiet rapid rare "
    "rough round royal rusty salty sharp shiny silent silver sleepy smooth solid sour spare steep "
    "sticky stormy sunny swift tame tender tidy tiny vast warm wild windy wise young"
).split()
NOUNS = (
    "anchor apple arrow badge barrel basket beacon bell blanket bottle bridge bucket cabin camera "
    "candle canyon carpet castle cellar chain chair cliff clock cloud comet compass copper cradle "
    "crown desert diamond dragon drum eagle engine falcon feather fence forest fountain garden "
    "glacier hammer harbor helmet island jacket kettle ladder lantern lemon meadow mirror needle "
    "ocean orchard palace pencil pepper pillow planet pocket quarry rabbit ribbon river rocket "
    "saddle shadow shelf statue tunnel valley violin wagon window"
).split()
VALUES_PER_KEY = 4  # niah_multivalue's, as RULER's
KEYS = [f"{adjective}-{noun}" for adjective in ADJECTIVES for noun in NOUNS]  # RULER's kind
HOPS = 4  # vt: a chain of five variables, as RULER's num_hops 4


@dataclass(frozen=True)
class Spec:
    """One task's words: the instruction before the haystack, the question after it, and the
    start of the answer (RULER's answer_prefix). `tokens` is how many tokens the answer may take.
    `haystack` is what the filler lines are: noise, or needles of other keys."""

    instruction: str
    question: str
    answer: str
    tokens: int
    haystack: str = "noise"
    shots: int = 0  # worked examples before the instruction, as RULER's vt has one


NIAH = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
ONE = "What is the special magic number for {key} mentioned in the provided text?"
ONE_ANSWER = "The special magic number for {key} mentioned in the provided text is"
TASKS = {
    "niah_single": Spec(NIAH, ONE, ONE_ANSWER, 16),
    "niah_multikey": Spec(NIAH, ONE, ONE_ANSWER, 16, haystack="needles"),
    "niah_multivalue": Spec(
        NIAH,
        "What are all the special magic numbers for {key} mentioned in the provided text?",
        "The special magic numbers for {key} mentioned in the provided text are",
        48,
    ),
    "vt": Spec(
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n",
        "Question: Find all variables that are assigned the value {key} in the text above.",
        "Answer: According to the chain(s) of variable assignment in the text above, "
        f"{HOPS + 1} variables are assigned the value {{key}}, they are:",
        32,
        shots=1,
    ),
}
CONTEXT_MARK, QUESTION_MARK = "\x00context\x00", "\x00question\x00"


@dataclass
class Question:
    """One question's tokens, which follow the haystack, its answers, and where its needles sit
    (their mean line fraction of the haystack, 0 at its start)."""

    key: str
    tokens: list[int]
    answers: list[str]
    depth: float


@dataclass
class Haystack:
    """A cell's haystack tokens and the questions they answer. The tokens hold every needle."""

    task: str
    length: int  # what the haystack, a question and its answer fit
    tokens: list[int]
    questions: list[Question]
    lines: int  # filler lines


def draw(task: str, count: int, rng) -> tuple[list[list[str]], list[tuple[str, list[str]]]]:
    """(the needles of each question, in order, and each question's key and answers)."""
    if task == "vt":
        values = 10_000 + rng.choice(90_000, count, replace=False)
        names = set()
        while len(names) < count * (HOPS + 1):
            names.add("".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), 5)))
        names = sorted(names)
        rng.shuffle(names)
        chains = [names[i * (HOPS + 1) : (i + 1) * (HOPS + 1)] for i in range(count)]
        needles = [
            [f"VAR {chain[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(chain, chain[1:])]
            for chain, value in zip(chains, values)
        ]
        return needles, [(str(value), chain) for chain, value in zip(chains, values)]
    per_key = VALUES_PER_KEY if task == "niah_multivalue" else 1
    keys = [KEYS[i] for i in rng.choice(len(KEYS), count, replace=False)]
    values = [str(v) for v in 1_000_000 + rng.choice(9_000_000, count * per_key, replace=False)]
    answers = [values[i * per_key : (i + 1) * per_key] for i in range(count)]
    needles = [[NEEDLE.format(key=k, value=v) for v in vs] for k, vs in zip(keys, answers)]
    return needles, list(zip(keys, answers))


def filler(spec: Spec, count: int, taken: set[str], rng) -> list[str]:
    """`count` filler lines: noise, or needles of keys outside `taken` (the questions')."""
    if spec.haystack == "noise":
        return [NOISE] * count
    free = [key for key in KEYS if key not in taken]
    keys = rng.choice(len(free), count)
    values = 1_000_000 + rng.integers(0, 9_000_000, count)
    return [NEEDLE.format(key=free[k], value=v) for k, v in zip(keys, values)]


def place(fillers: list[str], needles: list[list[str]], rng) -> tuple[list[str], list[float]]:
    """The haystack's lines with the needles spread evenly over the fillers, and the mean depth of
    each question's needles. The needles' order is random, but each question's keep theirs (a
    chain stays in order)."""
    owners = np.repeat(np.arange(len(needles)), [len(group) for group in needles])
    rng.shuffle(owners)
    slots = np.round((np.arange(len(owners)) + 0.5) * len(fillers) / len(owners)).astype(int)
    nexts = [iter(group) for group in needles]
    lines, depths, at = [], [[] for _ in needles], 0
    for owner, slot in zip(owners, slots):
        lines += fillers[at:slot]
        at = slot
        lines.append(next(nexts[owner]))
        depths[owner].append(slot / max(len(fillers), 1))
    return lines + fillers[at:], [float(np.mean(d)) for d in depths]


def frame(template: str | None, tokenizer) -> tuple[str, str]:
    """(what comes before the instruction, what comes between the question and the answer): the
    chat template's turn around one user message and its assistant's start, or plain text (RULER's
    "base" template) where `template` is None."""
    if template is None:
        return "", " "
    message = CONTEXT_MARK + QUESTION_MARK
    text = render_chat(template, [{"role": "user", "content": message}], tokenizer)
    if text.count(message) != 1:
        raise UserError("the chat template does not put a user message into its text as it is")
    before, after = text.split(message)
    return before, after


def haystack(task: str, tokenizer, template: str | None, length: int, count: int, seed: int):
    """The Haystack of `count` questions of `task` that fits `length` tokens with each question and
    its answer's tokens. The needles depend on the seed and task only, so every length asks the
    same questions. The filler and the needles' places depend on the length too."""
    spec, rng = TASKS[task], np.random.default_rng([seed, zlib.crc32(task.encode())])
    needles, asked = draw(task, count + spec.shots, rng)
    shown = [worked(spec, *made, rng) for made in zip(needles[count:], asked[count:])]
    needles, asked = needles[:count], asked[:count]
    before, between = frame(template, tokenizer)
    questions = [
        encode_with_specials(
            tokenizer, spec.question.format(key=key) + between + spec.answer.format(key=key)
        )
        for key, _ in asked
    ]
    budget = length - max(map(len, questions)) - spec.tokens
    taken = {key for key, _ in asked}

    def build(lines: int) -> tuple[list[int], list[float]]:
        rng = np.random.default_rng([seed, zlib.crc32(task.encode()), length])
        text, depths = place(filler(spec, lines, taken, rng), needles, rng)
        prompt = before + "".join(shown) + spec.instruction + "\n" + "\n".join(text) + "\n"
        return encode_chat(tokenizer, prompt), depths

    def size(lines: int) -> int:
        return len(build(lines)[0])

    lines = most_lines(size, budget, task, length, count)
    tokens, depths = build(lines)
    made = zip(asked, questions, depths)
    return Haystack(task, length, tokens, [Question(k, q, a, d) for (k, a), q, d in made], lines)


def worked(spec: Spec, needles: list[str], asked: tuple[str, list[str]], rng) -> str:
    """A worked example in plain text: the task on four noise lines, and its answer written out
    (RULER's vt puts one so before the task)."""
    lines, _ = place([NOISE] * 4, [needles], rng)
    key, answers = asked
    question = spec.question.format(key=key) + " " + spec.answer.format(key=key)
    return f"{spec.instruction}\n" + "\n".join(lines) + f"\n{question} {' '.join(answers)}\n"


def most_lines(size, budget: int, task: str, length: int, count: int) -> int:
    """The most filler lines whose haystack's size(lines) stays within budget, by bisection (the
    size grows with the lines)."""
    if size(0) > budget:
        raise UserError(
            f"{length} tokens are too few for {count} questions of {task}: their needles and "
            "questions alone take more (lower --questions or raise --lengths)"
        )
    low, high = 0, 1
    while size(high) <= budget:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if size(middle) <= budget else (low, middle)
    return low


def match_all(answers: list[str], generated: str) -> float:
    """RULER's string_match_all for one question: the share of its answers that appear in the
    generated text, case-insensitive."""
    return sum(a.lower() in generated.lower() for a in answers) / len(answers)
