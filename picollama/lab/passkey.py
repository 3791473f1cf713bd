"""Passkey retrieval, scored by likelihood.

A random five-digit key is hidden in real text at several depths. The model passes a row if it
gives the key a higher log-likelihood than each of DISTRACTORS other keys. There is no generation
and no instruction following. So it reads the same on a small base model and a real one. This is
the form PI, YaRN and Self-Extend report."""

import numpy as np
import torch
import torch.nn.functional as F

from picollama.cli import UserError
from picollama.lab.interruptible import interruptible

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
DEPTHS = (0.1, 0.5, 0.9)  # Where the needle starts, as a fraction of the filler before it.
DISTRACTORS = 9  # Other keys scored beside the true one, so chance is 10%.
THRESHOLD = 0.8  # The accuracy an effective passkey length keeps.


def key_tokens(tokenizer, key: int) -> list[int]:
    """The tokens of " KEY" where it follows QUESTION.

    We encode the question with the key and drop the question's own tokens. Encoding the key
    alone would be wrong, since a BPE may merge across the boundary."""
    question = tokenizer.encode(QUESTION)
    full = tokenizer.encode(f"{QUESTION} {key}")
    if full[: len(question)] != question or len(full) == len(question):
        raise UserError("the tokenizer does not split the passkey question from its key")
    return full[len(question) :]


def passkey_row(tokenizer, filler: np.ndarray, length: int, depth: float, rng) -> tuple | None:
    """(row, candidates) for one passkey row, or None if `length` cannot hold it.

    The row is real text (filler) with the needle at `depth`, ending in QUESTION. Every
    candidate must fit after it within `length` tokens. The candidates are the key tokens of
    the true key (first) and of DISTRACTORS other keys."""
    keys = 10_000 + rng.choice(90_000, DISTRACTORS + 1, replace=False)
    candidates = [key_tokens(tokenizer, int(key)) for key in keys]
    needle = tokenizer.encode(NEEDLE.format(key=int(keys[0])))
    question = tokenizer.encode(QUESTION)
    room = length - len(needle) - len(question) - max(map(len, candidates))
    if room < 1:
        return None
    at = int(depth * room)
    row = np.concatenate([filler[:at], needle, filler[at:room], question]).astype(np.int64)
    return row, candidates


@torch.inference_mode()
def candidate_scores(model, prefix: torch.Tensor, candidates: list[list[int]]) -> list[float]:
    """The log-likelihood of each candidate continuation of prefix (1, P).

    The prefix runs once into the KV cache, with logits at the last position only. Then each
    candidate runs after it. Under dynamic NTK the frequencies follow the length. So a
    candidate's few tokens are rotated for a slightly longer sequence than the cached keys."""
    start = prefix.shape[1]
    model.setup_cache(1, start + max(map(len, candidates)))
    try:
        features = interruptible(model.features, prefix, start_pos=0)  # Minutes when long.
        first = F.log_softmax(model.head(features[:, -1]).float(), -1)
        scores = []
        for tokens in candidates:
            score = first[0, tokens[0]].item()
            if len(tokens) > 1:
                given = torch.tensor([tokens[:-1]], device=prefix.device)
                logits = model(given, start_pos=start).float()[0]
                wanted = torch.tensor(tokens[1:], device=prefix.device)[:, None]
                score += F.log_softmax(logits, -1).gather(1, wanted).sum().item()
            scores.append(score)
    finally:
        model.reset_cache()
    return scores


def passkey_rows(tokenizer, filler: np.ndarray, lengths: list[int], seed: int) -> dict:
    """{(length, depth): [(row, candidates)] per filler row}, for lengths that fit a row.

    The keys are seeded, so every method and run gets the same ones."""
    rng = np.random.default_rng(seed)
    rows = {}
    for length in lengths:
        for depth in DEPTHS:
            made = [passkey_row(tokenizer, text, length, depth, rng) for text in filler]
            if None not in made:
                rows[(length, depth)] = made
    return rows


def passkey_read(model, rows: list, device) -> dict:
    """Accuracy and mean margin over the rows of one length and depth.

    A row is a hit when the true key scores above every distractor. The margin is the true key's
    lead over the best distractor, in nats."""
    hits, margins = [], []
    for row, candidates in rows:
        scores = candidate_scores(model, torch.from_numpy(row)[None].to(device), candidates)
        margins.append(scores[0] - max(scores[1:]))
        hits.append(float(margins[-1] > 0))
    return {"accuracy": float(np.mean(hits)), "margin": float(np.mean(margins)), "n": len(hits)}


def effective_length(by_length: dict, field: str = "accuracy") -> int | None:
    """The longest tested length up to which every scored length keeps `field` >= THRESHOLD.

    This is RULER's kind of effective length. None if even the shortest fails. Lengths without a
    score are skipped. They were too short for a passkey row, or past what the model reaches."""
    effective = None
    for length in sorted(by_length, key=int):
        cell = by_length[length]
        if cell is not None and cell[field] < THRESHOLD:
            break
        effective = int(length) if cell is not None else effective
    return effective
