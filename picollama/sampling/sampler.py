"""The one sampler: how generate.py and the server choose each row's next token from its logits.

It knows nothing of prompts, caches or stops: logits in, token ids out. A row's constraint (a
grammar, grammar.py) narrows the tokens it may choose.
"""

import math
from dataclasses import dataclass, field, replace

import torch

from picollama.cli import UserError
from picollama.cli.flags import check_seed


@dataclass(frozen=True)
class Sampling:
    """How a row chooses new tokens, checked on creation. Its messages name the flags."""

    max_new_tokens: int = 200
    temperature: float = 0.8  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None  # None: torch's global generator
    # One row's own mask hook (grammar.Constraint), or None: allowed() gives the tokens it may
    # choose, fits(token) vets a choice, closer() is a token that always fits. The hand-over
    # feeds it each token taken (rows.RowState.take).
    constraint: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise UserError(f"--max-new-tokens must be >= 0, not {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"--temperature must be a finite number >= 0, not {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"--top-k must be >= 1, not {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], not {self.top_p}")
        check_seed(self.seed)


class Sampler:
    """Chooses one token per row, each row by its own Sampling.

    Temperature 0 is greedy. Otherwise the row draws from softmax(logits / temperature), cut to
    its top-k tokens and then to its top-p nucleus. A seeded row draws from its own generator,
    so it draws the same whatever else is in the batch. Rows without a seed share torch's global
    generator. `generators` (one a row) lets a caller keep them across calls. A row with a
    constraint chooses among the tokens it allows, and again, without the token, where the token
    does not fit (at most REDRAWS times; then it takes the constraint's closer()).
    """

    REDRAWS = 8

    def __init__(self, samplings: list[Sampling], device: torch.device, generators=None):
        self.samplings = samplings
        self.constraints = [s.constraint for s in samplings]
        self.constrained = any(c is not None for c in self.constraints)
        self.sampled = [s.temperature > 0 for s in samplings]
        temperatures = [s.temperature for s in samplings]
        self.temperature = temperatures[0] if len(set(temperatures)) == 1 else None
        # else each temperature and its rows, made once: an index copied to a GPU waits for it
        self.temperatures = [
            (t, torch.tensor([r for r, u in enumerate(temperatures) if u == t], device=device))
            for t in sorted(set(temperatures) if self.temperature is None else ())
        ]
        ks = [s.top_k for s in samplings]
        self.top_k = (
            None
            if all(k is None for k in ks)
            else torch.tensor([k or 0 for k in ks], device=device)
        )
        # the most tokens any row keeps, known on the host: reading it off the device would wait
        self.most_k = None if None in ks else max(ks)
        ps = [1.0 if s.top_p is None else s.top_p for s in samplings]
        self.top_p = None if min(ps) >= 1 else torch.tensor(ps, device=device)
        self.generators = generators or [
            None if s.seed is None else torch.Generator(device).manual_seed(s.seed)
            for s in samplings
        ]

    def __call__(self, logits: torch.Tensor, drawing: list[bool]) -> torch.Tensor:
        """A token id per row of logits (B, vocab), on their device.

        Only the `drawing` rows draw random numbers. A row still in its prompt must not use them
        up: then it draws as it would alone. The others get the greedy token. The drawing rows
        with a constraint choose under it.
        """
        if not self.constrained:
            return self.choose(logits, drawing)
        logits = self.masked(logits, drawing)
        return self.vetted(logits, drawing, self.choose(logits, drawing))

    def masked(self, logits: torch.Tensor, drawing: list[bool]) -> torch.Tensor:
        """The logits with -inf where a drawing row's constraint allows no token. A copy: the
        logprobs stay the model's."""
        allow = torch.ones(logits.shape, dtype=torch.bool)
        for r, constraint in enumerate(self.constraints):
            if constraint is not None and drawing[r]:
                allowed = constraint.allowed()[: logits.shape[1]]
                allow[r] = False
                allow[r, : len(allowed)] = allowed
        return logits.masked_fill(~allow.to(logits.device), float("-inf"))

    def vetted(self, logits: torch.Tensor, drawing: list[bool], chosen: torch.Tensor):
        """The chosen tokens, each constrained row's drawn again without its token while that
        does not fit. The row draws alone, from its own generator."""
        for r, constraint in enumerate(self.constraints):
            if constraint is None or not drawing[r]:
                continue
            row, token, redraws = logits[r : r + 1], int(chosen[r]), 0
            while not constraint.fits(token):
                if redraws == self.REDRAWS:
                    token = constraint.closer()
                    break
                row = row.index_fill(1, torch.tensor([token], device=row.device), float("-inf"))
                sampling = replace(self.samplings[r], constraint=None)
                alone = Sampler([sampling], row.device, self.generators[r : r + 1])
                token, redraws = int(alone(row, [True])[0]), redraws + 1
            chosen[r] = token
        return chosen

    def choose(self, logits: torch.Tensor, drawing: list[bool]) -> torch.Tensor:
        """__call__ without constraints."""
        greedy = logits.argmax(-1)
        draws = [r for r, (s, d) in enumerate(zip(self.sampled, drawing)) if s and d]
        if not draws:
            return greedy
        probs, overflow = self.probabilities(logits)
        chosen = greedy.clone()
        shared = [r for r in draws if self.generators[r] is None]
        if len(shared) == len(chosen):  # all on the global generator: no index to copy over
            chosen = torch.multinomial(probs, 1).squeeze(-1)
        elif shared:  # one call for the rows on the global generator, not one a row
            index = torch.tensor(shared, device=logits.device)
            chosen[index] = torch.multinomial(probs[index], 1).squeeze(-1)
        for r in draws:
            if self.generators[r] is not None:
                drawn = torch.multinomial(probs[r : r + 1], 1, generator=self.generators[r])
                chosen[r : r + 1] = drawn[0]
        return torch.where(overflow, greedy, chosen)

    def probabilities(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's filtered softmax, which rows overflow and so choose greedily)."""
        x = self.scaled(logits)
        # Temperature 0 gives inf or NaN here, and so can a tiny one.
        # Softmax cannot take those: the limit of a temperature going to 0 is greedy.
        # No branch on the host: the check stays on the device.
        overflow = ~x.amax(-1).isfinite()
        if self.top_k is not None:
            vocab = x.shape[-1]
            k = torch.where(self.top_k > 0, self.top_k, vocab).clamp(max=vocab)
            most = vocab if self.most_k is None else min(self.most_k, vocab)
            kth = torch.topk(x, most, dim=-1).values.gather(-1, k[:, None] - 1)
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p is not None:
            sorted_x, order = x.sort(dim=-1, descending=True)
            probs = sorted_x.softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p.
            # A token goes once the mass before it reaches top_p.
            drop = (probs.cumsum(-1) - probs >= self.top_p[:, None]) & (self.top_p[:, None] < 1)
            x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
        return torch.where(overflow[:, None], 1.0, x.softmax(-1)), overflow

    def scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """logits / temperature in float32, each row divided by its temperature as a Python number.

        A tensor of temperatures would round differently on CUDA. There a number divides by
        multiplying with its reciprocal. Dividing by the number keeps a row's draws the same alone
        and in any batch.
        """
        if self.temperature is not None:
            return logits.float() / self.temperature
        x = torch.empty_like(logits, dtype=torch.float32)
        for temperature, rows in self.temperatures:
            x[rows] = logits[rows].float() / temperature
        return x


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top: int) -> tuple[list, list]:
    """Each row's chosen token's log-probability, and each row's `top` best [(id, logprob)].

    Both on the host. They are the model's: log-softmax of the logits, before temperature.
    """
    logprobs = logits.float().log_softmax(-1)
    picked = logprobs.gather(-1, chosen[:, None])[:, 0].tolist()
    if top == 0:
        return picked, [[] for _ in picked]
    values, ids = logprobs.topk(top, dim=-1)
    return picked, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
