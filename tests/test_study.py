"""The retrieval study (study.py) and extrapolate's retrieval track: the recipe
(configs/study/retrieval.toml) and the configs it trains, distances, the effective-context rule,
scoring on a model that retrieves perfectly, and the --quick study trained end to end."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from conftest import write_corpus

import generate
from data.build import prepare
from data.retrieval import RetrievalTask
from model import ModelArgs, Transformer
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import ArgumentParser
from picollama.components.registry import ROPE_SCALINGS
from picollama.config.training import parse_cli
from picollama.lab import retrieval_track, study
from picollama.run_files import save_model

TASK = RetrievalTask(keys=16, values=16, pairs=4)


def test_retrieval_distances_reach_every_doubling_in_rows_of_the_longest_length():
    assert retrieval_track.retrieval_distances(32, 512, 4) == [8, 16, 24, 56, 120, 248, 504]
    assert all(d % 2 == 0 for d in retrieval_track.retrieval_distances(36, 144, 3))


def test_retrieval_effective_context_keeps_half_the_in_context_accuracy():
    cells = {"32": {"mean": 0.9}, "64": {"mean": 0.46}, "128": {"mean": 0.44}, "256": {"mean": 0.5}}
    # the first miss ends it
    assert retrieval_track.retrieval_effective(cells, 32) == {"tokens": 64, "in_context": 0.9}
    # a table's end
    table_end = {"32": {"mean": 0.9}, "64": None}
    assert retrieval_track.retrieval_effective(table_end, 32)["tokens"] == 32
    # a run that does not retrieve in context has no effective context
    cells = {"32": {"mean": 0.3}, "64": {"mean": 0.3}}
    assert retrieval_track.retrieval_effective(cells, 32)["tokens"] is None


def recall(tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a perfect retriever: at each position, the value after the latest earlier
    occurrence of its key."""
    logits = torch.zeros(*tokens.shape, TASK.vocab_size)
    for b, row in enumerate(tokens.tolist()):
        for i, token in enumerate(row):
            earlier = [j for j in range(i) if row[j] == token]
            if earlier and earlier[-1] + 1 < len(row):
                logits[b, i, row[earlier[-1] + 1]] = 1.0
    return logits


def never(tokens: torch.Tensor) -> torch.Tensor:
    return torch.zeros(*tokens.shape, TASK.vocab_size)


def test_retrieval_scores_read_every_query_of_each_row():
    batches = TASK.fixed_batches(2, 4, 64)
    assert retrieval_track.retrieval_scores(recall, batches, "cpu").tolist() == [1.0] * 8
    wrong = retrieval_track.retrieval_scores(never, batches, "cpu")
    assert wrong.tolist() == [0.0] * 8  # argmax 0 is the filler, never a value


# The --quick study of the tests: the recipe's own RoPE (its 400 steps: at seed 1337 train.py's
# val_acc reads 93%, past the 1/pairs plateau), half the evaluation rows (16 a length and distance,
# 64 queries), and the runs that check the pipeline, not accuracy (the new encodings, the YaRN
# fine-tune), 10 steps.
QUICK_STEPS, QUICK_ROWS, FEW = 400, 16, 10
FEW_STEPS = ("prope", "fox", "rope-ssmax")
STUDY_RUNS = ("rope", "rope-yarn", *FEW_STEPS)


def quick_recipe(path: Path) -> Path:
    """The study's recipe with --quick as above, written to path."""
    text = (study.REPO_ROOT / study.RECIPE).read_text()
    quick = f"rows = {QUICK_ROWS}\nsteps = {QUICK_STEPS}\n"
    edits = {
        "\nrows = 32\nsteps = 400\n": "\n" + quick,
        **{f'name = "{run}"\n': f'name = "{run}"\nquick.steps = {FEW}\n' for run in FEW_STEPS},
        "\nquick.steps = 30\n": f"\nquick.steps = {FEW}\n",  # rope-yarn's
    }
    for old, new in edits.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory):
    """One --quick study of RoPE, its YaRN fine-tune (train.init_from) and the new encodings,
    trained once for the tests that read it: (its exit status, what it printed, its --out, its
    recipe). --out is relative to a folder outside the repository (train.py runs in the
    repository)."""
    folder = tmp_path_factory.mktemp("quick")
    recipe = quick_recipe(folder / "recipe.toml")
    argv = ["--recipe", str(recipe), "--quick", "--runs", ",".join(STUDY_RUNS), "--out", "study"]
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.chdir(folder)
        status = run_command(study.main, argv)
    return status, printed.getvalue(), folder / "study", recipe


def test_the_quick_study_trains_and_rope_retrieves_in_context(quick_study):
    """RoPE and the YaRN fine-tune from the RoPE run (train.init_from), side by side; --out
    relative to a folder outside the repository (train.py runs in the repository)."""
    status, printed, out, recipe = quick_study
    assert status == 0
    assert printed.strip().splitlines()[-1].startswith(f"wrote {out}/study.md")
    report = json.loads((out / "compare" / "extrapolation.json").read_text())
    runs = {run["name"].rsplit("/", 1)[-1]: run for run in report["runs"]}
    assert report["lengths"] == [32, 64, 128] and report["task"]["chance"] == 1 / 64
    assert runs["rope"]["methods"] == list(ROPE_SCALINGS)
    in_context = runs["rope"]["accuracy"]["none"]["32"]["mean"]
    # chance is 1/64; guessing among the row's 4 values gives 1/4
    assert in_context > 0.5, in_context
    assert runs["rope-yarn"]["train_context"] == 128 and runs["rope-yarn"]["original_context"] == 32
    rows = study.load_recipe(recipe).quick.rows
    for run in runs.values():
        for method in run["methods"]:
            cells = [c for c in run["accuracy"][method].values() if c is not None]
            assert cells and all(0 <= c["mean"] <= 1 and c["n"] == rows for c in cells)
    trained = json.loads((out / "study.json").read_text())["runs"]
    assert set(trained) == set(STUDY_RUNS) and all(t["cpu_s"] > 0 for t in trained.values())
    # --quick's steps win over the study's 1,500, and a run's own --quick steps over those
    assert trained["rope"]["steps"] == QUICK_STEPS and trained["fox"]["steps"] == FEW
    table = (out / "study.md").read_text()
    assert "| `rope` | RoPE |" in table and "By key-query distance" in table
    assert "rope-yarn` | yarn |" in table


def test_the_new_encodings_train_and_every_method_is_compared(quick_study):
    """p-RoPE, FoX and RoPE + SSMax train beside RoPE (a few steps: the pipeline, not accuracy),
    and the training-free methods that attend in two branches are scored on the RoPE runs."""
    status, _, out, _ = quick_study
    assert status == 0
    report = json.loads((out / "compare" / "extrapolation.json").read_text())
    runs = {run["name"].rsplit("/", 1)[-1]: run for run in report["runs"]}
    assert [runs[name]["position"] for name in ("prope", "fox")] == ["prope", "fox"]
    assert runs["rope-ssmax"]["model"]["ssmax"] and runs["fox"]["methods"] == ["none"]
    for name in ("rope", "prope", "rope-ssmax"):
        assert {"rerope", "self_extend"} <= set(runs[name]["methods"])
        assert all(runs[name]["accuracy"]["rerope"][str(n)] is not None for n in report["lengths"])
    table = (out / "study.md").read_text()
    assert "| `prope` | p-RoPE (highest 75% of frequencies) |" in table
    assert "study/rope` | rerope |" in table and "study/rope` | self_extend |" in table


def planned(tmp_path, *flags: str):
    """study.plan on the default recipe: train.py's arguments and the config of every run."""
    parser = ArgumentParser(prog="study")
    study.add_arguments(parser)
    args = parser.parse_args([*flags, "--out", str(tmp_path)])
    return study.plan(study.load_recipe(args.recipe), args)


@pytest.mark.parametrize(
    "flags, steps, fine_tune",
    [
        ([], 2000, 150),
        (["--quick"], 400, 30),
        (["--steps", "7"], 7, 150),
        (["--quick", "--steps", "7"], 7, 30),
    ],
)
def test_a_runs_own_steps_beat_the_study_s_and_quick_and_steps_beat_both(
    tmp_path, flags, steps, fine_tune
):
    """--steps sets every run's but a fine-tune's, which keeps its own (and --quick's own)."""
    commands, configs = planned(tmp_path, *flags)
    assert configs["learned"].train.max_steps == steps
    assert [f for f in commands["learned"] if f.startswith("--train.max_steps=")] == [
        f"--train.max_steps={steps}"
    ]
    assert configs["rope-yarn"].train.max_steps == fine_tune


def test_every_run_of_the_recipe_is_the_config_train_py_reads(tmp_path):
    commands, configs = planned(tmp_path)
    assert list(commands) == [
        "rope",
        "alibi",
        "nope",
        "sinusoidal",
        "learned",
        "rope-random",
        "rope-logn",
        "prope",
        "fox",
        "rope-ssmax",
        "rope-yarn",
    ]
    assert commands["rope"][:2] == ["--config", str(study.REPO_ROOT / "configs/retrieval.toml")]
    assert all(config.optim.min_lr == 1e-4 for config in configs.values())
    assert configs["nope"].model.qk_norm and configs["nope"].data.retrieval_filler == 0.25
    assert configs["sinusoidal"].optim.name == "muon" and configs["rope"].train.max_steps == 1500
    yarn = configs["rope-yarn"]
    assert yarn.train.init_from == str(tmp_path / "rope") and yarn.train.out_dir == str(
        tmp_path / "rope-yarn"
    )
    # 4 × the RoPE run's context, at YaRN's factor 4
    assert yarn.train.seq_len == yarn.model.max_seq_len == 128 and yarn.model.rope_factor == 4
    assert (yarn.model.rope_scaling, yarn.train.batch_size, yarn.optim.warmup_steps) == (
        "yarn",
        32,
        15,
    )
    _, quick = planned(tmp_path, "--quick")
    assert quick["rope-yarn"].train.batch_size == 16 and quick["rope"].eval.interval == 0


def stop_training(monkeypatch):
    def stop(*args):
        raise UserError("stopped before training")

    monkeypatch.setattr(study, "train_all", stop)


RECIPE = """config = "configs/retrieval.toml"
multiples = [1, 2]
rows = 8
[[runs]]
name = "rope"
what = "RoPE"
"""


@pytest.mark.parametrize(
    "more, message",
    [
        ("", None),
        ("setting = 1", "runs[0] (rope): unknown key 'setting' (valid: name, what"),
        ('[[runs]]\nwhat = "x"', "runs[1]: name is missing"),
        ('[[runs]]\nname = "rope"\nwhat = "again"', "two runs are named rope"),
        ('[[runs]]\nname = "b"\nwhat = "x"\nfrom = "c"', "from 'c' names no earlier run"),
        ('[[runs]]\nname = "../b"\nwhat = "x"', "name '../b' must be a folder name"),
        ("stretch = 2", "stretch needs from"),
        (
            '[[runs]]\nname = "b"\nwhat = "x"\nfrom = "rope"\nsettings.train = { seq_len = 64 }',
            "(b): settings train.seq_len: from and stretch set it",
        ),
        ("steps = 0", "steps must be a positive integer, not 0"),
        ("settings.train = { max_steps = 5 }", "settings train.max_steps: steps sets it"),
        ("settings.model = { n_head = 4 }", "unknown config key model.n_head"),
        ('settings.optim = { name = "sgd" }', "optim.name"),
        ("settings.train = { seq_len = 64 }", "train.seq_len (64) exceeds"),
        ("settings = 3", "settings must be a table of config sections"),
        ("quick.rows = 2", "(rope) quick: unknown key 'rows' (valid: steps, settings)"),
        ("what = [", "is not valid TOML"),
    ],
)
def test_a_bad_recipe_is_one_line_before_any_work(tmp_path, capsys, monkeypatch, more, message):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE + more + "\n")
    out = tmp_path / "out"
    stop_training(monkeypatch)
    status = run_command(study.main, ["--recipe", str(recipe), "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: ") and err.count("\n") == 1
    if message is None:  # the good recipe gets as far as training
        assert "stopped before training" in err
    else:
        assert message in err and not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--runs", "rope,t5"], "--runs: unknown 't5'"),
        (["--runs", "rope-yarn"], "rope-yarn is fine-tuned from rope"),
    ],
)
def test_bad_study_arguments_are_one_line(tmp_path, capsys, argv, message):
    assert run_command(study.main, [*argv, "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "s").exists()


def test_runs_of_different_tasks_are_not_compared(tmp_path, capsys):
    for name, task in (("a", "retrieval"), ("b", "text")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"data": {"task": task}}))
    runs = f"{tmp_path / 'a'},{tmp_path / 'b'}"
    argv = ["extrapolate", "--run", runs, "--out", str(tmp_path / "c")]
    assert run_command(generate.main, argv) == 2
    assert "trained on different tasks" in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_a_relative_out_is_made_absolute_for_train_py(tmp_path, monkeypatch):
    """train.py runs in the repository: a relative --out given elsewhere must reach it absolute,
    or the runs land in the repository while the comparison looks in the caller's folder."""
    monkeypatch.chdir(tmp_path)
    parser = ArgumentParser(prog="study")
    study.add_arguments(parser)
    args = parser.parse_args(["--out", "rel"])
    commands, configs = study.plan(study.load_recipe(args.recipe), args)
    yarn = configs["rope-yarn"].train
    assert yarn.out_dir == str(tmp_path / "rel" / "rope-yarn")
    assert yarn.init_from == str(tmp_path / "rel" / "rope")
    for command in commands.values():
        paths = [command[1]] + [f.split("=", 1)[1] for f in command if f.startswith(PATH_FLAGS)]
        assert len(paths) > 1 and all(Path(p).is_absolute() for p in paths), command


PATH_FLAGS = ("--train.out_dir=", "--train.init_from=")


def study_error(argv: list[str], capsys) -> str:
    """The one `error:` line of a study that stops before training."""
    assert run_command(study.main, ["--runs", "rope", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    return err


@pytest.mark.parametrize("held", ["study.json", "logs/rope.log", "rope/config.json", "notes.txt"])
def test_a_study_never_writes_into_a_folder_that_holds_anything(
    tmp_path, capsys, monkeypatch, held
):
    """A second study into the same --out is refused before any training: the first one's log,
    runs and summary stay; so is a folder holding anything else."""
    stop_training(monkeypatch)
    out = tmp_path / "s"
    (out / held).parent.mkdir(parents=True, exist_ok=True)
    (out / held).write_text("the first study's")
    err = study_error(["--out", str(out)], capsys)
    assert f"--out {out} already holds {held.split('/')[0]}" in err and "replaces nothing" in err
    assert (out / held).read_text() == "the first study's"
    assert [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()] == [held]
    (out / held).unlink()
    for folder in sorted(out.iterdir(), reverse=True):
        folder.rmdir()
    assert "stopped before training" in study_error(["--out", str(out)], capsys)  # empty: fine


@pytest.mark.parametrize("recipe", ["retrieval", "text"])
def test_a_study_writes_by_default_into_out_named_for_its_recipe(
    tmp_path, capsys, monkeypatch, recipe
):
    """Without --out, the retrieval recipe's study goes to out/retrieval-study and the text
    recipe's to out/text-study (relative to the caller's folder), never one into the other's."""
    stop_training(monkeypatch)
    monkeypatch.chdir(tmp_path)
    path = study.REPO_ROOT / f"configs/study/{recipe}.toml"
    assert "stopped before training" in study_error(["--recipe", str(path)], capsys)
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == [
        "out",
        f"out/{recipe}-study",
        f"out/{recipe}-study/logs",
    ]


TEXT_REPORT = study.REPO_ROOT / "docs/results/extrapolation_study.json"  # the perplexity study's


@pytest.mark.parametrize(
    "beside, message",
    [
        (
            "config.json",
            "must be a text study's extrapolation.json (generate.py extrapolate): it "
            "has no runs and lengths",
        ),
        ("retrieval.json", "it is a retrieval study's report"),
        ("broken.json", "not JSON"),
        ("missing.json", "cannot read --beside"),
        ("no-ratio.json", "a run has no 'ratio'"),
        (None, "stopped before training"),
    ],
)
def test_beside_must_be_a_text_report_before_any_training(
    tmp_path, capsys, monkeypatch, beside, message
):
    stop_training(monkeypatch)
    good = json.loads(TEXT_REPORT.read_text())
    del good["runs"][0]["perplexity"]["none"]["256"]["ratio"]
    files = {
        "config.json": json.dumps({"model": {"dim": 64}, "data": {"task": "retrieval"}}),
        "retrieval.json": (study.REPO_ROOT / "docs/results/retrieval_study.json").read_text(),
        "broken.json": "{",
        "no-ratio.json": json.dumps(good),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    path = tmp_path / beside if beside else TEXT_REPORT
    out = tmp_path / "s"
    err = study_error(["--beside", str(path), "--out", str(out)], capsys)
    assert message in err
    assert beside is None or not out.exists()


def retrieval_run(path, position: str):
    """An untrained run of the retrieval task TASK, with a context of 32."""
    torch.manual_seed(0)
    args = ModelArgs(
        dim=32, n_layers=2, n_heads=4, vocab_size=TASK.vocab_size, max_seq_len=32, position=position
    )
    data = {"task": "retrieval", "retrieval_keys": 16, "retrieval_values": 16, "retrieval_pairs": 4}
    return save_model(Transformer(args).eval(), path, {"data": data, "train": {"seq_len": 32}})


@pytest.mark.parametrize(
    "position, message",
    [
        ("alibi", "GB of memory (the weights"),  # mostly ALiBi's 65,536² bias per head
        ("rope", "would take about "),  # each forward of 64 rows of 65,536 tokens: minutes
    ],
)
def test_a_retrieval_evaluation_too_large_is_refused_before_any_work(
    tmp_path, capsys, monkeypatch, position, message
):
    def evaluated(*args):
        pytest.fail("evaluated")

    monkeypatch.setattr(retrieval_track, "evaluate_retrieval", evaluated)
    run = retrieval_run(tmp_path / position, position)
    argv = ["extrapolate", "--run", str(run), "--lengths", "32,65536", "--methods", "none"]
    assert run_command(generate.main, [*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this evaluation ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_missing_dataset_is_prepared_once_before_runs_train_side_by_side(tmp_path, monkeypatch):
    """Runs that share an unprepared data.dir would each start preparing it, and all but the first
    fail on its lock: the study prepares it first, once."""
    corpus, data_dir = write_corpus(tmp_path / "corpus"), tmp_path / "data"
    flags = [f"--data.dir={data_dir}", f"--data.source={corpus}", "--model.vocab_size=320"]
    configs = {
        name: parse_cli(["--config", "configs/default.toml", *flags, f"--train.seed={seed}"])[0]
        for seed, name in enumerate(["rope", "rope-seed1"])
    }
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(study, "prepare", counted)
    study.prepare_datasets(configs)
    assert len(calls) == 1 and (data_dir / "meta.json").is_file()
    study.prepare_datasets(configs)  # prepared: nothing to do
    assert len(calls) == 1
