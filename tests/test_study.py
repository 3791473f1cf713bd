"""The retrieval study (study.py) and extrapolate's retrieval track: distances, the effective-context rule, scoring
on a model that retrieves perfectly, and the --quick study trained end to end."""

import json

import pytest
import torch

import generate
from data.retrieval import RetrievalTask
from model import ROPE_SCALINGS
from picollama.cli import ArgumentParser, run_command
from picollama.lab import extrapolate, study

TASK = RetrievalTask(keys=16, values=16, pairs=4)


def test_retrieval_distances_reach_every_doubling_in_rows_of_the_longest_length():
    assert extrapolate.retrieval_distances(32, 512, 4) == [8, 16, 24, 56, 120, 248, 504]
    assert all(d % 2 == 0 for d in extrapolate.retrieval_distances(36, 144, 3))


def test_retrieval_effective_context_keeps_half_the_in_context_accuracy():
    cells = {"32": {"mean": 0.9}, "64": {"mean": 0.46}, "128": {"mean": 0.44}, "256": {"mean": 0.5}}
    assert extrapolate.retrieval_effective(cells, 32) == {
        "tokens": 64,
        "in_context": 0.9,
    }  # the first miss ends it
    assert (
        extrapolate.retrieval_effective({"32": {"mean": 0.9}, "64": None}, 32)["tokens"] == 32
    )  # a table's end
    # a run that does not retrieve in context has no effective context
    assert (
        extrapolate.retrieval_effective({"32": {"mean": 0.3}, "64": {"mean": 0.3}}, 32)["tokens"]
        is None
    )


def recall(tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a perfect retriever: at each position, the value after the latest earlier occurrence of its key."""
    logits = torch.zeros(*tokens.shape, TASK.vocab_size)
    for b, row in enumerate(tokens.tolist()):
        for i, token in enumerate(row):
            earlier = [j for j in range(i) if row[j] == token]
            if earlier and earlier[-1] + 1 < len(row):
                logits[b, i, row[earlier[-1] + 1]] = 1.0
    return logits


def test_retrieval_scores_read_every_query_of_each_row():
    batches = TASK.fixed_batches(2, 4, 64)
    assert extrapolate.retrieval_scores(recall, batches, "cpu").tolist() == [1.0] * 8
    wrong = extrapolate.retrieval_scores(
        lambda x: torch.zeros(*x.shape, TASK.vocab_size), batches, "cpu"
    )
    assert wrong.tolist() == [0.0] * 8  # argmax 0 is the filler, never a value


def test_the_quick_study_trains_and_rope_retrieves_in_context(tmp_path, capsys):
    """RoPE and the YaRN fine-tune from the RoPE run (train.init_from), side by side."""
    out = tmp_path / "study"
    assert run_command(study.main, ["--quick", "--runs", "rope,rope-yarn", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"wrote {out}/study.md")
    report = json.loads((out / "compare" / "extrapolation.json").read_text())
    runs = {run["name"].rsplit("/", 1)[-1]: run for run in report["runs"]}
    assert report["lengths"] == [32, 64, 128] and report["task"]["chance"] == 1 / 64
    assert runs["rope"]["methods"] == list(ROPE_SCALINGS)
    in_context = runs["rope"]["accuracy"]["none"]["32"]["mean"]
    assert in_context > 0.5, (
        in_context
    )  # chance is 1/64; guessing among the row's 4 values gives 1/4
    assert runs["rope-yarn"]["train_context"] == 128 and runs["rope-yarn"]["original_context"] == 32
    for run in runs.values():
        for method in run["methods"]:
            cells = [c for c in run["accuracy"][method].values() if c is not None]
            assert cells and all(0 <= c["mean"] <= 1 and c["n"] == study.QUICK_ROWS for c in cells)
    trained = json.loads((out / "study.json").read_text())["runs"]
    assert set(trained) == {"rope", "rope-yarn"} and all(t["cpu_s"] > 0 for t in trained.values())
    assert trained["rope"]["steps"] == 400  # --quick's steps win over the study's 1,500
    table = (out / "study.md").read_text()
    assert (
        "| `rope` | RoPE |" in table
        and "By key-query distance" in table
        and "rope-yarn` | yarn |" in table
    )


@pytest.mark.parametrize(
    "flags, steps",
    [
        ([], "2000"),
        (["--quick"], "400"),
        (["--steps", "7"], "7"),
        (["--quick", "--steps", "7"], "7"),
    ],
)
def test_a_runs_own_steps_beat_the_study_s_and_quick_and_steps_beat_both(
    tmp_path, monkeypatch, flags, steps
):
    seen = {}
    monkeypatch.setattr(
        study, "train_run", lambda name, overrides, out: seen.setdefault(name, overrides)
    )
    parser = ArgumentParser(prog="study")
    study.add_arguments(parser)
    study.train_all(study.chosen_runs(["learned"]), tmp_path, parser.parse_args(flags), [])
    assert [f for f in seen["learned"] if f.startswith("--train.max_steps=")][
        -1
    ] == f"--train.max_steps={steps}"


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
    argv = [
        "extrapolate",
        "--run",
        f"{tmp_path / 'a'},{tmp_path / 'b'}",
        "--out",
        str(tmp_path / "c"),
    ]
    assert run_command(generate.main, argv) == 2
    assert "trained on different tasks" in capsys.readouterr().err and not (tmp_path / "c").exists()
