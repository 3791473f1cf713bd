"""A training run's data. It checks or prepares the dataset, makes the batches and positions, and
validates."""

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from data.build import prepare
from data.epochs import EpochBatches
from data.loader import SPLITS, RandomBatches, check_token_ids, checked_meta, eval_batches
from data.packing import Documents, PackedBatches, document_mask, validation_batches
from data.retrieval import RetrievalBatches, RetrievalTask, retrieval_metrics
from data.sources import default_name
from data.tokenizer import open_tokenizer, tokenizer_file
from picollama import REPO_ROOT
from picollama.cli import UserError
from picollama.cli.outputs import listed, resolved
from picollama.components.length import length_problem
from picollama.config.training import Config, DataConfig
from picollama.device import Dist

KINDS = ("text", "conversations")  # Dataset kinds train.py reads (meta.json's "kind").
ALL = slice(None)  # Every row of a batch.
VALIDATION_FORMATS = {
    "val_ppl": "perplexity {:.2f}",
    "val_bpb": "{:.4f} bits/byte",
    "val_acc": "accuracy {:.1%}",
}


def check_dataset(cfg: Config):
    """UserError, before any work, unless data.dir is ready or may be prepared.
    Ready means a folder with meta.json. A missing or empty folder is prepared from data.source.
    With the default source, only its own folder may be (data/shakespeare, data/shakespeare-unigram,
    from here or the repository). So a mistyped --data.dir is never filled with Shakespeare. With a
    data.source given, any folder may be."""
    d = cfg.data
    data_dir = Path(d.dir)
    if d.task != "text" or (data_dir / "meta.json").is_file():
        return
    if data_dir.is_file():
        problem = "it is a file"
    elif data_dir.is_dir() and any(data_dir.iterdir()):
        held = listed(sorted(p.name + "/" * p.is_dir() for p in data_dir.iterdir()))
        problem = f"no meta.json; it holds {held}"
    else:
        if d.source != DataConfig.source:
            return
        own_dir = f"data/{default_name(d.source, d.tokenizer_type)}"
        if resolved(data_dir) in {resolved(own_dir), resolved(REPO_ROOT / own_dir)}:
            return
        problem = "it is empty" if data_dir.is_dir() else "it does not exist"
        raise UserError(
            f"data.dir {data_dir} is not a prepared dataset ({problem}); make one with python "
            f"data/prepare.py --source YOUR_TEXT --out {data_dir}, or give --data.source=YOUR_TEXT "
            f"to prepare it here (only {own_dir} is prepared by itself, with Shakespeare)"
        )
    raise UserError(
        f"data.dir {data_dir} is not a prepared dataset ({problem}); make one with python "
        "data/prepare.py --source YOUR_TEXT --out DIR and train with --data.dir=DIR"
    )


def prepare_data(cfg: Config, dist: Dist) -> tuple[Path, dict]:
    """data.dir and its meta.json, checked against cfg. A missing data.dir is prepared from
    data.source, as check_dataset allows."""
    data_dir = Path(cfg.data.dir)
    if not (data_dir / "meta.json").is_file() and dist.main:
        print(f"{data_dir} is not prepared yet: preparing it from {cfg.data.source}")
        vocab_size = cfg.data.vocab_size or cfg.model.vocab_size
        command = ["train.py", "(auto-prepare)"]
        prepare(
            cfg.data.source,
            vocab_size,
            data_dir,
            command=command,
            source_key="data.source",
            tokenizer_type=cfg.data.tokenizer_type,
        )
    dist.barrier()
    meta = checked_meta(data_dir)
    kind = meta.get("kind", "text")
    if kind not in KINDS:
        raise UserError(
            f"{data_dir}/meta.json: a dataset of kind {kind!r}; train.py reads {listed(KINDS)}"
        )
    if meta["vocab_size"] > cfg.model.vocab_size:
        raise UserError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer of "
            f"{data_dir} ({meta['vocab_size']}); set --model.vocab_size={meta['vocab_size']}"
        )
    for split in SPLITS:
        # The shards against meta.json, and their ids against the model's embedding: one pass.
        check_token_ids(data_dir, split, cfg.model.vocab_size)
        tokens = meta["splits"][split]["tokens"]
        if kind == "text" and tokens < cfg.train.seq_len + 1:  # Conversation rows are padded.
            raise UserError(
                f"the {split} split of {data_dir} has {tokens} tokens, too few for train.seq_len "
                f"{cfg.train.seq_len}; lower train.seq_len or use more text"
            )
    return data_dir, meta


def check_sample_fits(cfg: Config, data_dir: Path):
    """UserError, before training, if the final sample (prompt and sample_tokens) is too long."""
    t = cfg.train
    if not t.sample_tokens:
        return
    tokenizer = open_tokenizer(tokenizer_file(data_dir) or data_dir / "tokenizer.model")
    prompt = 1 + len(tokenizer.encode(t.sample_prompt))  # BOS and the prompt, as generate.py has.
    problem = length_problem(cfg.model, prompt + t.sample_tokens)
    if problem:
        raise UserError(
            f"train.sample_tokens ({t.sample_tokens}) and the prompt ({prompt} tokens): {problem}; "
            "lower train.sample_tokens"
        )


def mean_loss(model, batches: list, dist: Dist, grad: bool = False) -> float:
    """The mean loss over every target (y not -100) of the batches, shared out over the ranks.
    A batch is (x, y), or (x, y, positions) for packed rows. `grad` runs it in grad mode (see
    data_source)."""
    per_rank = math.ceil(len(batches) / dist.world_size)
    totals = torch.zeros(2, dtype=torch.float64, device=dist.device)
    with torch.enable_grad() if grad else torch.no_grad():
        for i in range(per_rank):
            index = i * dist.world_size + dist.rank
            # Ranks without a batch still join FSDP's collectives.
            batch = padded(batches[min(index, len(batches) - 1)], len(batches[0][0]))
            x, y, inputs = model_inputs(batch, ALL, dist.device)
            loss = model(x, y, **inputs)
            if index < len(batches):
                count = (y != -100).sum()
                totals += torch.stack([loss.detach().double() * count, count])
    loss_sum, count = dist.all_reduce_sum(totals).tolist()
    return loss_sum / count


def padded(batch: tuple, rows: int) -> tuple:
    """The batch grown to `rows` rows by copies of its first row, with all targets ignored. So a
    short last batch has the shape the compiled model has seen, with nothing new to compile."""
    short = rows - len(batch[0])
    if short <= 0:
        return batch
    extra = [part[:1].expand(short, *part.shape[1:]) for part in batch]
    extra[1] = torch.full_like(extra[1], -100)
    return tuple(torch.cat(pair) for pair in zip(batch, extra, strict=True))


def evaluate(model, batches: list, meta: dict, dist: Dist, grad: bool = False) -> dict:
    """Validation loss, perplexity and bits/byte over the batches, over ranks. Bits/byte uses the
    split's bytes per token. `grad` is as for mean_loss."""
    loss = mean_loss(model, batches, dist, grad)
    bits_per_byte = loss / math.log(2) / meta["bytes_per_token"]
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700)), "val_bpb": bits_per_byte}


def held_out_metrics(model, batches: list, dist: Dist) -> dict:
    """Validation loss and perplexity on the supervised (assistant) tokens of packed rows."""
    loss = mean_loss(model, batches, dist)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700))}


def spread(batches: list, count: int) -> list:
    """`count` of the batches, evenly spaced from the first. All of them where count is 0 or
    more than there are."""
    if not 0 < count < len(batches):
        return batches
    return [batches[i * len(batches) // count] for i in range(count)]


@dataclass
class DataSource:
    loader: object  # Has next_batch(), state_dict(), load_state_dict().
    validate: Callable[..., dict]  # Maps (model, batches) to metrics such as val_loss.
    val_batches: list  # The first eval.batches validation batches, (x, y) or packed rows.
    tokenizer: Path | None  # The tokenizer saved with the model. None if the task has none.
    line: str  # What the data is, in one line.


def data_source(cfg: Config, dist: Dist) -> DataSource:
    """The batches and validation of data.task: a prepared dataset, or the retrieval task."""
    t, d, e = cfg.train, cfg.data, cfg.eval
    if d.task == "retrieval":
        task = RetrievalTask(d.retrieval_keys, d.retrieval_values, d.retrieval_pairs)
        batches = task.fixed_batches(e.batches, e.batch_size, t.seq_len)
        loader = RetrievalBatches(
            task, t.batch_size, t.seq_len, seed=t.seed, filler=d.retrieval_filler
        )
        validate = partial(retrieval_metrics, device=dist.device)
        sizes = f"{task.pairs} pairs of {task.keys} keys and {task.values} values"
        line = f"data: retrieval task ({sizes})"
        return DataSource(loader, validate, batches, None, line)
    data_dir, meta = prepare_data(cfg, dist)
    check_sample_fits(cfg, data_dir)
    tokenizer = tokenizer_file(data_dir) or data_dir / "tokenizer.model"
    if meta.get("kind") == "conversations":
        check_kept(meta, data_dir, t.seq_len)
        return conversations_source(cfg, data_dir, tokenizer, dist)
    if d.pack_documents:
        documents = Documents(data_dir, "train", t.seq_len + 1, conversations=False)
        loader = PackedBatches(documents, t.batch_size, t.seq_len, seed=t.seed)
    else:
        batches = EpochBatches if d.sampling == "epochs" else RandomBatches
        loader = batches(
            data_dir, "train", t.batch_size, t.seq_len, seed=t.seed, **d.copy_options()
        )
    batches = list(eval_batches(data_dir, "val", e.batch_size, t.seq_len, e.batches))
    # Compiled blocks compile a second graph for no_grad. That cost 4.6 s of a 5-minute run's
    # first evaluation on a 2-core Zen 4. So batches the shape of a training micro-batch run in
    # grad mode, through the training graph. One process only, since FSDP2 then expects a backward.
    grad = t.compile and dist.world_size == 1 and e.batch_size * t.grad_accum == t.batch_size
    validate = partial(evaluate, meta=meta, dist=dist, grad=grad)
    packed = ", documents packed" if d.pack_documents else ""
    line = f"data {data_dir} ({meta['splits']['train']['tokens']:,} train tokens{packed})"
    return DataSource(loader, validate, batches, tokenizer, line)


def check_kept(meta: dict, data_dir: Path, seq_len: int):
    """UserError where a row could hold a whole conversation that preparation kept to its first
    inputs.keep_tokens tokens: training would take it for whole, and not count it as cut."""
    inputs = meta.get("inputs") if isinstance(meta.get("inputs"), dict) else {}
    keep, kept = inputs.get("keep_tokens"), meta.get("conversations_at_keep")
    if isinstance(keep, int) and kept and seq_len + 1 >= keep:
        raise UserError(
            f"{data_dir} keeps {kept:,} conversation(s) to their first {keep:,} tokens (prepared "
            f"for a context of {keep - 2:,}), which a row of train.seq_len + 1 = {seq_len + 1} "
            f"tokens would take for whole; prepare it again with --context {seq_len} or more"
        )


def conversations_source(cfg: Config, data_dir: Path, tokenizer: Path, dist: Dist) -> DataSource:
    """A conversations dataset's training conversations, packed into rows (PackedBatches). Its
    validation is the loss on the assistant tokens of the held-out conversations, packed alike."""
    t, e = cfg.train, cfg.eval
    train, val = (Documents(data_dir, split, t.seq_len + 1, conversations=True) for split in SPLITS)
    loader = PackedBatches(train, t.batch_size, t.seq_len, seed=t.seed)
    batches = validation_batches(val, e.batch_size, t.seq_len, e.batches)
    validate = partial(held_out_metrics, dist=dist)
    line = f"data {data_dir} ({train.documents:,} conversations, {val.documents:,} held out"
    if train.cut or val.cut:
        # Said once. A row holds a conversation's first seq_len + 1 tokens, never a later part.
        line += (
            f"; {train.cut + val.cut:,} longer than a row of train.seq_len + 1 = {t.seq_len + 1} "
            f"tokens cut to it, {train.dropped + val.dropped:,} of them left out for want of an "
            "assistant token there"
        )
    return DataSource(loader, validate, batches, tokenizer, line + ")")


def epoch_length(cfg: Config, loader) -> tuple[int, int, str]:
    """train.max_steps for train.epochs passes over the training split, its warmup steps, and what
    that is, said. A pass is the rows of packed conversations or documents (the first pass's:
    each packs its own shuffle, within a row or so of it), else the split's windows of seq_len +
    1 tokens. The count is rounded up, so each row is drawn train.epochs times at least. The
    warmup is optim.warmup_steps, or a tenth of the run where that is shorter: a few dozen
    conversations make a few steps, and the learning rate must reach optim.lr."""
    t, warmup = cfg.train, cfg.optim.warmup_steps
    if isinstance(loader, PackedBatches):
        documents, rows = loader.documents, len(loader.rows)
        if documents.supervised is not None:  # Conversations, those with a reply in a row.
            what = f"{len(documents):,} conversations"
        else:
            what = f"{documents.documents:,} documents"
    else:
        what, rows = f"{len(loader.tokens):,} tokens", (len(loader.tokens) - 1) // t.seq_len
    steps = math.ceil(round(t.epochs * rows / t.batch_size, 9))
    passes = f"{t.epochs:g} epoch{'' if t.epochs == 1 else 's'}"
    sized = (
        f"{passes} of {what} ({rows:,} rows of {t.seq_len} tokens an epoch): {steps:,} steps of "
        f"{t.batch_size} rows"
    )
    if warmup > (tenth := math.ceil(steps / 10)):
        warmup = tenth
        sized += f", warming up over {warmup} (optim.warmup_steps is {cfg.optim.warmup_steps})"
    return steps, warmup, sized


def random_positions(batch: int, seq_len: int, k: int) -> torch.Tensor:
    """Randomized positions (Ruoss et al. 2023), (batch, seq_len) int64. Each row is a sorted
    random subset of seq_len distinct positions from [0, k·seq_len). torch's global generator
    draws them, seeded and checkpointed."""
    return torch.rand(batch, k * seq_len).topk(seq_len, dim=1).indices.sort(dim=1).values


def model_inputs(batch: tuple, rows: slice, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(x, y, inputs) for the rows of a batch, on the device. A batch is (x, y), or (x, y,
    positions) for packed rows. inputs are then the positions and their document mask."""
    x, y = (part[rows].to(device) for part in batch[:2])
    if len(batch) == 2:
        return x, y, {}
    positions = batch[2][rows].to(device)
    return x, y, {"positions": positions, "mask": document_mask(positions)}


def next_rows(loader, cfg: Config, rows: slice, device: torch.device):
    """(x, y, inputs, targets) for this rank's rows of the next global batch, on the device.
    inputs are model_inputs', or random positions where train.random_positions is on. targets
    counts the targets (y not -100) in the whole global batch."""
    t = cfg.train
    batch = loader.next_batch()
    targets = int((batch[1] != -100).sum())  # Counted on the CPU, so no device sync.
    x, y, inputs = model_inputs(batch, rows, device)
    if t.random_positions:
        # Drawn for the global batch, as the data is. So they match on any number of ranks.
        positions = random_positions(t.batch_size, t.seq_len, t.random_positions)
        inputs = {"positions": positions[rows].to(device)}
    return x, y, inputs, targets
