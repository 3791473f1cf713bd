"""Checks of a whole training config, before any work. values.py checks single keys as they are
read. These check how keys fit together."""

from pathlib import Path

from picollama.cli import UserError
from picollama.config.training import Config


def check_config(cfg: Config, world_size: int) -> None:
    """Refuse a config whose batch or context does not fit, and check the rest."""
    t = cfg.train
    m = cfg.model
    if t.batch_size % (t.grad_accum * world_size):
        raise UserError(
            f"train.batch_size ({t.batch_size}) must be divisible by train.grad_accum × ranks "
            f"({t.grad_accum} × {world_size}); change batch_size or grad_accum"
        )
    if t.seq_len > m.max_seq_len:
        raise UserError(
            f"train.seq_len ({t.seq_len}) exceeds the model's context model.max_seq_len "
            f"({m.max_seq_len}); lower train.seq_len or raise model.max_seq_len"
        )
    check_training_options(cfg)
    check_length(cfg)
    if cfg.data.task == "retrieval":
        check_retrieval(cfg)


def check_retrieval(cfg: Config) -> None:
    """Refuse a retrieval task the vocabulary or the row cannot hold. Refuse a sample too, since
    the task has no tokenizer."""
    d = cfg.data
    needed = 1 + d.retrieval_keys + d.retrieval_values
    if cfg.model.vocab_size < needed:
        raise UserError(
            f"model.vocab_size ({cfg.model.vocab_size}) cannot hold the retrieval task's "
            f"1 + {d.retrieval_keys} keys + {d.retrieval_values} values; "
            f"set --model.vocab_size={needed}"
        )
    if d.retrieval_pairs > d.retrieval_keys:
        raise UserError(
            f"data.retrieval_pairs ({d.retrieval_pairs}) exceeds data.retrieval_keys: "
            "keys are distinct"
        )
    if 4 * d.retrieval_pairs > cfg.train.seq_len + 1:
        raise UserError(
            f"train.seq_len ({cfg.train.seq_len}) cannot hold {d.retrieval_pairs} retrieval pairs "
            "and their queries; lower data.retrieval_pairs or raise train.seq_len to "
            f"{4 * d.retrieval_pairs}"
        )
    if cfg.train.sample_tokens:
        raise UserError(
            "data.task retrieval has no tokenizer to sample with; set train.sample_tokens = 0"
        )


def check_training_options(cfg: Config) -> None:
    """Refuse random positions the model cannot use and an init_from run that would be
    overwritten. Refuse a cosine time budget without the warmup steps it times."""
    t = cfg.train
    m = cfg.model
    check_schedule(cfg)
    if t.max_minutes and cfg.optim.schedule == "cosine" and cfg.optim.warmup_steps < 4:
        raise UserError(
            "train.max_minutes needs optim.warmup_steps of 4 or more with optim.schedule cosine "
            f"(not {cfg.optim.warmup_steps}): it times the first warmup steps, whose learning rate "
            "does not depend on the run's length, to size the run"
        )
    if t.random_positions and m.position == "nope":
        raise UserError(
            "train.random_positions needs a position encoding, and model.position nope has none"
        )
    if m.position == "learned" and t.random_positions * t.seq_len > m.max_seq_len:
        raise UserError(
            f"train.random_positions ({t.random_positions}) × train.seq_len ({t.seq_len}) exceeds "
            f"the learned position table model.max_seq_len ({m.max_seq_len}); "
            "raise model.max_seq_len or lower random_positions"
        )
    if t.init_from is not None and Path(t.init_from).resolve() == Path(t.out_dir).resolve():
        raise UserError(
            f"train.init_from ({t.init_from}) must be another run directory than train.out_dir"
        )


def check_schedule(cfg: Config) -> None:
    """Refuse a schedule that decays upward (optim.min_lr above optim.lr), or a final_weight_decay
    without a wsd decay. Refuse a decay_start no wsd decay of train.max_steps can begin at."""
    o = cfg.optim
    if o.min_lr > o.lr:
        raise UserError(
            f"optim.min_lr ({o.min_lr:g}) must be at most optim.lr ({o.lr:g}): the schedule "
            "decays from lr to min_lr"
        )
    if o.final_weight_decay is not None and o.schedule != "wsd":
        problem = f"optim.final_weight_decay applies to optim.schedule wsd, not {o.schedule}"
        raise UserError(problem + " (it rises over the wsd decay)")
    if o.decay_start is None:
        return
    if o.schedule != "wsd":
        raise UserError(f"optim.decay_start applies to optim.schedule wsd, not {o.schedule}")
    if cfg.train.max_minutes:
        raise UserError(
            "optim.decay_start is decided by the train.max_minutes budget; give train.max_steps "
            "with it"
        )
    if cfg.train.epochs:
        raise UserError(
            "optim.decay_start is a step, and train.epochs takes the steps from the data; use "
            "optim.decay_fraction, or give train.max_steps"
        )
    if o.decay_start >= cfg.train.max_steps:
        raise UserError(
            f"optim.decay_start ({o.decay_start}) must be below train.max_steps "
            f"({cfg.train.max_steps})"
        )


def check_length(cfg: Config) -> None:
    """Refuse train.epochs of data that has no end, the retrieval task's. Refuse train.early_stop
    without evaluations that compare: during the run, each reading every batch. Refuse it with
    interval saves, which would replace the best weights the run keeps."""
    t, e = cfg.train, cfg.eval
    if t.epochs and cfg.data.task == "retrieval":
        raise UserError(
            "train.epochs needs a dataset, and data.task retrieval generates its rows without end; "
            "give train.max_steps"
        )
    if not t.early_stop:
        return
    problems = [
        (not e.interval, "eval.interval 0 evaluates at the end alone; set eval.interval"),
        (
            e.interim_batches,
            f"eval.interim_batches ({e.interim_batches}) makes evaluations read other batches "
            "than the last; set it to 0",
        ),
        (
            cfg.checkpoint.interval,
            f"checkpoint.interval ({cfg.checkpoint.interval}) saves would replace the best "
            "weights, which the run saves at each evaluation that improves on them; set it to 0",
        ),
    ]
    for problem, why in problems:
        if problem:
            raise UserError(f"train.early_stop compares the validation losses: {why}")
