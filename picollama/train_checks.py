"""Before a run trains: the memory check's lower bound, and train.init_from's weights checked."""

from dataclasses import replace

import torch

from data.tokenizer import tokenizer_file, tokenizer_sha256
from model import ModelArgs, Transformer
from picollama.cli import UserError
from picollama.config import Config, check_init_model
from picollama.device import gib, memory_bytes, pick_device, pick_dtype
from picollama.run_files import load_model


def init_from_weights(cfg: Config) -> tuple[dict | None, ModelArgs]:
    """The weights of the run directory train.init_from (None without one), whose model must equal
    model.* (which config.py took from it) but for the context keys and share data.dir's
    tokenizer, and the model this run trains: model.*, where a run that stretches the source's
    context gets rope_original_max_seq_len = that context, so that RoPE scaling and extrapolate
    stretch from it."""
    source_dir = cfg.train.init_from
    if source_dir is None:
        return None, cfg.model
    try:
        source, _ = load_model(source_dir)
    except UserError as e:
        raise UserError(f"train.init_from: {e}") from None
    check_init_model(source_dir, source.args.to_dict(), cfg.model.to_dict())
    theirs, ours = tokenizer_file(source_dir), tokenizer_file(cfg.data.dir)
    if theirs and ours and tokenizer_sha256(theirs) != tokenizer_sha256(ours):
        raise UserError(f"train.init_from {source_dir} has another tokenizer than {cfg.data.dir}")
    original = source.args.original_seq_len
    if cfg.model.rope_original_max_seq_len is None and cfg.model.max_seq_len > original:
        return source.state_dict(), replace(cfg.model, rope_original_max_seq_len=original)
    return source.state_dict(), cfg.model


def check_memory(cfg: Config, world_size: int):
    """UserError, before any work, for a model or batch that cannot fit in the device's memory, by
    a lower bound: 12 bytes a parameter (fp32 weights, gradients and one optimizer moment; sharded
    over the ranks) and, per token of a rank's micro-step, the logits and their gradient in fp32
    and, in training, each block's input (all that activation checkpointing keeps)."""
    device = pick_device(cfg.train.device)
    memory = memory_bytes(device)
    if memory is None:
        return
    m, t, e = cfg.model, cfg.train, cfg.eval
    with torch.device("meta"):  # sizes only, no memory
        params = Transformer(m).num_params()
    state = 12 * params // world_size
    logits = 8 * m.vocab_size
    blocks = m.n_layers * m.dim * pick_dtype(t.dtype, device).itemsize
    ranks = f" on each of {world_size} ranks" if world_size > 1 else ""
    train_rows = t.batch_size // (t.grad_accum * world_size)
    for key, size, rows, per_token in [
        ("train.batch_size", t.batch_size, train_rows, logits + blocks),
        ("eval.batch_size", e.batch_size, e.batch_size, logits),
    ]:
        activations = rows * t.seq_len * per_token
        if state + activations <= memory:
            continue
        fits = (memory - state) // (t.seq_len * per_token)
        if fits < 1:
            raise UserError(
                f"the model ({params:,} parameters) cannot fit in memory: its weights, gradients "
                f"and optimizer state and one sequence of {t.seq_len} tokens need at least "
                f"{gib(state + t.seq_len * per_token)}{ranks}, and {device.type} memory is "
                f"{gib(memory)}; choose a smaller model or train.seq_len"
            )
        more = " or raise train.grad_accum" if key.startswith("train") else ""
        raise UserError(
            f"{key} {size:,} cannot fit in memory: {rows:,} sequences of {t.seq_len} tokens at "
            f"once{ranks} need at least {gib(activations)} for their logits and activations, "
            f"beside {gib(state)} for the weights and optimizer state, and {device.type} memory "
            f"is {gib(memory)}: at most {fits:,} fit; lower {key}{more}"
        )
