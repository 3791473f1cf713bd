"""Data mistakes get one true `error:` line naming the key, file and row (issue 47's recheck)."""

import importlib
from pathlib import Path

import pytest

import train
from data import prepare
from picollama.cli.command import run_command

TRAIN = [
    "--model.dim=32",
    "--model.n_layers=1",
    "--model.n_heads=2",
    "--model.vocab_size=320",
    "--model.max_seq_len=32",
    "--train.seq_len=32",
    "--train.max_steps=1",
    "--train.sample_tokens=0",
    "--eval.interval=0",
]
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(40))
RECORDS = "".join(f'{{"text": "record {i} of some text"}}\n' for i in range(5))


def write(path: Path, content: str | bytes) -> Path:
    """path with `content` (its folders made); the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def run_folder_holding_a_config(tmp: Path, request) -> list[str]:
    """t24b: train.out_dir is the user's folder holding only a config.json."""
    write(tmp / "corpus" / "a.txt", TEXT)
    write(tmp / "proj" / "config.json", "{}")
    data = [f"--data.dir={tmp}/data", f"--data.source={tmp}/corpus"]
    return [*TRAIN, *data, f"--train.out_dir={tmp}/proj"]


def missing_data_source(tmp: Path, request) -> list[str]:
    """t27: data.source names nothing."""
    data = [f"--data.dir={tmp}/data", f"--data.source={tmp}/nonexistent"]
    return [*TRAIN, *data, f"--train.out_dir={tmp}/out"]


def whitespace_corpus(tmp: Path, request) -> list[str]:
    """p04: a corpus of whitespace alone."""
    write(tmp / "ws" / "ws.txt", "   \n\n\t\n")
    return ["--source", f"{tmp}/ws", "--out", f"{tmp}/out"]


def two_letter_corpus(tmp: Path, request) -> list[str]:
    """p04's kin: a corpus of almost no text (its "a" trains the tokenizer, " b" is val)."""
    write(tmp / "few" / "few.txt", " a \n\n b \n")
    return ["--source", f"{tmp}/few", "--out", f"{tmp}/out"]


def unterminated_row(tmp: Path, request) -> list[str]:
    """p31: a JSON Lines file whose 6th row breaks off."""
    write(tmp / "tj" / "t.jsonl", RECORDS + '{"text": "unterminated\n')
    return ["--source", f"{tmp}/tj", "--vocab-size", "300", "--out", f"{tmp}/out"]


def broken_json_document(tmp: Path, request) -> list[str]:
    """A .json file that is one JSON document, broken on its 3rd line."""
    write(tmp / "doc" / "d.json", '[\n  {"text": "one"},\n  {"text": "two",,}\n]\n')
    return ["--source", f"{tmp}/doc", "--vocab-size", "300", "--out", f"{tmp}/out"]


def junk_parquet(tmp: Path, request) -> list[str]:
    """p33: a .parquet file that only starts like one."""
    write(tmp / "junk.parquet", b"PAR1garbagegarbage")
    return ["--source", f"{tmp}/junk.parquet", "--vocab-size", "300", "--out", f"{tmp}/out"]


def empty_source(tmp: Path, request) -> list[str]:
    """p41: --source '' (Path('') is the current folder)."""
    return ["--source", "", "--out", f"{tmp}/out"]


def text_dataset_for_sft(tmp: Path, request) -> list[str]:
    """b32: bench.sft given a text dataset, which has no loss mask."""
    run_dir, data_dir = request.getfixturevalue("make_tiny_run")(steps=0)
    return ["--run", str(run_dir), "--data", str(data_dir), "--out", f"{tmp}/b.json"]


def sft_main(argv):
    """picollama.lab.bench.sft's main, imported when needed (it imports transformers)."""
    return importlib.import_module("picollama.lab.bench.sft").main(argv)


# (case, main, inputs -> argv, a piece of the error line, pieces it must not hold)
CASES = [
    ("t24b", train.main, run_folder_holding_a_config, "choose another train.out_dir", ["delete"]),
    (
        "t27",
        train.main,
        missing_data_source,
        "data.source {tmp}/nonexistent: no such file or directory",
        [],
    ),
    ("p04", prepare.main, whitespace_corpus, "the corpus holds no text", ["--vocab-size"]),
    (
        "p04-few",
        prepare.main,
        two_letter_corpus,
        "holds 1 non-whitespace character, from which",
        [],
    ),
    (
        "p31",
        prepare.main,
        unterminated_row,
        "{tmp}/tj/t.jsonl: not valid JSON Lines (row 6)",
        ["JSON parse error", "row 5"],
    ),
    (
        "json-document",
        prepare.main,
        broken_json_document,
        "{tmp}/doc/d.json: not valid JSON (line 3, column 18)",
        [],
    ),
    (
        "p33",
        prepare.main,
        junk_parquet,
        "{tmp}/junk.parquet: not a Parquet file",
        ["magic bytes", "Either"],
    ),
    ("p41", prepare.main, empty_source, "--source is empty", []),
    (
        "b32",
        sft_main,
        text_dataset_for_sft,
        "is a text dataset, not a chat (conversations) dataset",
        ["mask.bin", "--force"],
    ),
]


def listing(root: Path) -> list[str]:
    """Every path under root, relative, sorted."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("case, main, inputs, said, unsaid", CASES, ids=[c[0] for c in CASES])
def test_a_data_mistake_is_one_true_line_and_writes_nothing(
    tmp_path, capsys, request, one_thread, case, main, inputs, said, unsaid
):
    argv = inputs(tmp_path, request)
    before = listing(tmp_path)
    status = run_command(main, argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert said.replace("{tmp}", str(tmp_path)) in err, err
    assert not [piece for piece in unsaid if piece in err], err
    assert listing(tmp_path) == before
