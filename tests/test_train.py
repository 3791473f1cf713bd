"""train.py: learning, accumulation, FSDP2 = one process, exact resume after SIGKILL, errors."""

import dataclasses
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import train
from data.build import prepare
from data.loader import RandomBatches
from data.tokenizer import tokenizer_sha256
from data.tokenizer_training import train_tokenizer
from model import ModelArgs, Transformer
from picollama import device
from picollama.cli import UserError, outputs
from picollama.cli.command import run_command
from picollama.config.checks import check_config
from picollama.config.model_args import CONTEXT_KEYS
from picollama.config.training import build_config, parse_cli
from picollama.run_files import load_model, non_finite, save_model
from picollama.training import budget, metrics, optim, parallel
from picollama.training import checks as train_checks
from picollama.training import dataset as train_data
from picollama.training import state as train_state
from picollama.training import step as training_step
from picollama.training.cpu_attention import cpu_training_attention
from picollama.training.resume import checkpoints

REPO = Path(__file__).resolve().parent.parent
# one torch thread in this process (conftest's one_thread) and OMP_NUM_THREADS=1 in the train.py
# processes (torchrun sets it for its ranks): a tiny model gains nothing from a second thread, and
# on a busy 2-core machine the two stall each other; runs compared with each other use one alike
pytestmark = pytest.mark.usefixtures("one_thread")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
TINY = {
    "model": {"dim": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 300, "max_seq_len": 32},
    "train": {
        "max_steps": 12,
        "batch_size": 8,
        "seq_len": 32,
        "log_interval": 1,
        "sample_tokens": 0,
        # not auto: bf16 rounds differently for other batch splits, which tests compare
        "dtype": "float32",
    },
    # constant after warmup: a run's losses do not depend on max_steps (killed runs use a huge one)
    "optim": {"lr": 3e-3, "min_lr": 3e-3, "warmup_steps": 2},
    "eval": {"interval": 6, "batches": 2, "batch_size": 8},
    "checkpoint": {"interval": 4, "keep": 2},
}
WORDS = (
    "the king queen lord lady sword crown night day love death speak hath thou thee my good noble "
    "fair"
).split()


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    """A tiny generated play corpus prepared with a 300-token vocabulary."""
    root = tmp_path_factory.mktemp("train_data")
    rng = random.Random(0)
    for i in range(4):
        speeches = [
            f"{rng.choice(['ROMEO', 'JULIET', 'LEAR'])}.\n"
            + " ".join(rng.choices(WORDS, k=rng.randint(4, 9)))
            for _ in range(500)
        ]
        (root / "corpus").mkdir(exist_ok=True)
        (root / "corpus" / f"play{i}.txt").write_text(".\n\n".join(speeches) + ".\n")
    return prepare(str(root / "corpus"), 300, out_dir=root / "prepared")


@pytest.fixture
def single_thread():
    """One torch thread for this test only: tiny in-process runs stall on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config_file(directory: Path, dataset: Path, **sections) -> Path:
    """TINY with each given section updated, reading the dataset, written as TOML."""
    tables = {
        name: {**TINY.get(name, {}), **sections.get(name, {})} for name in {**TINY, **sections}
    }
    tables["data"] = {"dir": str(dataset), **tables.get("data", {})}
    path = directory / "config.toml"
    path.write_text(
        "".join(
            f"[{name}]\n"
            + "".join(f"{key} = {json.dumps(value)}\n" for key, value in table.items())
            for name, table in tables.items()
        )
    )
    return path


def run_in_process(config: Path, out_dir: Path, *args: str) -> int:
    return run_command(train.main, ["--config", str(config), f"--train.out_dir={out_dir}", *args])


def command(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "train.py"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "train.py",
    ]


def run_subprocess(
    nproc: int, config: Path, out_dir: Path, *args: str, env=None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*command(nproc), "--config", str(config), f"--train.out_dir={out_dir}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ONE_THREAD, **(env or {})},
    )


def descendants(pid: int) -> list[int]:
    """The processes below pid, read from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def run_killed_then_resumed(
    nproc: int, config: Path, out_dir: Path, kill_after: int, max_steps: int, capsys=None
) -> int:
    """Start a (practically endless) run, SIGKILL it once checkpoint kill_after exists, resume to
    max_steps (one process: in this one, with capsys reading its output; it saves a python start
    and a torch import).

    Returns the step it resumed from."""
    process = subprocess.Popen(
        [
            *command(nproc),
            "--config",
            str(config),
            f"--train.out_dir={out_dir}",
            "--train.max_steps=100000",
        ],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **ONE_THREAD},
    )
    deadline = time.time() + 120
    while not [p for p in checkpoints(out_dir) if int(p.name[5:]) >= kill_after]:
        assert process.poll() is None, f"the run ended early: {process.stderr.read()}"
        assert time.time() < deadline, "no checkpoint within 120 s"
        time.sleep(0.01)
    for pid in [
        *descendants(process.pid),
        process.pid,
    ]:  # torchrun starts its workers in sessions of their own
        os.kill(pid, signal.SIGKILL)
    process.wait()
    resume = ["--resume", f"--train.max_steps={max_steps}"]
    if nproc == 1:
        capsys.readouterr()
        assert run_in_process(config, out_dir, *resume) == 0, capsys.readouterr().err
        stdout = capsys.readouterr().out
    else:
        resumed = run_subprocess(nproc, config, out_dir, *resume)
        assert resumed.returncode == 0, resumed.stderr
        stdout = resumed.stdout
    return int(stdout.split("resuming at step ")[1].split()[0])


def losses(out_dir: Path, key="loss") -> dict[int, float]:
    entries = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: e[key] for e in entries if key in e}


def assert_close(a: dict, b: dict, tolerance: float, steps=None):
    steps = sorted(a) if steps is None else steps
    assert steps and all(step in a and step in b for step in steps), (sorted(a), sorted(b))
    worst = max(abs(a[s] - b[s]) for s in steps)
    assert worst <= tolerance, f"largest difference {worst:.3g} > {tolerance}"


# ---------------------------------------------------------------- learning


def test_loss_falls(dataset, tmp_path):
    config = config_file(tmp_path, dataset, train={"max_steps": 60}, checkpoint={"interval": 0})
    assert run_in_process(config, tmp_path / "run") == 0
    curve = losses(tmp_path / "run")
    assert curve[60] < curve[1] - 1.5, curve
    val = losses(tmp_path / "run", "val_loss")
    assert val[60] < val[6] and (tmp_path / "run" / "model.safetensors").is_file()
    from picollama.run_files import load_model

    model, saved = load_model(tmp_path / "run")
    assert saved["train"]["seq_len"] == 32 and saved["data"]["dir"] == str(dataset)
    assert not any("_orig_mod" in key or "_checkpoint_wrapped" in key for key in model.state_dict())


def test_tiny_model_overfits_a_few_batches(dataset):
    torch.manual_seed(0)
    cfg = build_config({"model": TINY["model"], "optim": {"lr": 1e-2, "weight_decay": 0.0}}, [])
    model = Transformer(cfg.model)
    optimizer = optim.build_optimizer(model, cfg, torch.device("cpu"))
    loader = RandomBatches(dataset, "train", 4, 32)
    batches = [loader.next_batch() for _ in range(2)]
    for step in range(150):
        x, y = batches[step % 2]
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert max(model(x, y).item() for x, y in batches) < 0.3


def test_grad_accumulation_equals_the_big_batch(dataset, tmp_path):
    config = config_file(tmp_path, dataset, train={"max_steps": 6}, checkpoint={"interval": 0})
    assert run_in_process(config, tmp_path / "big") == 0
    # 4 micro-steps of 2
    assert run_in_process(config, tmp_path / "accum", "--train.grad_accum=4") == 0
    assert_close(losses(tmp_path / "big"), losses(tmp_path / "accum"), 1e-6)
    assert_close(losses(tmp_path / "big", "val_loss"), losses(tmp_path / "accum", "val_loss"), 1e-6)


def test_activation_checkpointing_changes_no_number_and_no_name(dataset, tmp_path):
    config = config_file(tmp_path, dataset, train={"max_steps": 4}, checkpoint={"interval": 0})
    assert run_in_process(config, tmp_path / "plain") == 0
    assert run_in_process(config, tmp_path / "ac", "--train.activation_checkpointing=true") == 0
    assert losses(tmp_path / "plain") == losses(tmp_path / "ac")
    plain, ac = (load_file(tmp_path / run / "model.safetensors") for run in ("plain", "ac"))
    assert plain.keys() == ac.keys() and all(torch.equal(plain[k], ac[k]) for k in plain)


def test_the_schedule_warms_up_then_decays_to_min_lr():
    cfg = build_config(
        {"train": {"max_steps": 100}, "optim": {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 10}}, []
    )
    lrs = [optim.lr_at(step, cfg) for step in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:])) and lrs[-1] == pytest.approx(
        0.1, abs=1e-3
    )


def test_wsd_holds_lr_then_decays_by_one_minus_sqrt_to_min_lr_over_the_last_fifth():
    optim_ = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 10, "schedule": "wsd"}
    cfg = build_config({"train": {"max_steps": 100}, "optim": optim_}, [])
    lrs = [optim.lr_at(step, cfg) for step in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9:80] == [1.0] * 71
    assert lrs[80] == pytest.approx(0.1 + 0.9 * (1 - (1 / 20) ** 0.5))
    assert all(a > b for a, b in itertools.pairwise(lrs[79:])) and lrs[-1] == pytest.approx(0.1)


def test_wsd_weight_decay_rises_over_the_decay_to_final_weight_decay_on_matrices_only():
    optim_ = {"schedule": "wsd", "weight_decay": 0.1, "final_weight_decay": 0.9, "name": "muon"}
    cfg = build_config({"train": {"max_steps": 100}, "optim": {**optim_, "warmup_steps": 10}}, [])
    decays = [optim.weight_decay_at(step, cfg) for step in range(100)]
    assert decays[:80] == [0.1] * 80 and decays[80] == pytest.approx(0.1 + 0.8 / 20)
    assert all(a < b for a, b in itertools.pairwise(decays[79:])) and decays[-1] == 0.9
    plain = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, final_weight_decay=None))
    assert {optim.weight_decay_at(step, plain) for step in range(100)} == {0.1}
    model = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32))
    optimizer = optim.build_optimizer(model, cfg, torch.device("cpu"))
    optim.set_weight_decay(optimizer, 0.5)
    # Muon's matrices and AdamW's (the embedding, the output layer) decay; the norms never
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.5, 0.5, 0.0]


def test_wsd_decays_from_a_decay_start_given():
    optim_ = {"lr": 1.0, "min_lr": 0.1, "warmup_steps": 10, "schedule": "wsd", "decay_start": 40}
    cfg = build_config({"train": {"max_steps": 100}, "optim": optim_}, [])
    lrs = [optim.lr_at(step, cfg) for step in range(100)]
    assert lrs[9:40] == [1.0] * 31 and lrs[40] == pytest.approx(0.1 + 0.9 * (1 - (1 / 60) ** 0.5))
    assert lrs[-1] == pytest.approx(0.1)


def test_a_non_finite_gradient_norm_skips_the_update(dataset):
    cfg = build_config({"model": TINY["model"]}, [])
    dist = train.Dist("cpu")
    model, optimizer, _ = train.build_model(cfg, dist)
    with torch.no_grad():
        # every logit, so the loss and every gradient, become NaN
        model.norm.weight[0] = float("nan")
    before = {name: p.clone() for name, p in model.named_parameters()}
    x, y = RandomBatches(dataset, "train", 4, 32).next_batch()
    _, grad_norm, applied = train.train_step(model, optimizer, x, y, 1e-3, cfg, dist)
    assert not applied and not torch.isfinite(grad_norm) and not optimizer.state
    assert all(
        torch.equal(p.nan_to_num(), before[n].nan_to_num()) for n, p in model.named_parameters()
    )
    del model, optimizer
    dist.close()


def test_an_infinite_loss_skips_the_update_even_with_finite_gradients(dataset, monkeypatch):
    cfg = build_config({"model": TINY["model"]}, [])
    model = Transformer(cfg.model)
    optimizer = optim.build_optimizer(model, cfg, torch.device("cpu"))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    finite_terms = training_step.logit_terms

    def infinite_loss(logits, y, z_loss):  # the same gradients as the model's, an infinite loss
        return {"loss": finite_terms(logits, y, z_loss)["loss"] + float("inf")}

    monkeypatch.setattr(training_step, "logit_terms", infinite_loss)
    x, y = RandomBatches(dataset, "train", 4, 32).next_batch()
    dist = train.Dist("cpu")
    _, grad_norm, applied = train.train_step(model, optimizer, x, y, 1e-3, cfg, dist)
    dist.close()
    assert torch.isfinite(grad_norm) and not applied and not optimizer.state
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_save_model_refuses_non_finite_weights(tmp_path):
    model = Transformer(ModelArgs(**TINY["model"]))
    save_model(model, tmp_path / "run")
    saved = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    with torch.no_grad():
        model.output.weight[0, 0] = float("inf")
    with pytest.raises(UserError, match="output.weight hold NaN or infinite values"):
        save_model(model, tmp_path / "run")
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == saved


# caught by the validation loss, or else when saving
@pytest.mark.parametrize("eval_interval", [1, 0])
def test_a_diverged_update_is_never_saved_nor_logged_as_a_number(
    dataset, tmp_path, capsys, eval_interval
):
    config = config_file(tmp_path, dataset, train={"max_steps": 2}, checkpoint={"interval": 1})
    assert run_in_process(config, tmp_path / "run") == 0
    capsys.readouterr()
    # the first update at this rate makes every weight NaN or infinite, while its gradients are
    # still finite
    diverge = [
        "--resume",
        "--optim.lr=1e39",
        "--train.max_steps=6",
        f"--eval.interval={eval_interval}",
    ]
    assert run_in_process(config, tmp_path / "run", *diverge) == 2
    err = capsys.readouterr().err
    good = tmp_path / "run" / "train_state" / "step_000002"
    assert (
        err.startswith("error: ")
        and err.count("\n") == 1
        and f"The last good checkpoint is {good}:" in err
    ), err
    assert checkpoints(tmp_path / "run") == [good.with_name("step_000001"), good]
    assert not non_finite(load_file(tmp_path / "run" / "model.safetensors").items())
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    for line in metrics.splitlines():
        json.loads(
            line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl:\n{metrics}")
        )


def test_flops_per_token_counts_the_matmuls_not_the_embeddings():
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=32))
    embeddings = 6 * 97 * 64  # not matmuls
    assert metrics.flops_per_token(model, 32) > 6 * model.num_params() - embeddings


def test_due_every_interval_and_after_the_last_step():
    assert [step for step in range(1, 101) if train.due(step, 25, 100)] == [25, 50, 75, 100]
    assert [step for step in range(1, 31) if train.due(step, 7, 30)] == [7, 14, 21, 28, 30]
    assert [step for step in range(1, 31) if train.due(step, 0, 30)] == [30]


def test_tokens_per_s_counts_training_time_only(dataset, tmp_path, monkeypatch):
    """On a clock where a step takes 1 s, an evaluation 100 s and a checkpoint 50 s, every logged
    rate is exactly one batch per second, also for the intervals with an evaluation that falls
    between logging steps."""
    now = [0.0]

    def taking(seconds, function):
        def timed(*args, **kwargs):
            now[0] += seconds
            return function(*args, **kwargs)

        return timed

    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    # once a step
    monkeypatch.setattr(RandomBatches, "next_batch", taking(1.0, RandomBatches.next_batch))
    monkeypatch.setattr(train_data, "evaluate", taking(100.0, train_data.evaluate))
    monkeypatch.setattr(train, "save_checkpoint", taking(50.0, train.save_checkpoint))
    config = config_file(
        tmp_path,
        dataset,
        train={"max_steps": 40, "log_interval": 10},
        eval={"interval": 25},
        checkpoint={"interval": 20},
    )
    assert run_in_process(config, tmp_path / "run") == 0
    rates = losses(tmp_path / "run", "tokens_per_s")
    assert sorted(rates) == [10, 20, 30, 40] and sorted(losses(tmp_path / "run", "val_loss")) == [
        25,
        40,
    ]
    assert all(rate == pytest.approx(8 * 32) for rate in rates.values()), rates
    # wall time: steps, evaluations and checkpoints alike
    elapsed = losses(tmp_path / "run", "elapsed_s")
    assert elapsed[10] == 10 and elapsed[30] == 30 + 100 + 50


# ---------------------------------------------------------------- FSDP2 and resume


@pytest.fixture(scope="module")
def runs(one_thread, dataset, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per precision, one process for 16 steps and 2 ranks for 12 steps: the runs the FSDP and
    resume tests compare against."""
    root = tmp_path_factory.mktemp("runs")
    found = {}
    for dtype in ("float32", "bfloat16"):
        (root / dtype).mkdir()
        config = config_file(root / dtype, dataset, train={"dtype": dtype})
        assert run_in_process(config, root / dtype / "single", "--train.max_steps=16") == 0
        two = run_subprocess(2, config, root / dtype / "two")
        assert two.returncode == 0, two.stderr
        (root / dtype / "two.stdout").write_text(two.stdout)
        found[dtype] = {
            "config": config,
            "single": root / dtype / "single",
            "two": root / dtype / "two",
        }
        found[dtype]["two_stdout"] = root / dtype / "two.stdout"
    return found


def test_fsdp_two_ranks_match_one_process(runs):
    fp32 = runs["float32"]
    assert_close(losses(fp32["single"]), losses(fp32["two"]), 1e-5, steps=range(1, 13))
    # bf16: one process autocasts (the residual stream fp32), FSDP2's policy computes all in bf16;
    # within bf16's rounding of a loss near 5 (1e-3 measured; bf16 against fp32 differs by 5e-2)
    bf16 = runs["bfloat16"]
    assert_close(losses(bf16["single"]), losses(bf16["two"]), 5e-3, steps=range(1, 13))
    assert_close(
        losses(fp32["single"], "val_loss"), losses(fp32["two"], "val_loss"), 1e-5, steps=[6, 12]
    )
    stdout = fp32["two_stdout"].read_text()
    counts = stdout.split("model: ")[1].split(" stored")[0].split(" parameters, ")
    total, stored = (int(n.replace(",", "")) for n in counts)
    # FSDP2 shards every parameter over the 2 ranks
    assert 0.45 * total <= stored <= 0.55 * total, stdout


def test_bf16_trains_in_bf16_with_fp32_master_weights(runs):
    for dtype in runs:
        assert f"; {'fp32' if dtype == 'float32' else 'bfloat16 with fp32 master weights'}" in (
            runs[dtype]["two_stdout"].read_text()
        )
    fp32, bf16 = (losses(runs[dtype]["single"]) for dtype in ("float32", "bfloat16"))
    assert 0 < abs(fp32[1] - bf16[1]) < 1e-2  # the same weights at step 1, computed in bf16
    assert_close(fp32, bf16, 0.05)
    weights = load_file(runs["bfloat16"]["single"] / "model.safetensors")
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_resume_after_sigkill_is_exact_in_one_process(runs, tmp_path, capsys):
    run = runs["bfloat16"]  # the default where the CPU has bf16: its resume must be exact too
    resumed_at = run_killed_then_resumed(
        1, run["config"], tmp_path / "run", kill_after=4, max_steps=16, capsys=capsys
    )
    assert 4 <= resumed_at < 16
    expected, got = losses(run["single"]), losses(tmp_path / "run")
    # steps past the checkpoint were dropped from the log and redone
    assert sorted(got) == list(range(1, 17))
    assert all(got[step] == expected[step] for step in range(1, 17)), (got, expected)


def test_resume_after_sigkill_with_two_ranks(runs, tmp_path):
    run = runs["bfloat16"]
    resumed_at = run_killed_then_resumed(
        2, run["config"], tmp_path / "run", kill_after=4, max_steps=12
    )
    assert 4 <= resumed_at < 12
    assert_close(losses(run["two"]), losses(tmp_path / "run"), 1e-6, steps=range(1, 13))


def test_one_process_checkpoint_resumes_on_two_ranks(runs, tmp_path):
    """One process saves without DCP's collectives (train_state); the checkpoint is still one that
    2 ranks resume."""
    fp32 = runs["float32"]
    shutil.copytree(fp32["single"], tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "train_state" / "step_000016")  # resume from step 12
    resumed = run_subprocess(
        2, fp32["config"], tmp_path / "run", "--resume", "--train.max_steps=16"
    )
    assert resumed.returncode == 0, resumed.stderr
    assert_close(losses(fp32["single"]), losses(tmp_path / "run"), 1e-5, steps=range(13, 17))


def test_two_rank_checkpoint_resumes_in_one_process(runs, tmp_path):
    fp32 = runs["float32"]
    shutil.copytree(fp32["two"], tmp_path / "run")
    assert run_in_process(fp32["config"], tmp_path / "run", "--resume", "--train.max_steps=16") == 0
    assert_close(losses(fp32["single"]), losses(tmp_path / "run"), 1e-5, steps=range(13, 17))


def test_one_process_trains_the_plain_model_as_a_group_of_one_would_and_resumes(
    dataset, tmp_path, monkeypatch
):
    """One process on the CPU (or MPS) trains the plain model, without a group or FSDP2: the same
    fp32 losses as a group of one, and an exact resume."""
    config = config_file(tmp_path, dataset)
    assert run_in_process(config, tmp_path / "plain") == 0
    monkeypatch.setattr(device, "UNGROUPED", ("mps",))
    assert run_in_process(config, tmp_path / "grouped") == 0
    monkeypatch.undo()
    assert_close(losses(tmp_path / "grouped"), losses(tmp_path / "plain"), 1e-5, steps=range(1, 13))
    shutil.rmtree(tmp_path / "plain" / "train_state" / "step_000012")
    assert run_in_process(config, tmp_path / "plain", "--resume") == 0
    assert_close(losses(tmp_path / "grouped"), losses(tmp_path / "plain"), 1e-5, steps=range(1, 13))


# ---------------------------------------------------------------- logging


def test_wandb_offline_one_metrics_line_per_logged_step_and_a_sample(dataset, tmp_path):
    config = config_file(tmp_path, dataset, checkpoint={"interval": 0})
    result = run_subprocess(
        1,
        config,
        tmp_path / "run",
        "--wandb.enabled=true",
        "--train.log_interval=5",
        "--train.sample_tokens=8",
        env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"},
    )
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    entries = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [e["step"] for e in entries if "loss" in e] == [5, 10, 12]
    assert all(
        {"lr", "grad_norm", "tokens_per_s", "mem_gb"} <= e.keys() for e in entries if "loss" in e
    )
    assert "done: the model is in" in result.stdout
    sample = result.stdout.split("---- sample ----\n")[1].split("\n----------------")[0]
    assert sample.strip(), result.stdout  # generate.py's continuation of the run's model


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--train.max_step=3"],
            "unknown config key train.max_step (did you mean train.max_steps?)",
        ),
        (["--optim.lr=fast"], "--optim.lr: expected float, got 'fast'"),
        (
            ["--train.seq_len=64"],
            "train.seq_len (64) exceeds the model's context model.max_seq_len (32)",
        ),
        (
            ["--train.batch_size=6", "--train.grad_accum=4"],
            "train.batch_size (6) must be divisible by train.grad_accum",
        ),
        (["--model.dim=33"], "[model] dim (33) must be divisible by n_heads (2)"),
        (["--optim.lr=1e30", "--optim.warmup_steps=0"], "the loss is"),
        (["--optim.lr=nan"], "--optim.lr must be finite, not nan"),
        (["--optim.lr=-1"], "--optim.lr must be positive, not -1.0"),
        (["--train.batch_size=0"], "--train.batch_size must be positive, not 0"),
        (["--checkpoint.interval=-1"], "--checkpoint.interval must be zero or more, not -1"),
        (["--eval.interval=-5"], "--eval.interval must be zero or more, not -5"),
        (["--optim.beta2=1"], "--optim.beta2 must be at least 0 and below 1, not 1.0"),
        (["--train.device=tpu"], "--train.device must be one of auto, cpu, cuda, mps, not 'tpu'"),
        (["--model.multiple_of=0"], "--model.multiple_of must be positive, not 0"),
        (["--model.norm_eps=-1e-5"], "--model.norm_eps must be positive, not -1e-05"),
        (["--train.seed=-1"], "--train.seed must be zero or more, not -1"),
        (["--train.out_dir=/proc/picollama-run"], "cannot write /proc/picollama-run"),
        (["--optim.name=sgd"], "--optim.name must be one of adamw, muon, not 'sgd'"),
        (
            ["--optim.muon_momentum=1"],
            "--optim.muon_momentum must be at least 0 and below 1, not 1.0",
        ),
        (["--optim.z_loss=-1"], "--optim.z_loss must be zero or more, not -1.0"),
        (["--train.random_positions=-2"], "--train.random_positions must be zero or more, not -2"),
        (
            ["--train.init_from=/no/such/run"],
            "train.init_from: /no/such/run is not a picollama run directory",
        ),
    ],
)
def test_bad_config_is_one_line(dataset, tmp_path, capsys, args, message):
    assert run_in_process(config_file(tmp_path, dataset), tmp_path / "run", *args) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: ") and message in stderr and stderr.count("\n") == 1, stderr


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    cfg, _ = parse_cli(["--config", str(path)])
    check_config(cfg, 8 if "llama-1b" in path.name else 1)
    with torch.device("meta"):
        assert Transformer(cfg.model).num_params() > 0


def test_toml_type_errors_name_the_key(dataset, tmp_path, capsys):
    config = config_file(tmp_path, dataset, train={"batch_size": "8"})
    assert run_in_process(config, tmp_path / "run") == 2
    assert "config key train.batch_size must be int, not str '8'" in capsys.readouterr().err
    config = config_file(tmp_path, dataset, checkpoint={"interval": -1})
    assert run_in_process(config, tmp_path / "run") == 2
    assert "config key checkpoint.interval must be zero or more, not -1" in capsys.readouterr().err


def test_resume_refuses_a_dataset_made_with_another_tokenizer(dataset, tmp_path, capsys):
    config = config_file(tmp_path, dataset, train={"max_steps": 2})
    assert run_in_process(config, tmp_path / "run") == 0
    tokenizer = (tmp_path / "run" / "tokenizer.model").read_bytes()
    for name in ("same", "other"):
        shutil.copytree(dataset, tmp_path / name)
    (tmp_path / "other" / "tokenizer.model").write_bytes(
        train_tokenizer(["the same shards, another tokenizer"], 280, 0)
    )
    # a dataset of its own: its meta.json names that tokenizer
    meta = json.loads((tmp_path / "other" / "meta.json").read_text())
    meta["tokenizer_sha256"] = tokenizer_sha256(tmp_path / "other" / "tokenizer.model")
    (tmp_path / "other" / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    resume = ["--resume", "--train.max_steps=3"]
    assert (
        run_in_process(config, tmp_path / "run", *resume, f"--data.dir={tmp_path / 'other'}") == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "it was trained with another tokenizer" in err, err
    assert (tmp_path / "run" / "tokenizer.model").read_bytes() == tokenizer
    same = f"--data.dir={tmp_path / 'same'}"  # a copy: fine
    assert run_in_process(config, tmp_path / "run", *resume, same) == 0


def test_corrupt_or_mismatched_checkpoint_is_one_line(dataset, tmp_path, capsys):
    config = config_file(tmp_path, dataset, train={"max_steps": 8})
    assert run_in_process(config, tmp_path / "run") == 0
    assert run_in_process(config, tmp_path / "run", "--resume", "--model.dim=64") == 2
    assert "different model (model.dim 32 → 64)" in capsys.readouterr().err
    assert run_in_process(config, tmp_path / "run") == 2
    assert "pass --resume to continue it" in capsys.readouterr().err
    for shard in (tmp_path / "run" / "train_state" / "step_000008").glob("*.distcp"):
        shard.write_bytes(b"not a checkpoint")
    corrupt = run_subprocess(1, config, tmp_path / "run", "--resume", "--train.max_steps=12")
    assert corrupt.returncode == 2 and corrupt.stderr.startswith("error: cannot resume from"), (
        corrupt.stderr
    )
    assert corrupt.stderr.count("\n") == 1, corrupt.stderr
    assert (
        f"delete it to resume from {tmp_path / 'run' / 'train_state' / 'step_000004'}"
        in corrupt.stderr
    )


# --------------------------------------------------------------- Muon, z-loss, positions, init_from


def test_muon_takes_the_blocks_matrices_and_the_schedule_scales_both(dataset):
    cfg = build_config(
        {"model": TINY["model"], "optim": {"name": "muon", "lr": 1e-3, "muon_lr": 0.02}}, []
    )
    dist = train.Dist("cpu")
    model, optimizer, _ = train.build_model(cfg, dist)
    muon, adamw = optimizer
    names = {id(p): name for name, p in model.named_parameters()}
    in_muon = {names[id(p)] for p in muon.param_groups[0]["params"]}
    assert in_muon == {
        name for name, p in model.named_parameters() if name.startswith("layers.") and p.ndim == 2
    }
    assert {names[id(p)] for group in adamw.param_groups for p in group["params"]} == set(
        names.values()
    ) - in_muon
    x, y = RandomBatches(dataset, "train", 4, 32).next_batch()
    train.train_step(model, optimizer, x, y, 5e-4, cfg, dist)
    assert muon.param_groups[0]["lr"] == pytest.approx(0.01) and {
        g["lr"] for g in adamw.param_groups
    } == {5e-4}
    assert len(muon.state) == len(in_muon) and len(adamw.state) == len(names) - len(in_muon)
    del model, optimizer, muon, adamw
    dist.close()


def test_muon_resumes_exactly_in_one_process(dataset, tmp_path):
    config = config_file(
        tmp_path, dataset, optim={"name": "muon"}, train={"max_steps": 6}, eval={"interval": 0}
    )
    assert run_in_process(config, tmp_path / "whole") == 0
    assert run_in_process(config, tmp_path / "split", "--train.max_steps=3") == 0
    assert run_in_process(config, tmp_path / "split", "--resume") == 0
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
    assert losses(tmp_path / "split", "val_loss")[6] == losses(tmp_path / "whole", "val_loss")[6]


def test_muon_under_fsdp_two_ranks_matches_one_process_and_resumes_there(dataset, tmp_path):
    config = config_file(
        tmp_path, dataset, optim={"name": "muon"}, train={"max_steps": 8}, eval={"interval": 0}
    )
    assert run_in_process(config, tmp_path / "one") == 0
    two = run_subprocess(2, config, tmp_path / "two", "--train.max_steps=5")
    assert two.returncode == 0, two.stderr
    # Newton–Schulz runs in bf16 on the row shards: the ranks round differently from one process
    # (~1e-4)
    assert_close(losses(tmp_path / "one"), losses(tmp_path / "two"), 1e-3, steps=range(1, 6))
    # its 2-rank Muon and AdamW state, resharded
    assert run_in_process(config, tmp_path / "two", "--resume") == 0
    assert_close(losses(tmp_path / "one"), losses(tmp_path / "two"), 1e-3, steps=range(6, 9))


def test_z_loss_adds_the_squared_log_normaliser_and_is_logged_beside_the_loss(dataset, tmp_path):
    model = Transformer(build_config({"model": TINY["model"]}, []).model)
    x, y = RandomBatches(dataset, "train", 4, 32).next_batch()
    terms = training_step.loss_terms(model, x, y, None, 1e-2)
    assert torch.allclose(terms["loss"], model(x, y))
    assert torch.allclose(terms["z_loss"], 1e-2 * (torch.logsumexp(model(x), dim=-1) ** 2).mean())
    assert training_step.loss_terms(model, x, y, None, 0.0).keys() == {"loss"}
    config = config_file(
        tmp_path, dataset, train={"max_steps": 3}, eval={"interval": 0}, checkpoint={"interval": 0}
    )
    assert run_in_process(config, tmp_path / "plain") == 0
    assert run_in_process(config, tmp_path / "z", "--optim.z_loss=1e-3") == 0
    z, plain = losses(tmp_path / "z", "z_loss"), losses(tmp_path / "plain")
    assert (
        sorted(z) == [1, 2, 3]
        and all(0 < value < 1 for value in z.values())
        and not losses(tmp_path / "plain", "z_loss")
    )
    # "loss" stays the cross-entropy
    assert losses(tmp_path / "z")[1] == pytest.approx(plain[1], abs=1e-6)
    assert losses(tmp_path / "z")[3] != plain[3]  # and the z-loss's gradient changed the updates


def test_the_compiled_model_and_loss_are_the_eager_ones(dataset, one_thread):
    """train.compile as one process trains (parallelize without a group: the blocks compiled, the
    forward under bf16 autocast, compiled_logit_terms and the written-out attention) against the
    eager model with PyTorch's attention, whose loss is the model's own cross-entropy, with targets
    the loss ignores: the same loss and gradients within bf16's rounding, and fp32 gradients for
    the fp32 weights."""
    x, y = RandomBatches(dataset, "train", 4, 32).next_batch()
    y[0, :5] = -100
    models, terms = [], []
    for compiled in (False, True):
        cfg = build_config({"model": TINY["model"], "train": {"compile": compiled}}, [])
        torch.manual_seed(0)
        models.append(parallel.parallelize(Transformer(cfg.model), cfg, None, torch.bfloat16))
        # compiled as train.py trains on a CPU: with the written-out attention (cpu_attention)
        with cpu_training_attention(torch.device("cpu")) if compiled else nullcontext():
            terms.append(training_step.loss_terms(models[-1], x, y, None, 0.0, compiled)["loss"])
            terms[-1].backward()
    assert torch.allclose(terms[0], models[0](x, y), rtol=1e-5)  # the eager model's own
    assert torch.allclose(*terms, rtol=1e-3)
    grads = [[p.grad for p in model.parameters()] for model in models]
    assert all(g.dtype == torch.float32 for g in grads[1])
    assert all((a - b).norm() <= 0.02 * a.norm() for a, b in zip(*grads, strict=True))


def test_compiled_validation_in_grad_mode_reuses_the_training_graph(dataset, one_thread):
    """mean_loss with grad, as a compiled one-process run validates: no graph compiled beyond the
    training step's, no gradient left behind, and the no_grad eager model's loss within bf16's
    rounding; without grad the compiled blocks compile again (what grad saves)."""
    from torch._dynamo.utils import counters

    x, y = RandomBatches(dataset, "train", 4, 32).next_batch()
    cfg = build_config({"model": TINY["model"], "train": {"compile": True}}, [])
    torch.manual_seed(0)
    eager = Transformer(cfg.model)
    model = parallel.parallelize(Transformer(cfg.model), cfg, None, torch.bfloat16)
    model.load_state_dict(eager.state_dict())
    with cpu_training_attention(torch.device("cpu")):
        training_step.loss_terms(model, x, y, None, 0.0, True)["loss"].backward()
        grads = [p.grad.clone() for p in model.parameters()]
        graphs = counters["stats"]["unique_graphs"]
        loss = train_data.mean_loss(model.eval(), [(x, y)], train.Dist("cpu"), grad=True)
        assert counters["stats"]["unique_graphs"] == graphs
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
        with torch.no_grad():
            assert loss == pytest.approx(eager(x, y).item(), rel=1e-2)
        train_data.mean_loss(model, [(x, y)], train.Dist("cpu"))
        assert counters["stats"]["unique_graphs"] > graphs


def test_check_compiler_trusts_the_cpu_flags_unless_the_user_decides(monkeypatch):
    from torch._inductor import config

    with config.patch({"cpp.vec_isa_ok": None}):
        monkeypatch.setenv("TORCHINDUCTOR_VEC_ISA_OK", "0")
        device.check_compiler()
        assert config.cpp.vec_isa_ok is None  # as Inductor read the user's setting
        monkeypatch.delenv("TORCHINDUCTOR_VEC_ISA_OK")
        device.check_compiler()
        assert config.cpp.vec_isa_ok is True


def test_a_short_last_validation_batch_is_grown_with_ignored_rows(dataset):
    """The model meets one batch shape in validation (a compiled one compiles no other for a short
    last batch), and the loss is still the mean over every window's targets."""
    model = Transformer(build_config({"model": TINY["model"]}, []).model)
    x, y = RandomBatches(dataset, "val", 7, 32).next_batch()
    rows = []

    def count_rows(module, args):
        rows.append(len(args[0]))

    model.register_forward_pre_hook(count_rows)
    loss = train_data.mean_loss(model, [(x[:4], y[:4]), (x[4:], y[4:])], train.Dist("cpu"))
    assert rows == [4, 4]
    with torch.no_grad():
        assert loss == pytest.approx(model(x, y).item(), rel=1e-6)


def test_random_positions_are_sorted_distinct_in_range_and_seeded():
    torch.manual_seed(0)
    positions = train_data.random_positions(16, 32, 4)
    assert positions.shape == (16, 32) and positions.dtype == torch.int64
    assert (positions.diff(dim=1) > 0).all() and positions.min() >= 0 and positions.max() < 128
    # they reach far, differently in every row
    assert positions.max() >= 96 and len(positions.unique(dim=0)) == 16
    torch.manual_seed(0)
    assert torch.equal(train_data.random_positions(16, 32, 4), positions)
    assert torch.equal(train_data.random_positions(2, 8, 1), torch.arange(8).expand(2, 8))


def test_random_positions_reach_the_model_only_when_on_and_resume_exactly(
    dataset, tmp_path, monkeypatch
):
    passed = []
    forward = Transformer.forward

    def recording(self, tokens, targets=None, start_pos=None, positions=None):
        passed.append(positions)
        return forward(self, tokens, targets, start_pos)  # model.py may not take positions yet

    monkeypatch.setattr(Transformer, "forward", recording)
    config = config_file(
        tmp_path, dataset, train={"max_steps": 4}, eval={"interval": 0}, checkpoint={"interval": 0}
    )
    assert run_in_process(config, tmp_path / "plain", "--train.max_steps=2") == 0
    assert passed and all(p is None for p in passed)
    passed.clear()
    assert run_in_process(config, tmp_path / "whole", "--train.random_positions=2") == 0
    whole = [p for p in passed if p is not None]
    assert len(whole) == 4 and all(
        p.shape == (8, 32) and 0 <= p.min() and p.max() < 64 for p in whole
    )
    passed.clear()
    assert (
        run_in_process(
            config, tmp_path / "split", "--train.random_positions=2", "--train.max_steps=2"
        )
        == 0
    )
    assert run_in_process(config, tmp_path / "split", "--train.random_positions=2", "--resume") == 0
    split = [p for p in passed if p is not None]
    assert len(split) == 4 and all(torch.equal(a, b) for a, b in zip(whole, split))


def test_training_at_random_positions_learns_and_resumes_exactly(dataset, tmp_path):
    config = config_file(
        tmp_path, dataset, train={"max_steps": 8, "random_positions": 4}, eval={"interval": 0}
    )
    assert run_in_process(config, tmp_path / "whole") == 0
    assert run_in_process(config, tmp_path / "split", "--train.max_steps=4") == 0
    assert run_in_process(config, tmp_path / "split", "--resume") == 0
    curve = losses(tmp_path / "whole")
    assert losses(tmp_path / "split") == curve and curve[8] < curve[1] - 0.3


def test_random_positions_beyond_a_learned_table_or_without_positions_are_refused():
    cfg = build_config(
        {
            "model": TINY["model"],
            "train": {"seq_len": 32, "random_positions": 2, "sample_tokens": 0},
        },
        [],
    )
    check_config(cfg, 1)  # RoPE is defined at any position
    cfg.model.position = "learned"  # set as model.position once the position-encoding switch exists
    with pytest.raises(
        UserError, match=r"random_positions \(2\) × train.seq_len \(32\) exceeds the learned"
    ):
        check_config(cfg, 1)
    cfg.model.position = "nope"
    with pytest.raises(UserError, match="model.position nope has none"):
        check_config(cfg, 1)


def test_init_from_extends_the_context_starting_from_the_source_weights(
    dataset, single_thread, tmp_path, capsys
):
    settings = {"train": {"max_steps": 8}, "eval": {"interval": 0}, "checkpoint": {"interval": 0}}
    config = config_file(tmp_path, dataset, **settings)
    assert run_in_process(config, tmp_path / "source") == 0
    longer = ["--train.seq_len=64", "--model.max_seq_len=64", "--model.rope_scaling=yarn"]
    longer.append("--model.rope_factor=2")
    init = f"--train.init_from={tmp_path / 'source'}"
    # the model is the source's (from its config.json), not the config file's, which differs
    (tmp_path / "tune").mkdir()
    other = {"dim": 64, "n_layers": 1, "n_heads": 4}
    tune = config_file(tmp_path / "tune", dataset, model=other, **settings)
    assert run_in_process(tune, tmp_path / "long", init, *longer) == 0
    model, saved = load_model(tmp_path / "long")
    assert (model.args.dim, model.args.n_layers, model.args.n_heads) == (32, 2, 2)
    assert model.args.original_seq_len == 32 and saved["model"]["rope_original_max_seq_len"] == 32
    assert saved["train"]["seq_len"] == 64 and saved["train"]["init_from"] == str(
        tmp_path / "source"
    )
    source, _ = load_model(tmp_path / "source")
    source.args = dataclasses.replace(
        source.args, **{key: saved["model"][key] for key in CONTEXT_KEYS}
    )
    x, y = RandomBatches(dataset, "train", 8, 64, seed=saved["train"]["seed"]).next_batch()
    curve = losses(tmp_path / "long")
    with torch.no_grad():
        # the source's weights, stretched by YaRN
        assert curve[1] == pytest.approx(source(x, y).item(), abs=1e-5)
    assert curve[1] < losses(tmp_path / "source")[1] - 0.5 and curve[8] < curve[1]
    # --resume continues the run's own checkpoint; the source is only checked again
    assert (
        run_in_process(tune, tmp_path / "long", init, *longer, "--resume", "--train.max_steps=10")
        == 0
    )
    assert "resuming at step 8" in capsys.readouterr().out and sorted(
        losses(tmp_path / "long")
    ) == list(range(1, 11))
    for args, message in [
        (
            [init, "--model.dim=64"],
            f"train.init_from {tmp_path / 'source'} has model.dim = 32, this run 64; only",
        ),
        (
            [f"--train.init_from={tmp_path / 'long'}"],
            "must be another run directory than train.out_dir",
        ),
    ]:
        assert run_in_process(config, tmp_path / "long", *args) == 2
        stderr = capsys.readouterr().err
        assert stderr.startswith("error: ") and message in stderr and stderr.count("\n") == 1, (
            stderr
        )


def test_init_from_takes_the_model_of_the_run_and_refuses_a_conflicting_key_given(tmp_path):
    """Keys given with train.init_from (on the command line; in the file too where the file names
    it) may change the context only; the file's other [model] keys give way to the run's."""
    source = ModelArgs(dim=48, n_layers=3, n_heads=3, vocab_size=300, max_seq_len=32)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"model": source.to_dict()}))
    init = ("train.init_from", str(tmp_path / "run"))
    file = {"model": {"dim": 64, "n_layers": 1, "n_heads": 2}}
    assert build_config(file, [init]).model == source
    longer = build_config(file, [init, ("model.max_seq_len", "64"), ("model.n_layers", "3")])
    assert longer.model == dataclasses.replace(source, max_seq_len=64)
    for raw, overrides, message in [
        (file, [init, ("model.dim", "64")], "has model.dim = 48, this run 64; only model.max_"),
        ({**file, "train": {"init_from": init[1]}}, [], "has model.dim = 48, this run 64"),
    ]:
        with pytest.raises(UserError, match=message):
            build_config(raw, overrides)
    # a run not trained yet (a study plans its fine-tune first): the model as given
    later = ("train.init_from", str(tmp_path / "later"))
    assert build_config(file, [later]).model == build_config(file, []).model
    (tmp_path / "run" / "config.json").write_text(json.dumps({"model": {"dim": 48}}))
    with pytest.raises(UserError, match=r"run/config.json is corrupt: model.n_layers is missing"):
        build_config(file, [init])


def test_a_missing_data_dir_is_prepared_only_where_python_train_py_prepares_it(
    tmp_path, monkeypatch
):
    """data/shakespeare (from here or in the repository), or a folder given a data.source, is
    prepared when missing; a mistyped or empty folder otherwise is refused before any work."""
    monkeypatch.chdir(tmp_path)

    def check(*overrides):
        train_data.check_dataset(build_config({}, list(overrides)))

    check()  # data/shakespeare, here
    check(("data.dir", str(REPO / "data" / "shakespeare")))
    check(("data.dir", "mine"), ("data.source", "my_texts/"))
    check(("data.dir", "data/shakespeare-unigram"), ("data.tokenizer_type", "unigram"))
    check(("data.task", "retrieval"), ("data.dir", "none"))
    (tmp_path / "empty").mkdir()
    for folder, problem in [
        ("data/shakspeare", "it does not exist"),
        ("empty", "it is empty"),
        ("data", "it does not exist"),
        ("data/shakespeare-unigram", "it does not exist"),  # not BPE's own folder
    ]:
        with pytest.raises(
            UserError, match=rf"data.dir {folder} is not a prepared dataset \({problem}"
        ):
            check(("data.dir", folder))
    (tmp_path / "data" / "shakespeare").mkdir(parents=True)
    (tmp_path / "data" / "shakespeare" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"\(no meta.json; it holds notes.txt\)"):
        check()


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_no_shipped_config_is_too_big_for_the_machine_it_is_for(path, monkeypatch):
    """The memory check's lower bound passes every config on its machine: a 16 GiB laptop, or an
    80 GB H100 (one, or eight for llama-1b)."""
    cfg, _ = parse_cli(["--config", str(path)])
    gpu = cfg.model.dim >= 768
    monkeypatch.setattr(train_checks, "memory_bytes", lambda device: 80e9 if gpu else 16 * 2**30)
    train_checks.check_memory(cfg, 8 if "llama-1b" in path.name else 1)


def test_a_batch_past_memory_is_refused_naming_what_fits(monkeypatch):
    """The lower bound, by hand: 12 bytes a parameter, and per token the fp32 logits and their
    gradient and each block's input (float32 here); memory for exactly 10 sequences of 32."""
    cfg = build_config({name: TINY[name] for name in ("model", "train", "eval")}, [])
    with torch.device("meta"):
        params = Transformer(cfg.model).num_params()
    per_token = 8 * 300 + 2 * 32 * 4
    monkeypatch.setattr(
        train_checks, "memory_bytes", lambda device: 12 * params + 10 * 32 * per_token
    )

    def check(world_size=1, **train_):
        train_checks.check_memory(
            dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train_)), world_size
        )

    check(batch_size=10)
    check(batch_size=20, grad_accum=2)
    check(2, batch_size=20)  # each rank holds half the weights too
    message = (
        "train.batch_size 11 cannot fit in memory: 11 sequences of 32 tokens at once need at least "
        "0.9 MiB for their logits and activations, beside 0.5 MiB for the weights and optimizer "
        "state, and cpu memory is 1.3 MiB: at most 10 fit; lower train.batch_size or raise "
        "train.grad_accum"
    )
    with pytest.raises(UserError) as refused:
        check(batch_size=11)
    assert str(refused.value) == message
    with pytest.raises(UserError, match="eval.batch_size 12 cannot fit in memory: .* at most 11 "):
        train_checks.check_memory(
            dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, batch_size=12)), 1
        )


# ---------------------------------------------------------------- a run sized in minutes


def test_steps_in_budget_counts_steps_evaluations_and_saves():
    cfg = build_config({"eval": {"interval": 10}, "checkpoint": {"interval": 0}}, [])
    # 100 s left after 5 steps: the last evaluation (4 s) first, then 0.5 s a step + 4 s every 10
    # steps = 0.9 s a step
    assert budget.steps_in_budget(100.0, 5, 0.5, (4.0, 4.0), 2.0, cfg) == 5 + int(94 / 0.9)
    # evaluations of 1 s before the last one (eval.interim_batches): 0.6 s a step
    assert budget.steps_in_budget(100.0, 5, 0.5, (1.0, 4.0), 2.0, cfg) == 5 + int(94 / 0.6)
    # over budget already: stop after the probe
    assert budget.steps_in_budget(-3.0, 5, 0.5, (4.0, 4.0), 2.0, cfg) == 5


def test_spread_picks_evenly_spaced_batches_or_all():
    batches = list(range(24))
    assert train_data.spread(batches, 6) == [0, 4, 8, 12, 16, 20]
    assert train_data.spread(batches, 0) == train_data.spread(batches, 30) == batches


def test_interim_evaluations_read_their_part_and_the_budget_plans_for_the_whole_last_one(
    dataset, tmp_path, monkeypatch, capsys
):
    """eval.interim_batches 1 of 4: each evaluation before the last reads one batch, the last all
    four (their losses those of the batches read, which metrics.jsonl and the log say). On a clock
    where a step takes 0.125 s and a validation batch 1 s, a 15-second wsd budget evaluating every
    10 steps (deciding with half of it left) ends within it, having planned for the last
    evaluation's 4 s."""
    clock = FakeClock(0.125)
    clock.install(monkeypatch.setattr)
    read = []

    def evaluate(model, batches, **kwargs):
        read.append(len(batches))
        clock.now += len(batches)
        return {"val_loss": float(len(batches)), "val_ppl": 1.0, "val_bpb": 1.0}

    monkeypatch.setattr(train_data, "evaluate", evaluate)
    config = budgeted(tmp_path, dataset, 0.25, 0, schedule="wsd", decay_fraction=0.5)
    batches = ("--eval.batches=4", "--eval.interim_batches=1", "--eval.interval=10")
    assert run_in_process(config, tmp_path / "run", *batches) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    evaluations = [r for r in records if "val_loss" in r]
    assert read == [1] * (len(read) - 1) + [4] and len(read) >= 4
    assert [r.get("val_batches") for r in evaluations] == [1] * (len(read) - 1) + [None]
    assert "step 10: val loss (1 of 4 batches) 1.0000" in capsys.readouterr().out
    # within a step and the 0.5 s it keeps for the save (which takes no time on this clock); had
    # it planned on an evaluation of 1 s, it would have ended at 17.75 s
    assert 14 <= clock.now <= 15


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--train.max_minutes=1", "--train.max_steps=5"],
            "the command line sets both train.max_steps and",
        ),
        (["--train.max_minutes=0"], "--train.max_minutes must be positive"),
        (
            ["--train.max_minutes=1", "--optim.warmup_steps=2"],
            "train.max_minutes needs optim.warmup_steps of 4",
        ),
        (["--optim.schedule=linear"], "--optim.schedule must be one of cosine, wsd, not 'linear'"),
        (["--optim.decay_fraction=0"], "--optim.decay_fraction must be positive, not 0.0"),
        (["--optim.decay_fraction=1"], "--optim.decay_fraction must be at least 0 and below 1"),
        (["--optim.decay_start=5"], "optim.decay_start applies to optim.schedule wsd, not cosine"),
        (
            ["--optim.final_weight_decay=0.5"],
            "optim.final_weight_decay applies to optim.schedule wsd, not cosine",
        ),
        (["--optim.final_weight_decay=-1"], "--optim.final_weight_decay must be zero or more"),
        (
            ["--optim.schedule=wsd", "--optim.decay_start=12"],
            "optim.decay_start (12) must be below train.max_steps (12)",
        ),
        (
            ["--train.max_minutes=1", "--optim.schedule=wsd", "--optim.decay_start=5"],
            "optim.decay_start is decided by the train.max_minutes budget",
        ),
    ],
)
def test_bad_budgets_are_one_line(dataset, tmp_path, capsys, args, message):
    assert run_in_process(config_file(tmp_path, dataset), tmp_path / "run", *args) == 2
    assert message in capsys.readouterr().err


def test_a_wsd_budget_needs_no_warmup_to_time():
    optim_ = {"schedule": "wsd", "warmup_steps": 0}
    check_config(build_config({"train": {"max_minutes": 1.0}, "optim": optim_}, []), 1)


def test_a_step_count_on_the_command_line_turns_off_the_files_budget():
    cfg = build_config({"train": {"max_minutes": 5.0}}, [("train.max_steps", "7")])
    assert cfg.train.max_minutes is None and cfg.train.max_steps == 7
    with pytest.raises(UserError, match="the config file sets both"):
        build_config({"train": {"max_minutes": 5.0, "max_steps": 7}}, [])


class FakeClock:
    """train.py's and budget.py's clock, advancing `seconds` with each training step (changed to
    changes[n] from the process's n-th step on) and standing still otherwise: a budget then decides
    alike on any machine, however loaded. With `die_at`, the process SIGKILLs itself as that step
    begins."""

    def __init__(self, seconds: float, changes: dict | None = None, die_at: int | None = None):
        self.now = 0.0
        self.steps = 0
        self.seconds = seconds
        self.changes = changes or {}
        self.die_at = die_at

    def perf_counter(self) -> float:
        return self.now

    def install(self, setattr):
        """Put train.py on this clock (setattr: the builtin, or monkeypatch's)."""
        step = train.train_step

        def timed_step(*args, **kwargs):
            self.steps += 1
            if self.steps == self.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            self.seconds = self.changes.get(self.steps, self.seconds)
            self.now += self.seconds
            return step(*args, **kwargs)

        setattr(train, "train_step", timed_step)
        setattr(train, "time", self)
        setattr(budget, "time", self)


# train.py at 0.125 s a step (sums of it are exact in binary), killed as step {die_at} begins
KILLED_ON_A_FAKE_CLOCK = (
    "import sys, train; from tests.test_train import FakeClock; "
    "from picollama.cli.command import run_command; "
    "FakeClock(0.125, die_at={die_at}).install(setattr); "
    "sys.exit(run_command(train.main, sys.argv[1:]))"
)


def budgeted(tmp_path: Path, dataset: Path, minutes: float, saves: int, **optim_) -> Path:
    """A TINY config of `minutes` (no train.max_steps), saving every `saves` steps, with the optim
    settings given."""
    train_ = {"max_minutes": minutes, "sample_tokens": 0, "log_interval": 1}
    optim_ = {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 10, **optim_}
    config = config_file(
        tmp_path, dataset, train=train_, optim=optim_, checkpoint={"interval": saves, "keep": 2}
    )
    config.write_text(config.read_text().replace("max_steps = 12\n", ""))
    return config


def decision(run_dir: Path) -> tuple[int, int]:
    """(step, train.max_steps) where run_dir's budget decided its length: one decision."""
    entries = map(json.loads, (run_dir / "metrics.jsonl").open())
    ((step, max_steps),) = [(e["step"], e["max_steps"]) for e in entries if "max_steps" in e]
    return step, max_steps


@pytest.mark.parametrize(
    "schedule, minutes, die_at, decided",
    [("cosine", 0.1, 25, True), ("wsd", 0.1, 12, False), ("wsd", 0.1, 35, True)],
)
def test_a_budgeted_run_killed_and_resumed_equals_the_same_steps_given_up_front(
    dataset, tmp_path, monkeypatch, schedule, minutes, die_at, decided
):
    """A budget decides max_steps where no learning rate behind the run depends on it (cosine: after
    warmup steps; wsd: where the decay starts), so a budgeted run is the run of its chosen
    max_steps (and decay_start). A checkpoint records them, or until then the time spent: a
    SIGKILLed run resumes on the same schedule, or goes on deciding as if it had never stopped
    (wsd, decay_fraction 0.5: with 3 of its 6 s left, at step 24, for 48 steps of 0.125 s)."""
    config = budgeted(tmp_path, dataset, minutes, 10, schedule=schedule, decay_fraction=0.5)
    killed = tmp_path / "killed"
    script = KILLED_ON_A_FAKE_CLOCK.format(die_at=die_at)
    args = ["--config", str(config), f"--train.out_dir={killed}"]
    died = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        capture_output=True,
        env={**os.environ, **ONE_THREAD},
    )
    assert died.returncode == -signal.SIGKILL, died.stderr
    latest = checkpoints(killed)[-1]
    settings = json.loads((latest / "meta.json").read_text())["settings"]
    assert latest.name == f"step_{die_at // 10 * 10:06d}"
    assert settings["train.spent_s"] == 0.125 * int(latest.name[5:])  # the fake clock's
    assert (settings["train.max_steps"] != budget.UNDECIDED) == decided
    FakeClock(0.125).install(monkeypatch.setattr)
    assert run_in_process(config, killed, "--resume") == 0
    decided_at, chosen = decision(killed)
    decay_start = decided_at if schedule == "wsd" else None
    if schedule == "wsd":
        assert (decided_at, chosen) == (24, 48)
    assert chosen > 30, f"the budget sized only {chosen} steps: too few to kill the run halfway"
    reference = tmp_path / "reference"
    length = [f"--train.max_steps={chosen}", f"--optim.decay_start={decay_start}"]
    assert run_in_process(config, reference, *length) == 0
    saved = json.loads((killed / "config.json").read_text())
    assert max(losses(killed)) == chosen == saved["train"]["max_steps"]
    assert saved["optim"]["decay_start"] == decay_start
    assert_close(losses(killed), losses(reference), 1e-6, steps=range(1, chosen + 1))


def test_a_wsd_budget_ends_in_time_when_the_steps_slow_down_after_the_first_ones(
    dataset, tmp_path, monkeypatch
):
    """Steps 3× slower from step 21 on: a load that came after the first steps. The wsd budget of 15
    s decides with 20% of them left, from recent steps, and ends within 1% of it (at 14.875 s),
    where a decision after the first steps (the cosine budget's: 111 steps) would end at 37 s; its
    learning rates are those of the run of its max_steps and decay_start."""
    clock = FakeClock(0.125, {21: 0.375})
    clock.install(monkeypatch.setattr)
    config = budgeted(tmp_path, dataset, 0.25, 10, schedule="wsd")
    assert run_in_process(config, tmp_path / "run") == 0
    assert 0.99 * 15 <= clock.now <= 15
    decided_at, max_steps = decision(tmp_path / "run")
    assert (decided_at, max_steps) == (46, 53) and clock.steps == 53
    cfg = train.with_length(parse_cli(["--config", str(config)])[0], max_steps, decided_at)
    lrs = losses(tmp_path / "run", "lr")
    assert lrs == {step: optim.lr_at(step - 1, cfg) for step in range(1, max_steps + 1)}


def test_a_decided_budget_shortens_when_the_machine_slows_after_it_decides(
    dataset, tmp_path, monkeypatch
):
    """Steps 2× slower from step 100 on, after the wsd budget of 15 s decided at step 96 for 115
    steps (the end at 16.375 s). Every budget.LOOK_EVERY steps the run looks again and shortens to
    what fits: 111 steps at step 110. It ends at 15.375 s."""
    clock = FakeClock(0.125, {100: 0.25})
    clock.install(monkeypatch.setattr)
    config = budgeted(tmp_path, dataset, 0.25, 1000, schedule="wsd")
    assert run_in_process(config, tmp_path / "run") == 0
    entries = map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())
    sized = [(e["step"], e["max_steps"]) for e in entries if "max_steps" in e]
    assert sized == [(96, 115), (110, 111)] and clock.steps == 111
    assert clock.now == 15.375


def test_threads_leave_the_cores_that_busy_processes_take(monkeypatch):
    """device.free_cores: with a busy process on every core, one thread. CoreShare keeps a count
    the user set in OMP_NUM_THREADS."""
    cores = len(os.sched_getaffinity(0))
    if cores > 8:
        pytest.skip("a busy process a core is too many here")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(0.5)  # until they run
        assert device.free_cores(cores) == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert device.CoreShare(torch.device("cpu")).threads() is None
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


# ---------------------------------------------------------------- one writer, signals, full disks


def test_a_second_training_into_one_run_directory_is_refused_at_once(dataset, tmp_path, capsys):
    """Two train.py into one out_dir: the second exits 2 naming the first's pid; the first's outputs
    are those of a run alone (a second, identical run into another directory, at the same time)."""
    config = config_file(tmp_path, dataset, train={"max_steps": 12})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first, alone = (
        subprocess.Popen(
            [*command(1), "--config", str(config), f"--train.out_dir={tmp_path / name}"],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name in ("run", "alone")
    )
    lock = tmp_path / ".run.lock"
    deadline = time.monotonic() + 120
    while (
        not (lock.is_file() and lock.read_text())
        and first.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert run_in_process(config, tmp_path / "run") == 2
    assert first.poll() is None, (
        "the first run ended before the second tried: the test proves nothing"
    )
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and f"is in use by another process (pid {first.pid}, lock file {lock})" in err
    ), err
    assert first.wait(timeout=300) == 0 and alone.wait(timeout=300) == 0, (
        first.stderr.read() + alone.stderr.read()
    )
    for name in ("model.safetensors", "config.json"):
        saved = (tmp_path / "run" / name).read_bytes()
        assert saved == (tmp_path / "alone" / name).read_bytes().replace(b"alone", b"run"), name
    assert losses(tmp_path / "run") == losses(tmp_path / "alone")
    assert [p.name for p in checkpoints(tmp_path / "run")] == ["step_000008", "step_000012"]
    assert not lock.exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_training_with_one_line_naming_where_resume_continues(
    dataset, tmp_path, signum
):
    config = config_file(tmp_path, dataset, train={"max_steps": 100000}, checkpoint={"interval": 2})
    process = subprocess.Popen(
        [*command(1), "--config", str(config), f"--train.out_dir={tmp_path / 'run'}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 120
    while (
        not checkpoints(tmp_path / "run") and process.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    process.send_signal(signum)
    err = process.communicate(timeout=120)[1]
    assert process.returncode == 128 + signum, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.rstrip("\n").endswith(errors[0]) and "Traceback" not in err, err
    latest = checkpoints(tmp_path / "run")[-1]
    assert (
        errors[0]
        == f"error: interrupted; --resume continues from step {int(latest.name[5:])} ({latest})"
    )
    assert not list((tmp_path / "run" / "train_state").glob(".*.tmp"))


class InterruptingStream:
    """A stream that, before its second write, sends this process the signals in `pending`, as a
    Ctrl-C would: they arrive inside torch.save (which DCP writes with), whose C++ writer turns a
    KeyboardInterrupt there into a RuntimeError ("unexpected pos") from the first write on."""

    def __init__(self, stream, pending: list):
        self.stream, self.pending, self.writes = stream, pending, 0

    def write(self, data):
        self.writes += 1
        while self.pending and self.writes > 1:
            signal.raise_signal(self.pending.pop())
        return self.stream.write(data)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def assert_saved_consistently(run_dir: Path, step: int, err: str):
    """The run ended in one line naming checkpoint `step`, its latest; no temporary is left, and the
    model export holds that checkpoint's weights."""
    latest = checkpoints(run_dir)[-1]
    assert latest.name == f"step_{step:06d}", latest
    assert err == f"error: interrupted; --resume continues from step {step} ({latest})\n", err
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name or ".old" in p.name]
    model, _ = load_model(run_dir)
    weights = checkpoint_weights(latest, model.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("signals", [1, 2], ids=["one-signal", "two-signals"])
def test_a_signal_during_a_save_waits_for_it_and_a_second_one_stops_it(
    dataset, single_thread, tmp_path, monkeypatch, capsys, signals
):
    """A Ctrl-C inside torch.save became torch's "unexpected pos" error, which read as a full disk
    (the SIGINT test above flaked so, once in four runs). Now one signal waits for the save to end
    (the run stops at the checkpoint just written); a second one stops the save at once, leaving
    nothing of it. Either way: one line, exit 130, no temporary, export and checkpoint alike."""
    config = config_file(tmp_path, dataset, train={"max_steps": 6}, checkpoint={"interval": 2})
    pending, save, write = [], torch.save, train_state.write_train_state

    def interrupted_save(obj, f, *args, **kwargs):
        return save(obj, InterruptingStream(f, pending), *args, **kwargs)

    def write_train_state(tmp, step, *args):
        pending.extend([signal.SIGINT] * signals * (step == 4))  # in the second save
        return write(tmp, step, *args)

    monkeypatch.setattr(torch, "save", interrupted_save)
    monkeypatch.setattr(train_state, "write_train_state", write_train_state)
    assert run_in_process(config, tmp_path / "run") == 128 + signal.SIGINT
    assert_saved_consistently(tmp_path / "run", 4 if signals == 1 else 2, capsys.readouterr().err)


@pytest.mark.parametrize("where", ["barrier", "write_train_state", "model_from_state_dict"])
def test_an_interrupt_anywhere_in_a_save_leaves_no_temporary(
    dataset, single_thread, tmp_path, monkeypatch, capsys, where
):
    """A KeyboardInterrupt raised in the second save: after its temporary directory is made (where
    a gap before the cleanup's try once left it), while writing, and while exporting the model."""
    config = config_file(tmp_path, dataset, train={"max_steps": 6}, checkpoint={"interval": 2})
    owner = device.Dist if where == "barrier" else train_state
    original = getattr(owner, where)

    def interrupted(*args, **kwargs):
        if (tmp_path / "run" / "train_state" / ".step_000004.tmp").is_dir():
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, where, interrupted)
    assert run_in_process(config, tmp_path / "run") == 128 + signal.SIGINT
    assert_saved_consistently(tmp_path / "run", 2, capsys.readouterr().err)


def test_a_signal_while_the_model_files_are_renamed_waits_for_the_last_rename(
    tmp_path, monkeypatch
):
    """config.json, then model.safetensors: a Ctrl-C between the renames once left the new
    config.json beside the old weights; now it arrives after both."""
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=300, max_seq_len=32)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        models.append(Transformer(args))
    save_model(models[0], tmp_path / "run", {"train": {"seed": 0}})
    renames, rename = [], outputs.replace

    def interrupted(src, dst):
        renames.append(dst.name)
        if len(renames) == 2:  # after config.json, before model.safetensors
            signal.raise_signal(signal.SIGINT)
        rename(src, dst)

    monkeypatch.setattr(outputs, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_model(models[1], tmp_path / "run", {"train": {"seed": 1}})
    assert renames == ["config.json", "model.safetensors"]
    model, config = load_model(tmp_path / "run")
    assert config["train"]["seed"] == 1
    assert all(torch.equal(v, models[1].state_dict()[k]) for k, v in model.state_dict().items())


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs (root only; CI mounts it), unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}): needs root")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)


def checkpoint_weights(path: Path, like: dict) -> dict:
    """The model weights of a train_state checkpoint, as tensors shaped like `like`."""
    state = {"model": {k: torch.empty_like(v) for k, v in like.items()}}
    with train_state.single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state["model"]


@pytest.mark.parametrize("checked_first", [True, False], ids=["checked-first", "found-full"])
def test_a_full_disk_ends_the_run_in_one_line_with_checkpoint_and_model_consistent(
    dataset, small_disk, monkeypatch, capsys, checked_first
):
    """Checkpoints every step into 2 MB: a save runs out of space (found by the free-space check
    before writing, or, with that check off, by the write itself). One error line naming the path,
    no temporary file left, and the model export is the latest checkpoint's weights."""
    if not checked_first:
        monkeypatch.setattr(train_state, "check_free_space", lambda *args, **kwargs: None)
        monkeypatch.setattr("picollama.run_files.check_free_space", lambda *a, **k: None)
    config = config_file(
        small_disk.parent, dataset, train={"max_steps": 20}, checkpoint={"interval": 1, "keep": 2}
    )
    run = small_disk / "run"
    assert run_in_process(config, run) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    expected = "not enough disk space" if checked_first else "No space left on device"
    assert (
        err.startswith("error: cannot write ")
        and str(run) in err
        and expected in err
        and re.search(r"\d (bytes|KB|MB) free", err)
    ), err
    assert not [p for p in small_disk.rglob("*") if ".tmp" in p.name]
    latest = checkpoints(run)[-1]
    model, _ = load_model(run)
    weights = checkpoint_weights(latest, model.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert losses(run)  # metrics.jsonl up to the failure


def test_a_full_disk_during_to_hf_leaves_nothing(make_tiny_run, small_disk, monkeypatch, capsys):
    from picollama.convert import main as convert

    run_dir, _ = make_tiny_run(steps=1)
    (small_disk / "filler").write_bytes(b"\0" * (1900 * 1024))
    for checked_first in (True, False):
        if not checked_first:
            monkeypatch.setattr(
                "picollama.cli.outputs.check_free_space", lambda *args, **kwargs: None
            )
        assert (
            run_command(
                convert.main, ["to-hf", "--run", str(run_dir), "--out", str(small_disk / "hf")]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert (
            err.count("\n") == 1
            and f"cannot write {small_disk / 'hf'}" in err
            and re.search(r"\d (bytes|KB|MB) free", err)
        ), err
        assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


FULL_ON_RANK_1 = """
import errno, os, pathlib
if os.environ.get("RANK") == "1":  # rank 1's disk is full as it writes its part of checkpoint 8
    write_text = pathlib.Path.write_text
    def full(self, *args, **kwargs):
        if self.name == "rank1.json" and "step_000008" in str(self):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_text(self, *args, **kwargs)
    pathlib.Path.write_text = full
"""


def test_a_full_disk_on_rank_1_ends_in_one_line_with_checkpoint_and_model_consistent(
    dataset, tmp_path
):
    """torchrun, 2 ranks on gloo: rank 1 (only) finds its disk full while writing its part of a
    checkpoint, after DCP's collective write. Once rank 0 went on to the next collective and died of
    a "Connection closed by peer" traceback; now every rank stops, rank 0 prints one line naming
    rank 1's failure, and the previous checkpoint and the model export are left, consistent. (The
    full disk is simulated: a sitecustomize on rank 1.)"""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(FULL_ON_RANK_1)
    config = config_file(tmp_path, dataset)
    run = tmp_path / "run"
    result = run_subprocess(
        2, config, run, env={"PYTHONPATH": str(tmp_path / "inject"), "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    checkpoint = run / "train_state" / "step_000008"
    expected = f"error: rank 1 failed to save: cannot write {checkpoint}: No space left on"
    assert len(errors) == 1 and errors[0].startswith(expected), result.stderr
    # a worker's trace
    assert "[rank" not in result.stderr and "Connection closed" not in result.stderr, result.stderr
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]
    assert [p.name for p in checkpoints(run)] == ["step_000004"]
    model, _ = load_model(run)
    weights = checkpoint_weights(run / "train_state" / "step_000004", model.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_a_run_off_llamas_format_says_at_start_what_it_gives_up(dataset, tmp_path, capsys):
    config = config_file(tmp_path, dataset, eval={"interval": 0}, checkpoint={"interval": 0})
    assert run_in_process(config, tmp_path / "llama", "--train.max_steps=1") == 0
    assert "leaves LLaMA's format" not in capsys.readouterr().out
    assert (
        run_in_process(config, tmp_path / "qk", "--train.max_steps=1", "--model.qk_norm=true") == 0
    )
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "leaves LLaMA's format" in line]
    assert "model.qk_norm" in line and "to-hf" in line and "to-gguf" in line
    assert out.index(line) < out.index("step 1")
