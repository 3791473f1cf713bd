"""The study's seeds (--seeds, a recipe's `seeds`): each run trained at train.seed + 0, 1, ...,
the report's mean and min-max across seeds, and orderings called only where those ranges separate;
and effective context both ways (a share of the in-context accuracy, and RULER's threshold)."""

import json

import pytest

from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.flags import ArgumentParser
from picollama.lab import passkey, plots, recipe, report, seeds, study

RECIPE = """config = "configs/retrieval.toml"
multiples = [1, 2]
rows = 8
steps = 8
settings.eval = { interval = 0 }
[[runs]]
name = "rope"
what = "RoPE"
[[runs]]
name = "rope-yarn"
what = "RoPE fine-tuned with YaRN"
from = "rope"
stretch = 2
steps = 5
settings.model = { rope_scaling = "yarn", rope_factor = 2 }
"""


def write_recipe(tmp_path, more: str = "") -> str:
    path = tmp_path / "recipe.toml"
    path.write_text(RECIPE.replace("rows = 8", "rows = 8" + more))
    return str(path)


def planned(tmp_path, *flags: str):
    parser = ArgumentParser(prog="study")
    study.add_arguments(parser)
    args = parser.parse_args([*flags, "--out", str(tmp_path / "out")])
    return study.plan(study.load_recipe(args.recipe), args)


def test_one_seed_plans_the_study_as_before(tmp_path):
    """No seed key is set, no run is renamed: a one-seed study trains what it always did."""
    commands, configs = planned(tmp_path, "--recipe", write_recipe(tmp_path))
    assert list(commands) == ["rope", "rope-yarn"]
    assert not any(f.startswith("--train.seed") for c in commands.values() for f in c)
    assert configs["rope"].train.seed == 1337  # the config's


@pytest.mark.parametrize("how", ["flag", "recipe"])
def test_each_seed_trains_its_own_runs_a_fine_tune_from_its_own_seed(tmp_path, how):
    flags = ["--seeds", "3"] if how == "flag" else []
    path = write_recipe(tmp_path, "\nseeds = 3" if how == "recipe" else "")
    commands, configs = planned(tmp_path, "--recipe", path, *flags)
    assert list(commands) == [
        "rope",
        "rope-yarn",
        "rope-seed1",
        "rope-yarn-seed1",
        "rope-seed2",
        "rope-yarn-seed2",
    ]
    seeds = [configs[name].train.seed for name in ("rope", "rope-seed1", "rope-seed2")]
    assert seeds == [1337, 1338, 1339]
    assert configs["rope-yarn-seed2"].train.seed == 1339
    assert configs["rope-yarn-seed1"].train.init_from == str(tmp_path / "out" / "rope-seed1")
    assert configs["rope-seed1"].train.out_dir == str(tmp_path / "out" / "rope-seed1")


def test_seeds_offset_a_recipe_s_own_seed(tmp_path):
    path = write_recipe(tmp_path, "\nsettings.train = { seed = 7 }")
    _, configs = planned(tmp_path, "--recipe", path, "--seeds", "2")
    assert (configs["rope"].train.seed, configs["rope-seed1"].train.seed) == (7, 8)


def test_a_seeded_name_that_is_another_run_s_is_refused():
    runs = [recipe.Run("a", "x", recipe.Level(), recipe.Level())]
    runs.append(recipe.Run("a-seed1", "y", recipe.Level(), recipe.Level()))
    assert [r.name for r in recipe.seeded_runs(runs, 1)] == ["a", "a-seed1"]
    with pytest.raises(UserError, match="seed 1 is named a-seed1"):
        recipe.seeded_runs(runs, 2)


@pytest.mark.parametrize(
    "argv, message", [(["--seeds", "0"], "--seeds"), (["--seeds", "x"], "--seeds")]
)
def test_bad_seeds_are_one_line(tmp_path, capsys, argv, message):
    assert run_command(study.main, [*argv, "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_a_bad_seeds_key_in_a_recipe_is_one_line(tmp_path, capsys):
    path = write_recipe(tmp_path, "\nseeds = 0")
    assert run_command(study.main, ["--recipe", path, "--out", str(tmp_path / "s")]) == 2
    assert "seeds must be a positive integer, not 0" in capsys.readouterr().err


def cell(mean: float) -> dict:
    return {"mean": mean, "sem": 0.01, "n": 8}


def fake_report(values: dict) -> dict:
    """A retrieval report of runs {folder: {method: [accuracy at 32, at 64]}}."""
    runs = []
    for folder, methods in values.items():
        accuracy = {m: {"32": cell(a), "64": cell(b)} for m, (a, b) in methods.items()}
        runs.append({"name": f"/out/{folder}", "methods": list(methods), "accuracy": accuracy})
    return {"kind": "retrieval", "lengths": [32, 64], "runs": runs}


REPORT = fake_report(
    {
        "rope": {"none": [1.0, 0.60], "yarn": [1.0, 0.90]},
        "rope-seed1": {"none": [0.98, 0.50], "yarn": [0.96, 0.95]},
        "rope-seed2": {"none": [1.0, 0.70], "yarn": [0.99, 0.85]},
        "nope": {"none": [0.90, 0.40]},
        "nope-seed1": {"none": [0.80, 0.65]},
        "nope-seed2": {"none": [0.85, 0.30]},
    }
)
GROUPS = {
    "rope": ["rope", "rope-seed1", "rope-seed2"],
    "nope": ["nope", "nope-seed1", "nope-seed2"],
}


def test_the_mean_and_spread_across_seeds_are_the_hand_computed_ones():
    summary = seeds.seeds_summary(REPORT, GROUPS)
    none = summary["runs"]["rope"]["none"]["64"]
    assert none["mean"] == pytest.approx(0.60) and (none["min"], none["max"]) == (0.50, 0.70)
    yarn = summary["runs"]["rope"]["yarn"]["32"]
    assert yarn["mean"] == pytest.approx((1.0 + 0.96 + 0.99) / 3) and yarn["n"] == 3
    assert summary["runs"]["nope"]["none"]["32"] == {
        "mean": pytest.approx(0.85),
        "min": 0.80,
        "max": 0.90,
        "n": 3,
    }
    assert summary["seeds"] == {"rope": 3, "nope": 3} and summary["spread"].startswith("min-max")


def test_an_ordering_is_called_only_where_the_ranges_separate():
    tiers = seeds.seeds_summary(REPORT, GROUPS)["tiers"]
    # at 32: RoPE's ranges [0.98, 1.0] and [0.96, 1.0] overlap each other, and lie above NoPE's
    # [0.80, 0.90]
    assert tiers["32"] == [[["rope", "none"], ["rope", "yarn"]], [["nope", "none"]]]
    # at 64: yarn [0.85, 0.95] is above RoPE none [0.5, 0.7], which overlaps NoPE [0.3, 0.65]
    assert tiers["64"] == [[["rope", "yarn"]], [["rope", "none"], ["nope", "none"]]]
    lines = seeds.seeds_markdown(REPORT, GROUPS)
    assert "- 64: `rope` yarn > `rope` none, `nope` none" in lines
    assert "| `rope` | none | 99% [98%–100%] | 60% [50%–70%] |" in lines


def test_overlap_through_a_third_range_shares_a_tier():
    cells = {
        "a": {"mean": 0.9, "min": 0.85, "max": 0.95},
        "b": {"mean": 0.8, "min": 0.70, "max": 0.86},  # overlaps a
        "c": {"mean": 0.6, "min": 0.50, "max": 0.72},  # overlaps b, not a
        "d": {"mean": 0.2, "min": 0.10, "max": 0.30},
    }
    assert not seeds.separated(cells["a"], cells["b"]) and seeds.separated(cells["a"], cells["c"])
    assert seeds.tiers(cells, higher=True) == [["a", "b", "c"], ["d"]]
    # perplexity: lower is better, the tiers run the other way
    assert seeds.tiers(cells, higher=False) == [["d"], ["c", "b", "a"]]


def test_with_one_seed_there_is_no_seeds_section():
    assert seeds.seeds_markdown(REPORT, {}) == []
    assert study.seed_groups([recipe.Run("a", "x", recipe.Level(), recipe.Level())]) == {}


def test_a_text_study_is_compared_on_perplexity_lower_first():
    runs = []
    for folder, (ppl_a, ppl_b) in {"rope": (60, 62), "rope-seed1": (61, 63)}.items():
        cells = {"256": {"perplexity": ppl_a}, "512": {"perplexity": ppl_b}}
        alibi = {"256": {"perplexity": ppl_a + 10}, "512": {"perplexity": ppl_b - 20}}
        perplexity = {"none": cells, "alibi": alibi}
        runs.append({"name": folder, "methods": ["none", "alibi"], "perplexity": perplexity})
    text = {"lengths": [256, 512], "runs": runs}
    summary = seeds.seeds_summary(text, {"rope": ["rope", "rope-seed1"]})
    assert summary["metric"] == "perplexity (perplexity)"
    assert summary["tiers"]["256"] == [[["rope", "none"]], [["rope", "alibi"]]]
    assert summary["tiers"]["512"] == [[["rope", "alibi"]], [["rope", "none"]]]


def test_effective_context_by_an_accuracy_threshold_on_constructed_curves():
    curve = {
        "32": {"mean": 0.95},
        "64": {"mean": 0.81},
        "128": {"mean": 0.79},
        "256": {"mean": 0.9},
    }
    assert passkey.THRESHOLD == 0.8
    assert passkey.effective_length(curve, "mean") == 64  # the first miss ends it
    assert passkey.effective_length({"32": {"mean": 0.5}, "64": {"mean": 0.9}}, "mean") is None
    assert passkey.effective_length({"32": {"mean": 0.9}, "64": None}, "mean") == 32  # its table
    both = {
        "kind": "retrieval",
        "threshold": 0.8,
        "runs": [
            {
                "name": "rope",
                "methods": ["none"],
                "train_context": 32,
                "effective_context": {"none": {"tokens": 128}},
                "accuracy_effective": {"none": 64},
            }
        ],
    }
    lines = report.effective_table(both, with_basis=False)
    assert lines[0] == "| method | training context | effective context | accuracy ≥ 80% |"
    assert lines[2] == "| none | 32 | 128 | 64 |"
    del both["threshold"]  # a report from before the threshold: one way, as it was
    assert report.effective_table(both, with_basis=False)[2] == "| none | 32 | 128 |"


def test_seeds_train_distinct_runs_end_to_end(tmp_path, capsys):
    """Two seeds of an 8-step run: distinct weights and numbers, each cell's mean and range across
    them in study.md and study.json."""
    argv = ["--recipe", write_recipe(tmp_path), "--runs", "rope", "--seeds", "2"]
    assert run_command(study.main, [*argv, "--out", str(tmp_path / "s")]) == 0
    capsys.readouterr()
    out = tmp_path / "s"
    numbers = json.loads((out / "study.json").read_text())
    assert set(numbers["runs"]) == {"rope", "rope-seed1"}
    assert "--train.seed=1338" in numbers["runs"]["rope-seed1"]["command"]
    first, second = ((out / name / "metrics.jsonl").read_text() for name in ("rope", "rope-seed1"))
    assert first != second  # another seed: other data and weights, other losses
    compared = json.loads((out / "compare" / "extrapolation.json").read_text())
    by_name = {r["name"].rsplit("/", 1)[-1]: r for r in compared["runs"]}
    values = [by_name[name]["accuracy"]["yarn"]["64"]["mean"] for name in ("rope", "rope-seed1")]
    summary = numbers["seeds"]["runs"]["rope"]["yarn"]["64"]
    assert summary["mean"] == pytest.approx(sum(values) / 2)
    assert (summary["min"], summary["max"]) == (min(values), max(values))
    markdown = (out / "study.md").read_text()
    assert "## Across seeds (2 a run)" in markdown and "| `rope-seed1` | RoPE |" in markdown


def test_the_text_recipe_plans_the_perplexity_study_with_the_new_encodings(tmp_path):
    path = str(study.REPO_ROOT / "configs/study/text.toml")
    commands, configs = planned(tmp_path, "--recipe", path)
    assert list(commands) == [
        "rope",
        "alibi",
        "nope",
        "sinusoidal",
        "rope-logn",
        "rope-copy",
        "prope",
        "fox",
        "rope-ssmax",
        "rope-yarn",
    ]
    assert configs["rope"].train.max_steps == 900 and configs["rope"].train.max_minutes is None
    prope = configs["prope"].model
    assert (prope.position, prope.rope_fraction) == ("prope", 0.75)
    assert configs["fox"].model.position == "fox" and configs["rope-ssmax"].model.ssmax
    assert configs["rope-yarn"].train.seq_len == 1024 and configs["rope-yarn"].optim.lr == 2e-3
    _, quick = planned(tmp_path, "--recipe", path, "--quick")
    assert quick["rope"].train.max_steps == 30 and quick["rope-yarn"].train.max_steps == 10


def retrieval_runs(name: str, accuracy: list[float]) -> dict:
    """A retrieval report's run at lengths 32 and 64, with its accuracy there."""
    cells = {str(n): {"mean": a} for n, a in zip((32, 64), accuracy)}
    run = dict(name=f"out/{name}", methods=["none"], accuracy={"none": cells})
    return run | dict(original_context=32, train_context=32)


def test_the_figure_draws_a_run_s_seeds_as_their_mean_in_a_min_max_band(tmp_path, monkeypatch):
    drawn = []

    def keep(fig, axes, path, note=""):
        drawn.extend(axes)

    monkeypatch.setattr(plots, "save_figure", keep)
    older = {"lengths": [32, 64], "task": {"chance": 0.1}, "runs": [retrieval_runs("rope", [0, 0])]}
    seeds = [retrieval_runs("rope", [0.9, 0.5]), retrieval_runs("rope-seed1", [0.7, 0.3])]
    newer = {**older, "runs": seeds}
    plots.side_by_side_plot([], [older, newer], tmp_path / "study.png")  # the last one draws
    text, retrieval = drawn  # one pair of panels: one run, its seeds under its name
    assert text.get_title() == "rope: perplexity ratio" and not text.lines
    (line,) = [line for line in retrieval.lines if line.get_label() == "none"]
    assert list(line.get_xdata()) == [1, 2]
    assert list(line.get_ydata()) == pytest.approx([0.8, 0.4])
    (band,) = retrieval.collections
    low, high = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
    assert (low, high) == pytest.approx((0.3, 0.9))


def test_the_ratio_panels_share_a_range_that_spans_the_drawn_ratios(tmp_path, monkeypatch):
    """Every perplexity-ratio panel gets the same y range, from the ratios drawn (with a margin)
    rather than a fixed 0.6–30×: lines near 1× stay apart, the largest ratio stays in view."""
    drawn = []

    def keep(fig, axes, path, note=""):
        drawn.extend(axes)

    monkeypatch.setattr(plots, "save_figure", keep)

    def text_run(name: str, ratios: list[float | None]) -> dict:
        cells = {str(n): r and {"ratio": r} for n, r in zip((256, 512), ratios)}
        run = dict(name=f"out/{name}", methods=["none"], perplexity={"none": cells})
        return run | dict(original_context=256, train_context=256)

    text = {
        "lengths": [256, 512],
        "runs": [text_run("rope", [1, 2.5]), text_run("nope", [1, None])],
    }
    plots.side_by_side_plot([text], [], tmp_path / "study.png")
    limits = [ax.get_ylim() for ax in drawn if ax.get_title().endswith("perplexity ratio")]
    assert limits == [pytest.approx((0.8 / 1.1, 2.5 * 1.1))] * 2


def test_methods_with_the_same_numbers_are_one_line_named_for_each(tmp_path, monkeypatch):
    """ntk and dynamic NTK read the same wherever a forward's end is its length: one line,
    `ntk = dynamic`, so that a panel keeps to 8 lines with every method."""
    drawn = []

    def keep(fig, axes, path, note=""):
        drawn.extend(axes)

    monkeypatch.setattr(plots, "save_figure", keep)
    run = retrieval_runs("rope", [1.0, 0.5])
    same = run["accuracy"]["none"]
    run |= dict(methods=["ntk", "dynamic", "yarn"])
    run["accuracy"] = {"ntk": same, "dynamic": same, "yarn": {"32": {"mean": 1}, "64": {"mean": 1}}}
    retrieval = {"lengths": [32, 64], "task": {"chance": 0.1}, "runs": [run]}
    plots.side_by_side_plot([], [retrieval], tmp_path / "study.png")
    lines = {
        line.get_label(): list(line.get_ydata())
        for line in drawn[1].lines
        if line.get_label()[0] != "_"
    }
    assert lines == {"ntk = dynamic": [1.0, 0.5], "yarn": [1, 1]}
