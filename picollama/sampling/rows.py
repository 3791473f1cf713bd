"""Batched decoding with settings per row: each its own sampling, generator, stops and logprobs."""

from dataclasses import dataclass

import torch

from model import Transformer
from picollama.sampling.caches import setup_cache
from picollama.sampling.decode import Sampling, decode_steps, prompt_tokens


@dataclass(frozen=True)
class Row:
    """One row of a batch: its prompt's token ids, how it samples (its own max_new_tokens and, with
    a seed, its own generator: a seeded row draws the same whatever else is in the batch), the ids
    that end it (not handed over), and how many alternatives a token's logprobs list (None: no
    logprobs; 0: the chosen token's alone)."""

    prompt: list[int]
    sampling: Sampling
    stop_ids: frozenset[int] = frozenset()
    logprobs: int | None = None


@dataclass(frozen=True)
class Token:
    """A chosen token as on_token receives it: its id, and where its row asked, its log-probability
    under the model (log-softmax of the logits, before temperature and truncation) and the most
    likely ids with theirs, best first."""

    id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class RowSampler:
    """Chooses one token per row, each row by its own Sampling: greedy at temperature 0, else top-k
    and top-p sampling drawn from the row's own generator (torch's global one without a seed; or
    `generators`, one a row, kept by the caller across batches). A batch of one draws exactly as
    decoding.sample does."""

    def __init__(self, samplings: list[Sampling], device: torch.device, generators=None):
        self.sampled = [s.temperature > 0 for s in samplings]
        self.temperature = torch.tensor([s.temperature for s in samplings], device=device)
        ks = [s.top_k for s in samplings]
        self.top_k = (
            None
            if all(k is None for k in ks)
            else torch.tensor([k or 0 for k in ks], device=device)
        )
        ps = [1.0 if s.top_p is None else s.top_p for s in samplings]
        self.top_p = None if min(ps) >= 1 else torch.tensor(ps, device=device)
        self.generators = generators or [
            None if s.seed is None else torch.Generator(device).manual_seed(s.seed)
            for s in samplings
        ]

    def __call__(self, logits: torch.Tensor, drawing: list[bool]) -> torch.Tensor:
        """A token per row; only the `drawing` rows draw from their generators (a row still in its
        prompt must not use up its random numbers: it draws as it would alone)."""
        greedy = logits.argmax(-1)
        if not any(s and d for s, d in zip(self.sampled, drawing)):
            return greedy
        x = logits.float() / self.temperature[:, None]
        # temperature 0 (inf or NaN here), or one so small that logits overflow: greedy
        overflow = ~x.amax(-1).isfinite()
        if self.top_k is not None:
            k = torch.where(self.top_k > 0, self.top_k, x.shape[-1]).clamp(max=x.shape[-1])
            kth = torch.topk(x, int(k.max()), dim=-1).values.gather(-1, k[:, None] - 1)
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p is not None:
            sorted_x, order = x.sort(dim=-1, descending=True)
            probs = sorted_x.softmax(-1)
            drop = (probs.cumsum(-1) - probs >= self.top_p[:, None]) & (self.top_p[:, None] < 1)
            x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
        probs = torch.where(overflow[:, None], 1.0, x.softmax(-1))
        drawn = [
            torch.multinomial(probs[row : row + 1], 1, generator=generator)[0]
            if sampled and draw
            else greedy[row : row + 1]
            for row, (sampled, draw, generator) in enumerate(
                zip(self.sampled, drawing, self.generators)
            )
        ]
        return torch.where(overflow, greedy, torch.cat(drawn))


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top: int) -> tuple[list, list]:
    """(each row's chosen token's log-probability, each row's `top` most likely [(id, logprob)]),
    on the host."""
    logprobs = logits.float().log_softmax(-1)
    picked = logprobs.gather(-1, chosen[:, None])[:, 0].tolist()
    if top == 0:
        return picked, [[] for _ in picked]
    values, ids = logprobs.topk(top, dim=-1)
    return picked, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


@torch.inference_mode()
def generate_rows(
    model: Transformer,
    rows: list[Row],
    on_token,
    on_done=None,
    step=None,
    vocab_limit: int | None = None,
) -> list[list[int]]:
    """Each row's new tokens (a stop id ends a row and is not included), as decoding.generate
    decodes a batch of prompts of different lengths, but with each row's own Row settings.

    on_token(row, Token) is called as each row's token is chosen; a true return ends that row (a
    stop string found, a client gone). on_done(row, reason) is called once as each row ends:
    "stop" (a stop id), "length" (its max_new_tokens) or "halted" (on_token said so). The batch
    ends when every row has. step and vocab_limit as for decoding.generate.
    """
    batch = RowStates(rows, on_token, on_done)
    width = max(batch.ends) - max(batch.lengths)  # new tokens past the longest prompt
    tokens = prompt_tokens(model, [row.prompt for row in rows], width)
    if all(batch.done):
        return batch.outputs
    sampler = RowSampler([row.sampling for row in rows], tokens.device)
    top = max(row.logprobs or 0 for row in rows)
    wanted = any(row.logprobs is not None for row in rows)
    setup_cache(model, *tokens.shape, getattr(step, "kv_dtype", None))
    try:
        for pos, logits in decode_steps(model, tokens, min(batch.lengths), step):
            if vocab_limit is not None:
                logits[:, vocab_limit:] = float("-inf")
            new = batch.choosing(pos)
            chosen = sampler(logits, new)
            # a row still in its prompt keeps its prompt token (a finished one, anything)
            mask = torch.tensor(new, device=tokens.device)
            tokens[:, pos] = torch.where(mask, chosen, tokens[:, pos])
            picked, tops = token_logprobs(logits, chosen, top) if wanted else (None, None)
            batch.hand_over(pos, chosen.tolist(), new, picked, tops)
            if all(batch.done):
                break
    finally:
        model.reset_cache()
    return batch.outputs


class RowStates:
    """generate_rows' rows as they go: where each ends, whether it has, its tokens so far; what
    they hand over (on_token) and why they end (on_done)."""

    def __init__(self, rows: list[Row], on_token, on_done):
        self.rows, self.on_token, self.on_done = rows, on_token, on_done
        self.lengths = [len(row.prompt) for row in rows]
        self.ends = [n + row.sampling.max_new_tokens for n, row in zip(self.lengths, rows)]
        self.done = [False] * len(rows)
        self.outputs = [[] for _ in rows]
        for row, (length, end) in enumerate(zip(self.lengths, self.ends)):
            if end == length:  # max_new_tokens 0
                self.finish(row, "length")

    def choosing(self, pos: int) -> list[bool]:
        """Which rows choose the token at pos: past their prompt, not done."""
        return [
            not done and length <= pos < end
            for done, length, end in zip(self.done, self.lengths, self.ends)
        ]

    def hand_over(self, pos: int, chosen: list[int], new: list[bool], picked, tops):
        """Each choosing row's token to on_token (a stop id ends the row instead)."""
        for r, token in enumerate(chosen):
            if not new[r]:
                continue
            row = self.rows[r]
            if token in row.stop_ids:
                self.finish(r, "stop")
                continue
            self.outputs[r].append(token)
            given = Token(token)
            if row.logprobs is not None:
                given = Token(token, picked[r], tuple(tops[r][: row.logprobs]))
            if self.on_token(r, given):
                self.finish(r, "halted")
            elif pos + 1 >= self.ends[r]:
                self.finish(r, "length")

    def finish(self, row: int, reason: str):
        self.done[row] = True
        if self.on_done is not None:
            self.on_done(row, reason)
