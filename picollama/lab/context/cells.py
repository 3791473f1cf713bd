"""The study's cells on disk: one JSON file a cell, written whole as the cell finishes.

A cell is one unit of work whose result stands alone (one window at one length under one method,
one haystack's questions). Its key names it. A rerun skips every cell whose file is there, so a
study of many hours spans sessions and an interrupted cell costs only itself. This module knows
nothing of models or text."""

import json
import re
from pathlib import Path

from picollama.cli.outputs import atomic_output

KEY = re.compile(r"[a-z0-9_.=-]+")  # a key is a file name: lower case, no slashes


class Cells:
    """The folder of a study's cells: `done(key)` is a saved cell's result or None, `save(key,
    result)` writes one atomically, `results(prefix)` reads back every saved cell of a kind."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def path(self, key: str) -> Path:
        if not KEY.fullmatch(key):
            raise ValueError(f"a cell key is lower case letters, digits and _.=- only: {key!r}")
        return self.folder / f"{key}.json"

    def done(self, key: str) -> dict | None:
        path = self.path(key)
        return json.loads(path.read_text()) if path.is_file() else None

    def save(self, key: str, result: dict):
        self.folder.mkdir(parents=True, exist_ok=True)
        with atomic_output(self.path(key)) as tmp:
            tmp.write_text(json.dumps(result, indent=1) + "\n")

    def results(self, prefix: str = "") -> dict[str, dict]:
        """Every saved cell whose key starts with `prefix`, by key, in key order."""
        paths = sorted(self.folder.glob(f"{prefix}*.json"))
        return {path.stem: json.loads(path.read_text()) for path in paths}
