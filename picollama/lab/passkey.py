"""Passkey retrieval scored by likelihood: a random five-digit key hidden in real text at several
depths, read back as whether the model gives the key a higher log-likelihood than every one of
DISTRACTORS other keys. No generation and no instruction following, so that it reads the same on a
small base model and a real one (the form PI, YaRN and Self-Extend report)."""

import numpy as np
import torch
import torch.nn.functional as F

from picollama.cli import UserError
from picollama.lab.interruptible import interruptible

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
DEPTHS = (0.1, 0.5, 0.9)  # where the needle starts, as a fraction of the filler before the question
DISTRACTORS = 9  # other keys scored beside the true one: chance is 10%
THRESHOLD = 0.8  # the accuracy an effective passkey length keeps


def key_tokens(tokenizer, key: int) -> list[int]:
    """The tokens of " KEY" where it follows QUESTION (the question encoded with the key, less the
    question's own tokens: a BPE may merge across the boundary)."""
    question = tokenizer.encode(QUESTION)
    full = tokenizer.encode(f"{QUESTION} {key}")
    if full[: len(question)] != question or len(full) == len(question):
        raise UserError("the tokenizer does not split the passkey question from its key")
    return full[len(question) :]


def passkey_row(tokenizer, filler: np.ndarray, length: int, depth: float, rng) -> tuple | None:
    """(row, candidates): at most `length` tokens of real text (filler) with the needle starting at
    `depth` of it, ending in QUESTION, such that every candidate fits after it within `length`;
    candidates are the key tokens of the true key (first) and of DISTRACTORS other keys. None
    where `length` cannot hold the needle and the question."""
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
    """The log-likelihood of each candidate continuation of prefix (1, P): the prefix runs once,
    into the KV cache, its logits made at the last position only; then each candidate after it
    (under dynamic NTK, whose frequencies follow the length, a candidate's few tokens are rotated
    for a sequence a few tokens longer than the cached keys were)."""
    start = prefix.shape[1]
    model.setup_cache(1, start + max(map(len, candidates)))
    try:
        features = interruptible(model.features, prefix, start_pos=0)  # minutes at long lengths
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
    """{(length, depth): [(row, candidates)] per filler row}, for the lengths that can hold a
    passkey row: the same keys for every method and run, seeded."""
    rng = np.random.default_rng(seed)
    rows = {}
    for length in lengths:
        for depth in DEPTHS:
            made = [passkey_row(tokenizer, text, length, depth, rng) for text in filler]
            if None not in made:
                rows[(length, depth)] = made
    return rows


def passkey_read(model, rows: list, device) -> dict:
    """Accuracy (the true key scored above every distractor) and the mean margin in nats of the
    true key over the best distractor, over the rows of one length and depth."""
    hits, margins = [], []
    for row, candidates in rows:
        scores = candidate_scores(model, torch.from_numpy(row)[None].to(device), candidates)
        margins.append(scores[0] - max(scores[1:]))
        hits.append(float(margins[-1] > 0))
    return {"accuracy": float(np.mean(hits)), "margin": float(np.mean(margins)), "n": len(hits)}


def effective_length(by_length: dict, field: str = "accuracy") -> int | None:
    """The longest tested length up to which every length scored keeps its accuracy (each cell's
    `field`) >= THRESHOLD (RULER's kind of effective length); None where even the shortest does
    not. Lengths without a score (too short for a passkey row, or past what the model reaches)
    are skipped."""
    effective = None
    for length in sorted(by_length, key=int):
        cell = by_length[length]
        if cell is not None and cell[field] < THRESHOLD:
            break
        effective = int(length) if cell is not None else effective
    return effective
