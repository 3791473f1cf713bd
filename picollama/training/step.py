"""The model train.py builds, and one optimizer step on it with loss, micro-batches and clipping.
It lives here, not in train.py, so the lab's CPU step benchmark times the same step."""

import functools
import random

import numpy as np
import torch
import torch.nn.functional as F

from model import Transformer
from picollama.cli import UserError
from picollama.config.training import Config
from picollama.device import Dist, pick_dtype
from picollama.training.dropout import add_dropout
from picollama.training.optim import build_optimizer
from picollama.training.parallel import parallelize


def build_model(
    cfg: Config, dist: Dist, init: dict | None = None
) -> tuple[Transformer, torch.optim.Optimizer, str]:
    """The parallelized model, its optimizer, and a line of its parameters (all, and on rank 0)
    and precision. The initial weights are `init`'s, or the same on any device and world size."""
    if dist.device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    # Initialised on the CPU generator first, so the weights match anywhere.
    model = Transformer(cfg.model).to(dist.device)
    if init is not None:
        model.load_state_dict(init)
    num_params = model.num_params()
    dtype = pick_dtype(cfg.train.dtype, dist.device)
    if dist.device.type == "mps" and dtype != torch.float32:
        problem = f"train.dtype {cfg.train.dtype} on mps"
        raise UserError(f"{problem}: picollama trains on Apple's GPU in fp32 only; use float32")
    add_dropout(model, cfg.train.dropout)
    model = parallelize(model, cfg, dist.mesh, dtype)
    local_params = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()
    )
    sizes = f"{num_params:,} parameters, {local_params:,} stored on rank 0 of {dist.world_size}"
    precision = "fp32" if dtype == torch.float32 else f"{str(dtype)[6:]} with fp32 master weights"
    return model, build_optimizer(model, cfg, dist.device), f"{sizes}; {precision}"


def seed_everything(seed: int):
    """Seed Python's, numpy's and torch's generators (a resumed run restores their states)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def logit_terms(logits, y, z_loss: float) -> dict[str, torch.Tensor]:
    """The mean cross-entropy of y's targets in fp32 as "loss", ignoring -100. With z_loss > 0,
    also z_loss·mean(logsumexp(logits)²) as "z_loss". PaLM's keeps the softmax normaliser near 1."""
    logits = logits.float()
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    if not z_loss:
        return {"loss": loss}
    return {"loss": loss, "z_loss": z_loss * logits.logsumexp(-1).square().mean()}


@functools.cache
def compiled_logit_terms():
    """logit_terms compiled, made when first asked for, since the compiler takes seconds to import.
    With train.compile the loss is compiled along with the blocks. The (tokens, vocab) logits' fp32
    copy, softmax and gradient were a quarter of the default's CPU step with compiled blocks."""
    return torch.compile(logit_terms)


def loss_terms(
    model, x, y, inputs: dict | None, z_loss: float, compiled: bool = False
) -> dict[str, torch.Tensor]:
    """One micro-batch's loss terms, by logit_terms or its compiled version. `inputs`: the model's
    other arguments (positions, a mask)."""
    terms = compiled_logit_terms() if compiled else logit_terms
    return terms(model(x, **(inputs or {})), y, z_loss)


def micro_batches(x, y, inputs: dict, accum: int) -> list[tuple]:
    """(x, y, inputs) of each of `accum` micro-batches: the rows cut alike."""
    cut = {name: value.chunk(accum) for name, value in inputs.items()}
    parts = zip(x.chunk(accum), y.chunk(accum), strict=True)
    return [(xm, ym, {name: c[i] for name, c in cut.items()}) for i, (xm, ym) in enumerate(parts)]


def train_step(
    model, optimizer, x, y, lr: float, cfg: Config, dist: Dist, inputs=None, targets=None
):
    """One optimizer step on this rank's rows of the global batch, in train.grad_accum micro-steps.
    `inputs` holds the model's other arguments, such as positions and a mask. The loss is the mean
    over the `targets` targets (y not -100) of the whole global batch, or of this y with None. It
    is not a mean of micro-batch means, since each micro-batch weighs by its targets.

    Returns (losses, grad_norm, applied). losses holds each loss term as it entered the gradient.
    Its mean over the ranks is the step's. grad_norm is the global gradient norm. Both stay on the
    device. applied is False when a loss or the gradient norm is NaN or infinite."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    accum = cfg.train.grad_accum
    targets = targets or int((y != -100).sum())
    losses = {}
    for micro, (xm, ym, im) in enumerate(micro_batches(x, y, inputs or {}, accum)):
        if hasattr(model, "set_requires_gradient_sync"):
            # FSDP2 reduces gradients on the last micro-step only.
            model.set_requires_gradient_sync(micro == accum - 1)
        terms = loss_terms(model, xm, ym, im, cfg.optim.z_loss, cfg.train.compile)
        # This micro-batch's mean, times its share of the global batch's targets, times the ranks.
        # That is exactly 1 for a whole batch in one process. The ranks factor undoes FSDP2's
        # average over ranks. A micro-batch without targets would be NaN. Packed rows hold at
        # least one each, windows many.
        share = (ym != -100).sum() * dist.world_size / targets
        weights = {name: share if name == "loss" else 1 / accum for name in terms}
        sum(term * weights[name] for name, term in terms.items()).backward()
        for name, term in terms.items():
            losses[name] = losses.get(name, 0) + term.detach() * weights[name]
    max_norm = cfg.optim.grad_clip or float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    # The one host sync of every step, free on CPU and a short stall on GPU. The gradient norm is
    # global already. The loss is this rank's, so it joins through a sum over ranks. So all ranks
    # skip the update together.
    applied = bool(torch.isfinite(dist.all_reduce_sum(sum(losses.values()).clone()) + grad_norm))
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses, grad_norm, applied
