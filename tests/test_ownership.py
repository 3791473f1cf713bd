"""What commands write and where: --force replaces only what picollama wrote, outputs go through
symbolic links, an empty --out is refused, and so is a --seed torch cannot tell apart."""

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from test_data import write_corpus

import train
from data import prepare as prepare_module
from data.build import prepare
from data.loader import load_meta
from picollama.cli import UserError, outputs
from picollama.cli import flags as cli
from picollama.cli.command import run_command
from picollama.convert import main as convert


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, Path]:
    """(texts, a dataset prepared from them): copy the dataset before changing it."""
    root = tmp_path_factory.mktemp("ownership")
    write_corpus(root / "texts", docs=10)
    return root / "texts", prepare(str(root / "texts"), vocab_size=300, out_dir=root / "data")


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under `folder` (links not followed), with its content's sha256."""
    return {
        str(path.relative_to(folder)): "folder"
        if path.is_dir() and not path.is_symlink()
        else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
    }


def one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def prepare_cli(texts: Path, out: Path, *args: str) -> int:
    vocab = [] if "--vocab-size" in args else ["--vocab-size", "300"]
    argv = ["--source", str(texts), *vocab, "--out", str(out), *args]
    return run_command(prepare_module.main, argv)


# ---------------------------------------------------------------- --force deletes only its own


def test_force_keeps_a_users_notes_in_a_dataset_folder(dataset, tmp_path, capsys):
    texts, data = dataset
    out = tmp_path / "data"
    shutil.copytree(data, out)
    (out / "NOTES.md").write_text("what I learned from this corpus\n")
    (out / "experiments").mkdir()
    (out / "experiments" / "run1.txt").write_text("loss 2.1\n")
    before = snapshot(out)
    for args in (["--force"], ["--vocab-size", "320"], ["--vocab-size", "320", "--force"]):
        assert prepare_cli(texts, out, *args) == 2
        err = one_error(capsys)
        assert f"not replacing {out}: it holds NOTES.md and experiments/" in err, err
        assert "pass --force" not in err
        assert snapshot(out) == before
    assert prepare_cli(texts, out) == 0  # the same inputs: reused, nothing deleted
    assert "already prepared" in capsys.readouterr().out and snapshot(out) == before


def test_a_folder_with_a_meta_json_of_its_own_is_left_alone(dataset, tmp_path, capsys):
    texts, _ = dataset
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("print('years of work')\n")
    (project / "README.md").write_text("# my project\n")
    (project / "meta.json").write_text('{"name": "project", "version": 3}\n')
    bare = tmp_path / "bare"  # only a meta.json, of someone else's
    bare.mkdir()
    (bare / "meta.json").write_text('{"format": "mine", "splits": []}\n')
    broken = tmp_path / "broken"  # a meta.json that is no JSON: picollama cannot tell it wrote it
    shutil.copytree(dataset[1], broken)
    (broken / "meta.json").write_text("{ not json")
    for out, held in (
        (project, "it holds README.md and src/"),
        (bare, "its meta.json is not a dataset's manifest"),
        (broken, "its meta.json is not a dataset's manifest"),
    ):
        before = snapshot(out)
        for force in ([], ["--force"]):
            assert prepare_cli(texts, out, *force) == 2
            err = one_error(capsys)
            assert f"not replacing {out}: {held}" in err and "pass --force" not in err, err
            assert snapshot(out) == before


def test_force_replaces_a_dataset_picollama_prepared(dataset, tmp_path, capsys):
    """Its shards, of either format, and what an interrupted write left."""
    texts, data = dataset
    out = tmp_path / "data"
    shutil.copytree(data, out)
    (out / "train-00000.bin").rename(out / "train.bin")  # format 2's name
    (out / ".meta.json.tmp-4242").write_text("half a write")
    assert prepare_cli(texts, out, "--vocab-size", "320", "--force") == 0, capsys.readouterr()
    assert load_meta(out)["vocab_size"] == 320 and not (out / "train.bin").exists()
    assert not (out / ".meta.json.tmp-4242").exists()


def test_check_replaceable_names_what_is_in_the_way(tmp_path):
    folder = tmp_path / "run"
    own = {"files": r"model\.safetensors|config\.json", "folders": "train_state"}
    outputs.check_replaceable(folder, **own)  # absent
    folder.mkdir()
    outputs.check_replaceable(folder, **own)  # empty
    for name in ("model.safetensors", "config.json", ".config.json.tmp-7", "train_state/a"):
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(name)
    (folder / "link.bin").symlink_to(tmp_path)  # a link is a file: only the link would go
    outputs.check_replaceable(folder, own["files"] + r"|link\.bin", own["folders"])
    (folder / "link.bin").unlink()
    outputs.check_replaceable(folder, **own, marks=["model.safetensors", "config.json"])
    with pytest.raises(UserError, match="it holds no tokenizer.model, so picollama did not"):
        outputs.check_replaceable(folder, **own, marks=["tokenizer.model"])
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()  # an own name, but a folder: it could hold anything
    with pytest.raises(UserError, match=r"it holds config\.json/, so .*; move them out"):
        outputs.check_replaceable(folder, **own)
    for i in range(5):
        (folder / f"mine{i}.txt").write_text("mine")
    with pytest.raises(UserError, match=r"holds config\.json/, mine0\.txt, mine1\.txt and 3 more"):
        outputs.check_replaceable(folder, **own)


# ---------------------------------------------------------------- symbolic links


def test_prepare_writes_through_a_symbolic_link(dataset, tmp_path, capsys):
    """A link to an empty folder, or to a dataset (on another disk, say), gets the dataset: the work
    lies beside the link's target, and each rerun reuses or replaces it."""
    texts, data = dataset
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    shutil.copytree(data, tmp_path / "disk" / "data")
    (tmp_path / "to_data").symlink_to(tmp_path / "disk" / "data")
    for link, args in ((tmp_path / "link", []), (tmp_path / "to_data", ["--force"])):
        assert prepare_cli(texts, link, *args) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.startswith(f"wrote {link}: ")
        assert prepare_cli(texts, link) == 0, capsys.readouterr().err
        assert "already prepared" in capsys.readouterr().out
        assert link.is_symlink() and load_meta(link.resolve())["vocab_size"] == 300
    assert not [p for p in tmp_path.rglob(".*")]  # no work or lock left, beside link or target


def test_atomic_output_writes_through_a_symbolic_link(tmp_path):
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "notes.txt").write_text("old")
    (tmp_path / "disk" / "folder").mkdir()
    (tmp_path / "file_link").symlink_to(tmp_path / "disk" / "notes.txt")
    (tmp_path / "folder_link").symlink_to(tmp_path / "disk" / "folder")
    with outputs.atomic_output(tmp_path / "file_link") as tmp:
        tmp.write_text("new")
    with outputs.atomic_output(tmp_path / "folder_link") as tmp:
        tmp.mkdir()
        (tmp / "inside.txt").write_text("inside")
    assert (tmp_path / "file_link").is_symlink() and (tmp_path / "folder_link").is_symlink()
    assert (tmp_path / "disk" / "notes.txt").read_text() == "new"
    assert (tmp_path / "disk" / "folder" / "inside.txt").read_text() == "inside"
    assert sorted(os.listdir(tmp_path / "disk")) == ["folder", "notes.txt"]
    # a file never replaces a folder (its files), nor a folder a file, through a link or not
    with pytest.raises(UserError, match=f"cannot write {tmp_path / 'folder_link'}: it is a direc"):
        with outputs.atomic_output(tmp_path / "folder_link") as tmp:
            tmp.write_text("a file")
    with pytest.raises(UserError, match=f"cannot write {tmp_path / 'file_link'}: it is a file"):
        with outputs.atomic_output(tmp_path / "file_link") as tmp:
            tmp.mkdir()
    assert (tmp_path / "disk" / "notes.txt").read_text() == "new"
    assert (tmp_path / "disk" / "folder" / "inside.txt").read_text() == "inside"
    assert sorted(os.listdir(tmp_path)) == ["disk", "file_link", "folder_link"]


# ---------------------------------------------------------------- an empty --out, a huge --seed


@pytest.mark.parametrize(
    "main, argv",
    [
        (prepare_module.main, ["--source", "../texts"]),
        (train.main, []),
        (convert.main, ["to-hf", "--run", "../run"]),
    ],
    ids=["prepare", "train", "convert"],
)
def test_an_empty_out_is_refused(main, argv, tmp_path, monkeypatch, capsys):
    """Path("") is the current directory: an empty --out never writes there."""
    write_corpus(tmp_path / "texts", docs=3)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert run_command(main, [*argv, "--out", ""]) == 2
    assert "argument --out: an empty path" in one_error(capsys)
    assert not list((tmp_path / "cwd").iterdir())


def test_seeds_torch_cannot_tell_apart_are_refused_by_every_command(capsys):
    parser = cli.ArgumentParser()
    cli.add_seed(parser, "a seed")
    assert parser.parse_args(["--seed", str(2**32 - 1)]).seed == 2**32 - 1
    assert parser.parse_args([]).seed == 0
    for seed in (2**32, 2**63 + 1):
        with pytest.raises(UserError, match=rf"^--seed must be in 0\.\.4294967295 .*, not {seed}$"):
            parser.parse_args(["--seed", str(seed)])
    with pytest.raises(UserError, match="invalid non-negative int value: '-1'"):
        parser.parse_args(["--seed", "-1"])
    assert run_command(train.main, ["--seed", str(2**32)]) == 2  # before any work
    assert "--seed must be in 0..4294967295" in one_error(capsys)
