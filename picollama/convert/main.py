"""Export and import runs as Hugging Face Llama or llama.cpp GGUF. The cache lists imports."""

import argparse
import sys
from pathlib import Path

from picollama.cli import UserError
from picollama.cli.flags import ArgumentParser, add_out, add_run, check_once
from picollama.cli.output_place import check_output_place
from picollama.cli.outputs import check_writable
from picollama.convert.cache import cache_command, imported_run  # noqa: F401 (for --run)
from picollama.convert.from_gguf import import_gguf
from picollama.convert.hf import export_hf, import_hf
from picollama.convert.outputs import check_replaceable
from picollama.convert.to_gguf import GGUF_TYPES, export_gguf


class OldPaths(argparse.Action):
    """The old positional spelling `COMMAND IN OUT`, kept for one more release.

    IN and OUT fill the flags, and a note names the new spelling."""

    def __init__(self, *args, source: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.source = source

    def __call__(self, parser, namespace, values, option_string=None):
        if not values:
            return
        flag = "--" + self.source.replace("_", "-")
        if len(values) != 2:
            parser.error(f"give {flag} and --out")
        for dest, value in ((self.source, values[0]), ("out", values[1])):
            check_once(parser.given, dest, value, "the positional IN OUT")
        print(
            f"note: the positional IN OUT is now {flag} IN --out OUT ({parser.prog} {flag} IN "
            "--out OUT); the old spelling goes in the next release",
            file=sys.stderr,
        )
        setattr(namespace, self.source, values[0])
        namespace.out = values[1]


def parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m picollama.convert", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    to_hf = commands.add_parser(
        "to-hf", help="export a run directory for transformers.AutoModelForCausalLM"
    )
    add_run(to_hf)
    add_out(to_hf, "the Hugging Face directory written")
    from_hf = commands.add_parser(
        "from-hf", help="import a Hugging Face Llama directory as a run directory"
    )
    from_hf.add_argument(
        "--hf-dir", type=Path, metavar="DIR", help="the Hugging Face Llama directory read"
    )
    from_hf.needed = [("hf_dir", "--hf-dir")]
    add_out(from_hf, "the run directory written")
    from_gguf = commands.add_parser(
        "from-gguf", help="import a llama.cpp GGUF file (llama architecture) as a run directory"
    )
    from_gguf.add_argument("--gguf", type=Path, metavar="FILE", help="the .gguf file read")
    from_gguf.needed = [("gguf", "--gguf")]
    add_out(from_gguf, "the run directory written")
    to_gguf = commands.add_parser(
        "to-gguf", help="export a run directory as one GGUF file for llama.cpp"
    )
    add_run(to_gguf)
    add_out(to_gguf, "the .gguf file written")
    to_gguf.add_argument(
        "--type", choices=GGUF_TYPES, default="f32", help="weight type (default f32)"
    )
    cache = commands.add_parser(
        "cache", help="list the imports --run made of .gguf files and Hugging Face folders"
    )
    cache.add_argument("--clear", action="store_true", help="remove every cached import")
    for sub, source in ((to_hf, "run"), (from_hf, "hf_dir"), (from_gguf, "gguf"), (to_gguf, "run")):
        sub.needed.append(("out", "--out"))
        sub.add_argument(
            "--force", action="store_true", help="replace an existing (non-empty) output"
        )
        sub.add_argument(
            "paths", nargs="*", type=Path, action=OldPaths, source=source, help=argparse.SUPPRESS
        )
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.command == "cache":
        return cache_command(args.clear)
    source = getattr(args, {"from-hf": "hf_dir", "from-gguf": "gguf"}.get(args.command, "run"))
    out = args.out
    flag = {"from-hf": "--hf-dir", "from-gguf": "--gguf"}.get(args.command, "--run")
    check_output_place(out, {flag: source}, args.command)
    directory = args.command != "to-gguf"
    check_writable(out, inputs=[source], directory=directory)
    if out.exists() and (not directory or any(out.iterdir())) and not args.force:
        raise UserError(
            f"{out} exists{' and is not empty' if directory else ''}; pass --force to replace it"
        )
    if args.command == "to-gguf":
        export_gguf(source, out, args.type)
    elif args.command == "from-gguf":
        check_replaceable(out)
        import_gguf(source, out)
    else:
        (export_hf if args.command == "to-hf" else import_hf)(source, out)
    print(f"wrote {out}")
    return 0
