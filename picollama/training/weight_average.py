"""An exponential moving average of the weights over the decay phase of training. It is evaluated
and saved in place of the last weights. This is Polyak averaging, as in the slowrun record's EMA."""

from contextlib import contextmanager, nullcontext

import torch


class WeightAverage:
    """avg ← beta·avg + (1-beta)·weights after each step from `start` on (wsd: the decay's first
    step). It is fp32 beside the weights, each rank's DTensor shards under FSDP2."""

    def __init__(self, model: torch.nn.Module, beta: float):
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names, self.params = [name for name, _ in named], [p for _, p in named]
        self.beta = beta
        self.average: list[torch.Tensor] | None = None

    def update(self, step: int, start: int):
        """Average the weights of `step` (steps done) if the average runs from `start` on."""
        if step < start:
            return
        with torch.no_grad():
            if self.average is None:
                self.average = [p.detach().clone() for p in self.params]
            else:
                torch._foreach_lerp_(self.average, [p.detach() for p in self.params], 1 - self.beta)

    def state_dict(self) -> dict:
        """{parameter name: its average} for a checkpoint ({} before the average begins)."""
        return dict(zip(self.names, self.average or [], strict=False))

    def template(self) -> dict:
        """A state_dict to load a checkpoint's average into (DCP loads in place)."""
        return {name: p.detach().clone() for name, p in zip(self.names, self.params, strict=True)}

    def load_state_dict(self, state: dict):
        self.average = [state[name] for name in self.names]

    @contextmanager
    def applied(self):
        """The average in the model's parameters (if begun), the weights back after."""
        if self.average is None:
            yield
            return
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            for p, a in zip(self.params, self.average, strict=True):
                p.copy_(a)  # DTensors have no sharding rule for _foreach_copy_
        try:
            yield
        finally:
            with torch.no_grad():
                for p, k in zip(self.params, kept, strict=True):
                    p.copy_(k)


def averaged(average: WeightAverage | None):
    """average.applied(), or nothing where there is no average."""
    return nullcontext() if average is None else average.applied()
