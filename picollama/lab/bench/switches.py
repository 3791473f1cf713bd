"""The seed lectures' architecture table, measured: each switch trained by train.py, one at a time
from a config, for the same wall-clock budget; parameters, tokens/s, final validation bits/byte and
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

from model import Transformer
from picollama import REPO_ROOT
from picollama.cli import comma_list, positive
from picollama.command import run_command
from picollama.config import parse_cli
from picollama.lab.bench import common

# name -> train.py overrides; the first is the baseline every switch is compared with
SWITCHES = {
    "llama": [],  # the config as it is: rmsnorm, pre-norm, serial block, swiglu
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
OPTIMIZERS = ("adamw", "muon")  # the table also trains the optimizer that the config does not use
QUIET = ["--eval.interval=0", "--checkpoint.interval=0", "--train.sample_tokens=0"]
PROBE_STEPS = 12
# --smoke: seconds, not minutes (it once trained the config's model 28 times: 5 minutes): the
# baseline and one switch, a tiny model, SMOKE_STEPS steps each, no probe
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
    """'stable', 'spikes' (a logged loss more than 1 nat above the best so far, past the first
    tenth) or the error."""
    if entries and "failed" in entries[-1]:
        return entries[-1]["failed"].removeprefix("error: ")
    losses = [e["loss"] for e in entries if "loss" in e]
    best = math.inf
    for i, loss in enumerate(losses):
        if i > len(losses) // 10 and loss > best + 1.0:
            return "spikes"
        best = min(best, loss)
    return "stable"


def run_switch(
    config: str, overrides: list[str], seed: int, budget: float | None, tmp: Path
) -> dict:
    """Measure the switch's throughput in a short run, then train it for `budget` seconds' worth of
    steps (None: SMOKE_STEPS steps, no probe)."""
    cfg, _ = parse_cli(["--config", config, *overrides])
    with torch.device("meta"):
        params = Transformer(cfg.model).num_params()
    seeded = [*overrides, f"--train.seed={seed}"]
    steps = SMOKE_STEPS
    if budget is not None:
        probe = train(
            config,
            [*seeded, f"--train.max_steps={PROBE_STEPS}", "--train.log_interval=1"],
            tmp / "probe",
        )
        rates = [e["tokens_per_s"] for e in probe if "tokens_per_s" in e][2:]  # warmed up
        if not rates:
            return {"params": params, "stability": stability(probe)}
        tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
        steps = max(int(budget * statistics.median(rates) / tokens_per_step), 1)
    warmup = min(cfg.optim.warmup_steps, steps // 10)
    entries = train(
        config,
        [*seeded, f"--train.max_steps={steps}", f"--optim.warmup_steps={warmup}"],
        tmp / "run",
    )
    bpb = [e["val_bpb"] for e in entries if "val_bpb" in e]
    tokens_per_s = [e["tokens_per_s"] for e in entries if "tokens_per_s" in e]
    return {
        "params": params,
        "steps": steps,
        "tokens_per_s": statistics.median(tokens_per_s) if tokens_per_s else None,
        "val_bpb": bpb[-1] if bpb else None,
        "stability": stability(entries),
    }


def parse_args(argv: list[str]):
    p = common.parser(__doc__, "switches", models=False)
    p.add_argument(
        "--config", default="configs/default.toml", help="the config every switch starts from"
    )
    p.add_argument(
        "--budget", type=positive(float), default=90.0, help="training seconds per run (default 90)"
    )
    p.add_argument(
        "--seeds",
        type=comma_list(positive(zero=True)),
        default="0",
        help="train.seed of each run, comma-separated (default 0)",
    )
    p.add_argument(
        "--only",
        type=comma_list(choices=[*SWITCHES, *OPTIMIZERS]),
        help="comma-separated switches (default: all, and the optimizer the config does not use)",
    )
    args = common.parse(p, argv)
    # train.py runs in the repository: the default is a path there, a given one is the caller's
    given = "config" in p.given
    args.config_file = str(Path(args.config).absolute() if given else REPO_ROOT / args.config)
    return args


def run_switches(args, switches: dict, names: list[str], budget: float | None) -> dict:
    """{switch: its overrides, its run_switch of each seed, their mean and spread of val_bpb}."""
    results = {}
    with (
        tempfile.TemporaryDirectory(prefix="picollama-switches-") as tmp,
        tqdm(total=len(names) * len(args.seeds), desc="switches", unit="run", disable=None) as bar,
    ):
        for name in names:
            runs = []
            for seed in args.seeds:
                folder = Path(tmp) / f"{len(results)}-{seed}"
                runs.append(run_switch(args.config_file, switches[name], seed, budget, folder))
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
    switches = {**SWITCHES, **{name: [f"--optim.name={name}"] for name in OPTIMIZERS}}
    names = [*SWITCHES, other] if args.only is None else args.only
    budget = args.budget
    if args.smoke:
        names, budget = args.only or SMOKE_SWITCHES, None
        switches = {name: [*SMOKE_MODEL, *switches[name]] for name in names}
    results = run_switches(args, switches, names, budget)
    report(results)
    common.write_results(
        args,
        {"config": args.config, "budget_seconds": budget, "seeds": args.seeds, "switches": results},
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
