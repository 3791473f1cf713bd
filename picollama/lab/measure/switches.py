"""Measure the seed lectures' architecture table, or the data-limited quality candidates.

train.py trains each switch from a config, one at a time, for the same wall-clock budget at each
seed. The table gives parameters, tokens/s, final validation bits/byte (mean and spread) and
whether training was stable."""

import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from data.build import prepare
from model import Transformer
from picollama import REPO_ROOT
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import comma_list, positive
from picollama.config.training import parse_cli
from picollama.lab.bench import common

# Name -> train.py overrides. The first is the baseline every switch is compared with.
SWITCHES = {
    "llama": [],  # The config as it is: rmsnorm, pre-norm, serial block, swiglu.
    "layernorm": ["--model.norm=layernorm"],
    "post-norm": ["--model.norm_placement=post"],
    "sandwich norm": ["--model.norm_placement=sandwich"],
    "parallel block": ["--model.parallel_block=true"],
    "geglu": ["--model.activation=geglu"],
    "reglu": ["--model.activation=reglu"],
    "gelu": ["--model.activation=gelu"],
    "relu": ["--model.activation=relu"],
    "relu2": ["--model.activation=relu2"],
    "qk-norm": ["--model.qk_norm=true"],
    "logit soft-cap 30": ["--model.logit_softcap=30"],
    "z-loss 1e-4": ["--optim.z_loss=1e-4"],
}
# The quality table (--table quality). It holds what small-model records found in the default
# run's data-limited regime, 2-3 passes over its 1.6 M training tokens. Each is measured at three
# seeds before configs/default.toml adopts it (docs/findings.md). The default adopted
# torch.compile, and shuffled epochs with a weight average. "random windows, no average" takes
# those off again.
QUALITY = {
    "default": [],
    "eager": ["--train.compile=false"],  # Changes a step's cost. Compare with --minutes.
    "random windows, no average": ["--data.sampling=random", "--train.weight_average=0"],
    "random windows": ["--data.sampling=random"],
    "no weight average": ["--train.weight_average=0"],
    "no attention gate": ["--model.attention_gate=false"],  # Also a step's cost, as "eager".
    "final weight decay 0.9": ["--optim.final_weight_decay=0.9"],
    "dropout 0.1": ["--train.dropout=0.1"],
    "tied embeddings": ["--model.tie_embeddings=true"],
    "weight decay 0.3": ["--optim.weight_decay=0.3"],
    "weight decay 0.03": ["--optim.weight_decay=0.03"],
    "decay 0.2": ["--optim.decay_fraction=0.2"],
    "decay 0.4": ["--optim.decay_fraction=0.4"],
    "qk-norm": ["--model.qk_norm=true"],
    "muon lr 0.01": ["--optim.muon_lr=0.01"],
    "muon lr 0.02": ["--optim.muon_lr=0.02"],
    "muon lr 0.03": ["--optim.muon_lr=0.03"],
    "muon 0.02, decay 0.2": ["--optim.muon_lr=0.02", "--optim.decay_fraction=0.2"],
    "decay 0.5": ["--optim.decay_fraction=0.5"],
    "muon momentum 0.9": ["--optim.muon_momentum=0.9"],
    "adamw lr 0.02": ["--optim.lr=2e-2", "--optim.min_lr=2e-3"],
    "adamw lr 0.005": ["--optim.lr=5e-3", "--optim.min_lr=5e-4"],
    "min lr 1e-4": ["--optim.min_lr=1e-4"],
    "warmup 100": ["--optim.warmup_steps=100"],
    "no clipping": ["--optim.grad_clip=0"],
    "weight decay 0.05": ["--optim.weight_decay=0.05"],
    "z-loss 1e-4": ["--optim.z_loss=1e-4"],
    "weight average 0.98": ["--train.weight_average=0.98"],
    "weight average 0.995": ["--train.weight_average=0.995"],
    "4 heads": ["--model.n_heads=4"],
    "weight decay 0.2": ["--optim.weight_decay=0.2"],
    "adamw beta2 0.99": ["--optim.beta2=0.99"],
    "ffn 512": ["--model.ffn_hidden_dim=512"],
    "ffn 768": ["--model.ffn_hidden_dim=768"],
    "rope on half of each head": ["--model.rope_fraction=0.5"],
    "rope theta 1000": ["--model.rope_theta=1000"],
    "rope theta 50000": ["--model.rope_theta=50000"],
    "min lr 2e-3": ["--optim.min_lr=2e-3"],
    "min lr 3e-3": ["--optim.min_lr=3e-3"],
    "weight decay 0.2, min lr 3e-3": ["--optim.weight_decay=0.2", "--optim.min_lr=3e-3"],
    # These change a step's cost. Compare with --minutes, or --steps in the ratio of tokens/s.
    "batch 8": ["--train.batch_size=8"],
    "batch 32": ["--train.batch_size=32"],
    "6 layers": ["--model.n_layers=6"],
    "dim 160": ["--model.dim=160"],
    "dim 192, 2 heads": ["--model.dim=192"],
    "ffn 1024": ["--model.ffn_hidden_dim=1024"],  # 1.5x a step's time at 5 minutes.
    # The default's unigram tokenizer at other sizes. BPE ones were measured too
    # (docs/findings.md). Smaller vocabularies make more held-out tokens, so eval.batches rises.
    "vocab 2048": [
        "--model.vocab_size=2048",
        "--data.dir=data/shakespeare-unigram-2048",
        "--eval.batches=48",
    ],
    "vocab 1024": [
        "--model.vocab_size=1024",
        "--data.dir=data/shakespeare-unigram-1024",
        "--eval.batches=48",
    ],
    "vocab 8192": ["--model.vocab_size=8192", "--data.dir=data/shakespeare-unigram-8192"],
    "vocab 8192, tied": [
        "--model.vocab_size=8192",
        "--data.dir=data/shakespeare-unigram-8192",
        "--model.tie_embeddings=true",
    ],
    "bpe tokenizer": ["--data.tokenizer_type=bpe", "--data.dir=data/shakespeare"],
}
TABLES = {"switches": SWITCHES, "quality": QUALITY}
OPTIMIZERS = ("adamw", "muon")  # The table also trains the optimizer the config does not use.
QUIET = ["--eval.interval=0", "--checkpoint.interval=0", "--train.sample_tokens=0"]
PROBE_STEPS = 12
# --smoke takes seconds, not minutes. It once trained the config's model 28 times, for 5
# minutes. Now it runs the baseline and one switch on a tiny model, SMOKE_STEPS steps each,
# with no probe.
SMOKE_SWITCHES = ["llama", "qk-norm"]
SMOKE_MODEL = [
    *("--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--train.batch_size=2"),
    *("--train.seq_len=32", "--eval.batches=1", "--eval.batch_size=2"),
]
SMOKE_STEPS = 3


def train(config: str, overrides: list[str], out_dir: Path) -> list[dict]:
    """Run train.py and return its metrics.jsonl entries, then {"failed": its last stderr line} if
    it failed."""
    command = [
        sys.executable,
        "train.py",
        "--config",
        config,
        f"--train.out_dir={out_dir}",
        *QUIET,
        *overrides,
    ]
    done = subprocess.run(command, cwd=common.REPO_ROOT, capture_output=True, text=True)
    metrics = out_dir / "metrics.jsonl"
    entries = (
        [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return [*entries, {"failed": last}]
    return entries


def stability(entries: list[dict]) -> str:
    """'stable', 'spikes' or the error.

    A spike is a logged loss more than 1 nat above the best so far, past the first tenth."""
    if entries and "failed" in entries[-1]:
        return entries[-1]["failed"].removeprefix("error: ")
    losses = [e["loss"] for e in entries if "loss" in e]
    best = math.inf
    for i, loss in enumerate(losses):
        if i > len(losses) // 10 and loss > best + 1.0:
            return "spikes"
        best = min(best, loss)
    return "stable"


def steps_for(config: str, seeded: list[str], budget: float, tmp: Path) -> int | dict:
    """The steps `budget` seconds of training buy, from a short probe run's throughput (or the
    probe's stability, if it failed)."""
    cfg, _ = parse_cli(["--config", config, *seeded])
    probe = train(
        config, [*seeded, f"--train.max_steps={PROBE_STEPS}", "--train.log_interval=1"], tmp
    )
    rates = [e["tokens_per_s"] for e in probe if "tokens_per_s" in e][2:]  # Warmed up.
    if not rates:
        return {"stability": stability(probe)}
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    return max(int(budget * statistics.median(rates) / tokens_per_step), 1)


def run_switch(config: str, overrides: list[str], seed: int, args, tmp: Path) -> dict:
    """Train the switch for --minutes of train.py's own budget, or for --steps steps.

    With --budget, a probe's throughput says how many steps those seconds buy. --smoke trains
    SMOKE_STEPS steps."""
    cfg, _ = parse_cli(["--config", config, *overrides])
    with torch.device("meta"):
        params = Transformer(cfg.model).num_params()
    seeded = [*overrides, f"--train.seed={seed}"]
    if args.minutes:
        length = [f"--train.max_minutes={args.minutes:g}"]
    elif args.steps:
        length = [f"--train.max_steps={args.steps}"]
    else:
        steps = SMOKE_STEPS if args.smoke else steps_for(config, seeded, args.budget, tmp / "probe")
        if isinstance(steps, dict):
            return {"params": params, **steps}
        warmup = min(cfg.optim.warmup_steps, steps // 10)
        length = [f"--train.max_steps={steps}", f"--optim.warmup_steps={warmup}"]
    entries = train(config, [*seeded, *length], tmp / "run")
    bpb = [e["val_bpb"] for e in entries if "val_bpb" in e]
    tokens_per_s = [e["tokens_per_s"] for e in entries if "tokens_per_s" in e]
    return {
        "params": params,
        "steps": max((e["step"] for e in entries if "step" in e), default=0),
        "tokens_per_s": statistics.median(tokens_per_s) if tokens_per_s else None,
        "val_bpb": bpb[-1] if bpb else None,
        "stability": stability(entries),
    }


def prepare_data(config: str, overrides: list[str]):
    """Prepare the switch's dataset, for another vocabulary or tokenizer, before any timing.

    Otherwise train.py would prepare it inside the first seed's budget."""
    cfg, _ = parse_cli(["--config", config, *overrides])
    data_dir = common.REPO_ROOT / cfg.data.dir  # As train.py sees it, from the repository.
    if not (data_dir / "meta.json").is_file():
        vocab_size = cfg.data.vocab_size or cfg.model.vocab_size
        kind = cfg.data.tokenizer_type
        prepare(cfg.data.source, vocab_size, data_dir, command=["switches"], tokenizer_type=kind)


def parse_args(argv: list[str]):
    p = common.parser(__doc__, "switches", models=False)
    p.add_argument(
        "--config", default="configs/default.toml", help="the config every switch starts from"
    )
    p.add_argument(
        "--budget", type=positive(float), default=90.0, help="training seconds per run (default 90)"
    )
    p.add_argument(
        "--minutes",
        type=positive(float),
        help="train each run for train.max_minutes of its own (as python train.py does) in place "
        "of --budget's probe-sized steps",
    )
    p.add_argument(
        "--steps",
        type=positive(),
        help="train each run for this many steps (the config's warmup) in place of --budget: "
        "equal steps, for switches that leave a step's cost alone, free of the machine's speed",
    )
    p.add_argument("--table", choices=TABLES, default="switches", help="what to measure")
    p.add_argument(
        "--seeds",
        type=comma_list(positive(zero=True)),
        default="0",
        help="train.seed of each run, comma-separated (default 0)",
    )
    p.add_argument(
        "--only",
        type=comma_list(choices=[*SWITCHES, *QUALITY, *OPTIMIZERS]),
        help="comma-separated switches of --table (default: all; the switches table also trains "
        "the optimizer the config does not use)",
    )
    args = common.parse(p, argv)
    lengths = [f"--{name}" for name in ("budget", "minutes", "steps") if name in p.given]
    if len(lengths) > 1:
        raise UserError(f"{' and '.join(lengths)} each set a run's length: give one")
    # train.py runs in the repository. The default is a path there, a given one the caller's.
    given = "config" in p.given
    args.config_file = str(Path(args.config).absolute() if given else REPO_ROOT / args.config)
    return args


def run_switches(args, switches: dict, names: list[str]) -> dict:
    """{switch: its overrides, its run_switch of each seed, their mean and spread of val_bpb}."""
    results = {}
    with (
        tempfile.TemporaryDirectory(prefix="picollama-switches-") as tmp,
        tqdm(total=len(names) * len(args.seeds), desc="switches", unit="run", disable=None) as bar,
    ):
        for name in names:
            prepare_data(args.config_file, switches[name])
            runs = []
            for seed in args.seeds:
                folder = Path(tmp) / f"{len(results)}-{seed}"
                runs.append(run_switch(args.config_file, switches[name], seed, args, folder))
                bar.update()
            bpbs = [r["val_bpb"] for r in runs if r.get("val_bpb") is not None]
            results[name] = {
                "overrides": switches[name],
                "runs": runs,
                "val_bpb_mean": statistics.mean(bpbs) if bpbs else None,
                "val_bpb_std": statistics.stdev(bpbs) if len(bpbs) > 1 else None,
            }
    return results


def report(results: dict):
    rows = []
    for name, r in results.items():
        first = r["runs"][0]
        spread = f" ± {r['val_bpb_std']:.3f}" if r["val_bpb_std"] is not None else ""
        bpb = f"{r['val_bpb_mean']:.3f}{spread}" if r["val_bpb_mean"] is not None else "-"
        rate = f"{first['tokens_per_s']:,.0f}" if first.get("tokens_per_s") else "-"
        stable = ", ".join(sorted({x["stability"] for x in r["runs"]}))
        rows.append([name, f"{first['params']:,}", rate, bpb, stable])
    common.print_table(["switch", "params", "tokens/s", "val bits/byte", "training"], rows)


@common.one_writer
def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cfg, _ = parse_cli(["--config", args.config_file])
    other = next(name for name in OPTIMIZERS if name != cfg.optim.name)
    switches = {**SWITCHES, **QUALITY, **{name: [f"--optim.name={name}"] for name in OPTIMIZERS}}
    table = [*SWITCHES, other] if args.table == "switches" else [*QUALITY]
    names = args.only or table
    if args.smoke:
        names = args.only or SMOKE_SWITCHES
        switches = {name: [*SMOKE_MODEL, *switches[name]] for name in names}
    results = run_switches(args, switches, names)
    report(results)
    budget = None if args.smoke or args.minutes or args.steps else args.budget
    common.write_results(
        args,
        {
            "config": args.config,
            "budget_seconds": budget,
            "minutes": args.minutes,
            "steps": args.steps,
            "seeds": args.seeds,
            "switches": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
