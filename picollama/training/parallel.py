"""How the model is set up to train on its devices: activation checkpointing, torch.compile and
mixed precision. With a process group, FSDP2 also shards each block."""

import warnings

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from model import Transformer
from picollama.config.training import Config


def parallelize(model: Transformer, cfg: Config, mesh, dtype: torch.dtype) -> Transformer:
    """Activation checkpointing, torch.compile and FSDP2 on the plain model, per block. Mixed
    precision is FSDP2's policy: fp32 master weights, sharded, gathered as `dtype` for the forward
    and backward. Gradients are reduced in fp32, the same on any device and number of ranks.
    Without a group (mesh None) it is autocast()."""
    if cfg.train.activation_checkpointing:
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    if cfg.train.compile:
        # RoPE's rotations enter each block as complex numbers, read through view_as_real.
        # Inductor leaves that view to eager mode, which costs nothing, but warns every run.
        warnings.filterwarnings("ignore", "Torchinductor does not support code generation for comp")
        # Block by block. The whole model compiled ran 8% faster in one process. But its first
        # compiles took ~40 s longer, more than a 5-minute run wins back.
        for block in model.layers:
            block.compile()  # In place, so parameter names get no _orig_mod. prefix.
    if mesh is None:
        return autocast(model, dtype)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def autocast(model: Transformer, dtype: torch.dtype) -> Transformer:
    """The model of one process without a group: fp32 weights, its forward under torch.autocast
    in `dtype`. Matrix products run in `dtype`, the residual stream in fp32, where FSDP2's policy
    rounds it. The losses agree within bf16's rounding."""
    if dtype == torch.float32:
        return model
    forward, device_type = model.forward, next(model.parameters()).device.type

    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    model.forward = autocast_forward  # This instance only. The class and state_dict keep theirs.
    return model
