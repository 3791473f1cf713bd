"""Where convert's commands write: atomically, folders made, over only what picollama wrote."""

from contextlib import contextmanager
from pathlib import Path

from picollama.cli import UserError, outputs
from picollama.cli.output_place import OWN_FILES, OWN_FOLDERS
from picollama.cli.outputs import atomic_output, resolved


@contextmanager
def output(path: Path, needed: int | None = None):
    """atomic_output at the path `path` resolves to, so that a symbolic link's target is replaced
    (the temporary beside it, on its disk), its missing folders made first and removed again if
    the write fails."""
    path = resolved(path)
    made = [folder for folder in path.parents if not folder.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_output(path, needed) as tmp:
            yield tmp
    except BaseException:
        for folder in made:  # the deepest first
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def check_replaceable(out: Path):
    """UserError unless `out` is absent, empty or something picollama wrote (OWN_FILES and
    OWN_FOLDERS), so that --force never deletes what picollama did not write."""
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
