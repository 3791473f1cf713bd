"""The layout the card and the "core and lab" issue fix: a small top level, model.py a leaf that
reads top to bottom, short functions."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CARD = {"pyproject.toml", "model.py", "train.py", "generate.py", "data", "configs", "tests"}


def tracked(pattern: str = "*") -> list[str]:
    done = subprocess.run(["git", "ls-files", pattern], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def functions(path: str) -> list[ast.FunctionDef]:
    tree = ast.parse((REPO / path).read_text())
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    return [node for node in ast.walk(tree) if isinstance(node, kinds)]


def test_the_top_level_is_the_cards_entries_and_two_more():
    top = {path.split("/")[0] for path in tracked() if not path.startswith(".")}
    assert CARD <= top, CARD - top
    assert top - CARD - {"README.md"} <= {"picollama", "docs"}, top


def test_model_py_imports_only_torch_and_the_standard_library():
    tree = ast.parse((REPO / "model.py").read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    roots = {name.split(".")[0] for name in imported}
    assert roots - {"torch"} <= sys.stdlib_module_names, roots


def test_the_forward_pass_is_short_and_has_no_position_branches():
    (forward,) = [
        f
        for node in ast.parse((REPO / "model.py").read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "Transformer"
        for f in node.body
        if isinstance(f, ast.FunctionDef) and f.name == "forward"
    ]
    assert forward.end_lineno - forward.lineno + 1 <= 30
    assert "position ==" not in ast.unparse(forward)


def test_no_function_outside_the_tests_is_over_60_lines():
    long = [
        f"{path}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
        for path in tracked("*.py")
        if not path.startswith("tests/")
        for f in functions(path)
        if f.end_lineno - f.lineno + 1 > 60
    ]
    assert not long, long
