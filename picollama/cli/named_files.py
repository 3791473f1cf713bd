"""Paths one file names, such as a dataset's shards or an HF index's weights. They must stay
inside that file's folder."""

from pathlib import Path

from picollama.cli import UserError
from picollama.cli.outputs import resolved


def inside(name, source: Path, key: str) -> Path:
    """The file `name`, named by `source` at `key`, as a path in `source`'s folder.

    UserError names the file, key and path when it is not a relative path there. That is when it
    is empty, absolute or climbs out (..). So is a symbolic link that leads out, on any level."""
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
