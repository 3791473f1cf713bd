"""How convert's commands write their outputs.

Writes are atomic and make missing folders. They replace only what picollama wrote."""

from contextlib import contextmanager
from pathlib import Path

from picollama.cli import UserError, outputs
from picollama.cli.output_place import OWN_FILES, OWN_FOLDERS
from picollama.cli.outputs import atomic_output, resolved


@contextmanager
def output(path: Path, needed: int | None = None):
    """atomic_output at the path `path` resolves to.

    A symbolic link's target is replaced, with the temporary beside it on the same disk. Missing
    folders are made first and removed again if the write fails."""
    path = resolved(path)
    made = [folder for folder in path.parents if not folder.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_output(path, needed) as tmp:
            yield tmp
    except BaseException:
        for folder in made:  # The deepest first.
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def check_replaceable(out: Path):
    """UserError unless `out` is absent, empty or written by picollama.

    OWN_FILES and OWN_FOLDERS say what picollama writes. So --force never deletes a user's file."""
    if out.is_file():
        with open(out, "rb") as file:
            magic = file.read(4)
        if magic not in (b"", b"GGUF"):
            raise UserError(
                f"not replacing {out}: it is not a GGUF file, so picollama did not write it "
                "(--force replaces only a GGUF file); choose another output"
            )
        return
    what = (
        "--force replaces only a run or export directory: model.safetensors, config.json and only "
        "files picollama writes"
    )
    marks = ["model.safetensors", "config.json"]
    outputs.check_replaceable(out, OWN_FILES, OWN_FOLDERS, marks=marks, what=what)
