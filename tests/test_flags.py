"""The shared-flags table (docs/usage.md) is what each command's --help says; old spellings work."""

import contextlib
import io
import re
import tomllib
from pathlib import Path

import pytest

import generate
import train
from data import prepare
from picollama.cli.command import run_command
from picollama.config.training import DEFAULT_CONFIG
from picollama.convert import main as convert

REPO = Path(__file__).resolve().parent.parent
FLAG_TABLE = REPO / "docs" / "usage.md"  # the one set of flags table (the README points there)
BENCH = ("data", "decode", "heldout", "memory", "quantize", "switches", "train")


def help_text(main, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


def options(text: str) -> set[str]:
    """The flags an argparse --help lists under options (`--a, --b` and `--a VALUE` lines)."""
    listed = set()
    for line in text.split("options:", 1)[1].splitlines():
        match = re.match(r"\s{2}((?:-{1,2}[\w-]+(?: \S+)?(?:, )?)+)", line)
        if match:
            listed |= set(re.findall(r"(?<![\w-])--[\w-]+", match[1]))
    return listed


def command_helps(bench_main) -> dict[str, dict[str, set[str]]]:
    """Table column -> {part (subcommand or script) -> the flags its --help lists}."""
    return {
        "`train.py`": {"train": options(help_text(train.main, []))},
        "`generate.py`": {"sample": options(help_text(generate.main, []))},
        "`generate.py extrapolate`": {
            "extrapolate": options(help_text(generate.main, ["extrapolate"]))
        },
        "`generate.py study`": {"study": options(help_text(generate.main, ["study"]))},
        "`python -m picollama.convert`": {
            c: options(help_text(convert.main, [c])) for c in ("to-hf", "from-hf", "to-gguf")
        },
        "`data/prepare.py`": {"prepare": options(help_text(prepare.main, []))},
        "`python -m picollama.lab.bench.*`": {
            name: options(help_text(bench_main(name), [])) for name in BENCH
        },
    }


def flag_table() -> tuple[list[str], list[list[str]]]:
    """The header and rows of the first table after the "One set of flags" heading."""
    section = FLAG_TABLE.read_text().split("## One set of flags", 1)[1]
    table = section[section.index("\n| ") :].split("\n\n", 1)[0]
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")] for line in table.strip().splitlines()
    ]
    return rows[0], [row for row in rows[1:] if not row[0].startswith("---")]


def test_the_flag_table_is_each_commands_help(bench_main):
    header, rows = flag_table()
    helps = command_helps(bench_main)
    assert set(header[2:]) == set(helps)
    for row in rows:
        flags = re.findall(r"--[\w-]+", row[0])
        assert flags, row
        for column, cell in zip(header[2:], row[2:], strict=True):
            parts = helps[column]
            if cell.startswith("✓"):
                having = set(parts)
            elif cell == "—":
                having = set()
            else:
                having = {name.strip() for name in cell.split(",")}
                assert having <= set(parts), (column, cell)
            for part, listed in parts.items():
                for flag in flags:
                    assert (flag in listed) == (part in having), (
                        f"{flag} in {column} {part}: the table says {cell}"
                    )


def test_device_and_dtype_default_to_auto_everywhere():
    for argv in ([], ["extrapolate", "--run", "r"]):
        args = generate.parser().parse_args(argv)
        assert (args.device, args.dtype) == ("auto", "auto")
    from picollama.config.training import parse_cli

    cfg, _ = parse_cli([])
    assert (cfg.train.device, cfg.train.dtype) == ("auto", "auto")


def test_old_spellings_still_work_with_a_note(tmp_path, capsys):
    args = generate.parser().parse_args(["--checkpoint", "some/run"])
    assert args.run == Path("some/run") and "--checkpoint is now --run" in capsys.readouterr().err
    args = generate.parser().parse_args(["extrapolate", "--checkpoint", "a,b"])
    assert args.run == [Path("a"), Path("b")]
    assert (
        run_command(convert.main, ["to-hf", str(tmp_path / "missing"), str(tmp_path / "hf")]) == 2
    )
    err = capsys.readouterr().err
    assert "is now --run IN --out OUT" in err and "not a picollama run directory" in err


def test_train_shorthands_set_their_config_keys(tmp_path):
    from picollama.config.training import parse_cli

    cfg, _ = parse_cli(
        [
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--compile",
            "--seed",
            "7",
        ]
    )
    assert (cfg.train.out_dir, cfg.train.device, cfg.train.dtype) == (
        str(tmp_path),
        "cpu",
        "float32",
    )
    assert cfg.train.compile is True and cfg.train.seed == 7
    default, _ = parse_cli([])
    config = tomllib.loads(DEFAULT_CONFIG.read_text())["train"]
    # unset shorthands leave the config's values
    assert (default.train.seed, default.train.compile) == (1337, config["compile"])
