"""Paths that a file names (a dataset's shards, an HF index's weights), kept inside its folder."""

from pathlib import Path

from picollama.cli import UserError
from picollama.cli.outputs import resolved


def inside(name, source: Path, key: str) -> Path:
    """The file `name` that the file `source` names at `key`, as a path in `source`'s folder;
    UserError naming the file, the key and the path where it is no relative path there: empty,
    absolute, climbing out (..), or a symbolic link (it or a folder on the way) leading out."""
    source = Path(source)
    if not isinstance(name, str) or not name.strip():
        raise UserError(f"{source}: {key} must name a file in {source.parent}, not {name!r}")
    path = Path(name)
    problem = None
    if path.is_absolute():
        problem = "is absolute"
    elif ".." in path.parts:
        problem = "climbs out of it (..)"
    elif not resolved(source.parent / path).is_relative_to(resolved(source.parent)):
        problem = "is a symbolic link that leads out of it"
    if problem is not None:
        raise UserError(
            f"{source}: {key} names {name!r}, which {problem}: a file it names must lie in "
            f"{source.parent}"
        )
    return source.parent / path
