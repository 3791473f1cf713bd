"""The optimizers and the learning-rate schedules. AdamW trains everything, unless Muon takes the
blocks' matrices."""

import math

import torch

from picollama.config.training import Config


class Optimizers(list):
    """Several optimizers stepped as one. train_state's DCP state dicts take such a list as is."""

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        return {p: state for optimizer in self for p, state in optimizer.state.items()}

    def step(self):
        for optimizer in self:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        for optimizer in self:
            optimizer.zero_grad(set_to_none=set_to_none)


def build_muon(model, cfg: Config) -> torch.optim.Muon | None:
    """With optim.name muon, Muon for the blocks' 2-D matrices, as modded-nanogpt splits them.
    Else None. The schedule scales its learning rate as it scales AdamW's, by the group's lr_scale.
    Under FSDP2 the matrices are DTensors sharded by rows. Newton–Schulz runs on them as DTensor
    ops, which gather what each product needs."""
    o = cfg.optim
    if o.name != "muon":
        return None
    from picollama.training.muon import (
        BatchedMuon,  # torch.optim.Muon needs torch 2.9. AdamW runs without.
    )

    matrices = [p for p in model.layers.parameters() if p.requires_grad and p.ndim == 2]
    muon = BatchedMuon(
        matrices, lr=o.muon_lr, weight_decay=o.weight_decay, momentum=o.muon_momentum
    )
    muon.param_groups[0]["lr_scale"] = o.muon_lr / o.lr
    return muon


def build_optimizer(model, cfg: Config, device: torch.device) -> torch.optim.Optimizer | Optimizers:
    """AdamW with weight decay on matrices only, fused where the device supports it. With optim.name
    muon, Muon takes the blocks' matrices and AdamW the rest (embeddings, output head, norms)."""
    muon = build_muon(model, cfg)
    taken = {id(p) for p in muon.param_groups[0]["params"]} if muon else set()
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    o = cfg.optim
    fused = device.type in ("cuda", "cpu")
    adamw = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused)
    return Optimizers([muon, adamw]) if muon else adamw


def decay_start(cfg: Config) -> int:
    """The step where wsd's decay begins: optim.decay_start, or the last optim.decay_fraction of
    train.max_steps, after the warmup."""
    o = cfg.optim
    if o.decay_start is not None:
        return o.decay_start
    return max(o.warmup_steps, round((1 - o.decay_fraction) * cfg.train.max_steps))


def weight_decay_at(step: int, cfg: Config) -> float:
    """optim.weight_decay, or over a wsd decay its value on a line to optim.final_weight_decay.
    The decay's progress is counted as lr_at counts it."""
    o = cfg.optim
    if o.final_weight_decay is None or step < (start := decay_start(cfg)):
        return o.weight_decay
    progress = (step + 1 - start) / (cfg.train.max_steps - start)
    return o.weight_decay + (o.final_weight_decay - o.weight_decay) * min(progress, 1.0)


def set_weight_decay(optimizer, weight_decay: float):
    """Set weight_decay on each group of matrices, the only ones build_optimizer decays."""
    for group in optimizer.param_groups:
        if any(p.ndim >= 2 for p in group["params"]):
            group["weight_decay"] = weight_decay


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup over warmup_steps, then the schedule. Cosine decays to min_lr at max_steps
    (from step 0). Wsd holds lr until decay_start, then falls as 1 - sqrt of the decay's
    progress, to min_lr at the last step."""
    o = cfg.optim
    total = cfg.train.max_steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "wsd":
        start = decay_start(cfg)
        if step < start:
            return o.lr
        progress = (step + 1 - start) / (total - start)
        return o.min_lr + (o.lr - o.min_lr) * (1 - math.sqrt(min(progress, 1.0)))
    progress = (step - o.warmup_steps) / max(total - o.warmup_steps, 1)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))
