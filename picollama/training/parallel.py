"""How the model trains over devices: activation checkpointing, torch.compile, mixed precision, and
FSDP2 per block when there is a process group."""

import warnings

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from model import Transformer
from picollama.config.training import Config


def parallelize(model: Transformer, cfg: Config, mesh, dtype: torch.dtype) -> Transformer:
    """Activation checkpointing, torch.compile and FSDP2 on the plain model, per block. Mixed
    precision is FSDP2's policy: fp32 master weights, sharded, gathered as `dtype` for the forward
    and backward, gradients reduced in fp32 (the same on any device and number of ranks); without a
    group (mesh None), autocast()."""
    if cfg.train.activation_checkpointing:
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    if cfg.train.compile:
        # RoPE's rotations enter each block complex, read through view_as_real (a view): Inductor
        # leaves that op to eager, which costs nothing, and would warn of it in every run
        warnings.filterwarnings("ignore", "Torchinductor does not support code generation for comp")
        # Block by block: the whole model compiled ran 8% faster in one process, but its first
        # compiles took ~40 s longer, more than a 5-minute run wins back
        for block in model.layers:
            block.compile()  # in place: parameter names keep no _orig_mod. prefix
    if mesh is None:
        return autocast(model, dtype)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def autocast(model: Transformer, dtype: torch.dtype) -> Transformer:
    """The model of one process without a group, its weights fp32 and its forward under
    torch.autocast in `dtype` (matrix products in `dtype`; the residual stream stays fp32, where
    FSDP2's policy rounds it: the losses agree within bf16's rounding)."""
    if dtype == torch.float32:
        return model
    forward, device_type = model.forward, next(model.parameters()).device.type

    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward  # one instance's: the class and its state_dict keep theirs
    return model
