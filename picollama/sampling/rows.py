"""Rows and the one hand-over: what a row asks for, and how a chosen token reaches it.

Both decode loops hand tokens over here: decode.decode_rows (a static batch) and slots.Slots
(continuous batching). Here a stop id ends a row and the max length ends it. Here on_token
hears of each token, and a row's constraint (a grammar) takes it. Nothing here runs the model
or knows about HTTP.
"""

from dataclasses import dataclass, field

import torch

from picollama.sampling.sampler import Sampling, token_logprobs


@dataclass(frozen=True)
class Row:
    """One row of a batch: its prompt's token ids and how it samples (Sampling).

    A seeded row has its own generator, so it draws the same whatever else is in the batch.
    stop_ids end the row and are not handed over. logprobs: how many alternatives each token
    lists (None: no logprobs; 0: the chosen token's alone).
    """

    prompt: list[int]
    sampling: Sampling
    stop_ids: frozenset[int] = frozenset()
    logprobs: int | None = None


@dataclass(frozen=True)
class Token:
    """A chosen token as on_token receives it: its id, and where its row asked, its logprobs.

    logprob is the model's log-softmax, before temperature and truncation. top lists the most
    likely ids with theirs, best first.
    """

    id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(eq=False)  # a row is itself: two alike are still two
class RowState:
    """A row as it decodes: its Row, its on_token and the new tokens it has taken.

    on_token(Token) returns whether the row is over (a stop string found, a client gone). None:
    nobody listens. tokens is None where they are not kept: a stream keeps nothing.
    """

    row: Row
    on_token: object = None
    tokens: list[int] | None = field(default_factory=list)
    count: int = 0  # tokens taken, kept or not

    def take(self, token: int, logprob: float | None = None, top=()) -> str | None:
        """Take a chosen token: why the row ends now, or None if it goes on.

        "stop": a stop id, not taken. "halted": on_token said so. "length": max_new_tokens.
        """
        row = self.row
        if token in row.stop_ids:
            return "stop"
        if row.sampling.constraint is not None:  # its grammar moves on (sampler.Sampling)
            row.sampling.constraint.take(token)
        self.count += 1
        if self.tokens is not None:
            self.tokens.append(token)
        given = Token(token)
        if row.logprobs is not None:
            given = Token(token, logprob, tuple(top[: row.logprobs]))
        if self.on_token is not None and self.on_token(given):
            return "halted"
        return "length" if self.count >= row.sampling.max_new_tokens else None


def hand_over(
    states: list[RowState], logits: torch.Tensor, chosen: torch.Tensor, taking: list[bool]
) -> dict[int, str]:
    """Hand each chosen token to its row, for the rows that are `taking`.

    Returns {row: why it ended} for the rows that end. One copy brings the tokens to the host.
    The logprobs come from the same logits the tokens were chosen from.
    """
    top = max(state.row.logprobs or 0 for state in states)
    wanted = any(state.row.logprobs is not None for state in states)
    picked, tops = token_logprobs(logits, chosen, top) if wanted else (None, None)
    ended = {}
    for r, (state, token) in enumerate(zip(states, chosen.tolist())):
        if not taking[r]:
            continue
        logprob, best = (None, ()) if picked is None else (picked[r], tops[r])
        reason = state.take(token, logprob, best)
        if reason is not None:
            ended[r] = reason
    return ended
