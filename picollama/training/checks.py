"""Checks that run before training starts, so a bad run fails at once. They cover memory, the
weights of train.init_from, settings that packed documents refuse, and train.out_dir."""

from dataclasses import replace
from pathlib import Path

import torch

from data.loader import load_meta
from data.tokenizer import tokenizer_file, tokenizer_sha256
from model import ROPE_ATTENTIONS, ModelArgs, Transformer
from picollama.cli import UserError
from picollama.cli.output_place import check_output_place
from picollama.cli.outputs import check_writable
from picollama.config.training import Config, check_init_model
from picollama.device import gib, memory_bytes, pick_device, pick_dtype
from picollama.run_files import load_model


def init_from_weights(cfg: Config) -> tuple[dict | None, ModelArgs]:
    """The weights of the run directory train.init_from, or None, and the model this run trains.
    The source's model must equal model.*, which the config took from it, but for the context
    keys. It must share data.dir's tokenizer. A run that stretches the source's context gets
    rope_original_max_seq_len set to that context, so RoPE scaling and extrapolate start there."""
    source_dir = cfg.train.init_from
    if source_dir is None:
        return None, cfg.model
    check_init_tokenizer(source_dir, cfg.data.dir)
    try:
        source, _ = load_model(source_dir)
    except UserError as e:
        raise UserError(f"train.init_from: {e}") from None
    check_init_model(source_dir, source.args.to_dict(), cfg.model.to_dict())
    original = source.args.original_seq_len
    if cfg.model.rope_original_max_seq_len is None and cfg.model.max_seq_len > original:
        return source.state_dict(), replace(cfg.model, rope_original_max_seq_len=original)
    return source.state_dict(), cfg.model


def check_init_tokenizer(source_dir, data_dir):
    """UserError unless the dataset data_dir holds the tokenizer of the run source_dir. Its token
    ids are the words the weights learned. A dataset train.py prepares itself gets a new one."""
    theirs, ours = tokenizer_file(source_dir), tokenizer_file(data_dir)
    if theirs is None:
        return  # load_model says what the run lacks.
    again = f"make it (again) with --tokenizer {source_dir}"
    if ours is None:
        raise UserError(
            f"train.init_from {source_dir}: data.dir {data_dir} is not prepared; {again}"
        )
    if tokenizer_sha256(theirs) != tokenizer_sha256(ours):
        raise UserError(
            f"data.dir {data_dir} was made with another tokenizer than train.init_from "
            f"{source_dir} (sha256 {tokenizer_sha256(ours)[:12]}, the run's "
            f"{tokenizer_sha256(theirs)[:12]}): its token ids are other words to the model; {again}"
        )


def packs_documents(cfg: Config) -> bool:
    """Whether the run trains on packed documents: data.pack_documents, or conversations."""
    d = cfg.data
    prepared = (Path(d.dir) / "meta.json").is_file()
    conversations = prepared and load_meta(d.dir).get("kind") == "conversations"
    return d.task == "text" and (d.pack_documents or conversations)


def check_packing(cfg: Config):
    """UserError, before any work, for a setting that lets packed documents see each other, or
    gives them positions not their own. Conversation datasets are always packed."""
    if not packs_documents(cfg):
        return
    m, t, d = cfg.model, cfg.train, cfg.data
    windowed = m.rope_scaling in ROPE_ATTENTIONS and m.rope_factor > 1
    scaling = f"model.rope_scaling {m.rope_scaling}"
    refusals = [
        (m.position == "alibi", "model.position alibi", "its bias takes the place of the mask"),
        (m.position == "fox", "model.position fox", "its forget-gate attention takes no mask"),
        (m.ssmax, "model.ssmax", "it scales a query by the keys of the row, not its document's"),
        (windowed, scaling, "its near and far attention branches take no mask"),
        (t.random_positions, "train.random_positions", "positions restart at each document"),
        (d.copy_fraction, "data.copy_fraction", "copies are planted in random windows of text"),
    ]
    for refused, option, why in refusals:
        if refused:
            packed = "data.pack_documents" if d.pack_documents else f"the conversations of {d.dir}"
            raise UserError(f"{option} cannot train on packed documents ({packed}): {why}")


def check_memory(cfg: Config, world_size: int):
    """UserError, before any work, for a model or batch that cannot fit in the device's memory.
    It uses a lower bound. Each parameter takes 12 bytes, sharded over the ranks, for fp32
    weights, gradients and one optimizer moment. Each token of a rank's micro-step takes its fp32
    logits and their gradient. Training adds each block's input, all that activation
    checkpointing keeps."""
    device = pick_device(cfg.train.device)
    memory = memory_bytes(device)
    if memory is None:
        return
    m, t, e = cfg.model, cfg.train, cfg.eval
    with torch.device("meta"):  # Sizes only, no memory.
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


def check_out_dir(cfg: Config):
    """UserError, before any work, unless train.out_dir can be written. It must not lie in the
    run's inputs (data.dir, data.source, train.init_from) or in another command's folder."""
    d, t = cfg.data, cfg.train
    inputs = {"data.dir": d.dir, "data.source": d.source, "train.init_from": t.init_from}
    check_output_place(t.out_dir, inputs, "train.py", flag="train.out_dir")
    check_writable(t.out_dir, inputs=[d.dir], directory=True)
