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


def line_count(path: str) -> int:
    return len((REPO / path).read_text().splitlines())


def test_model_py_and_every_other_source_file_stay_small():
    # growth makes rooms: a new capability gets a module of its own, never a longer file
    assert line_count("model.py") <= 420
    long = [
        f"{path} ({line_count(path)} lines)"
        for path in tracked("*.py")
        if not path.startswith("tests/") and line_count(path) > 450
    ]
    assert not long, long


def imports(path: str) -> list[tuple[str, ast.AST]]:
    """(module, node) of every import in a file, however deep (lazy ones too)."""
    found = []
    for node in ast.walk(ast.parse((REPO / path).read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(f"{node.module}.{alias.name}", node) for alias in node.names]
    return found


def test_the_core_never_imports_the_lab():
    # generate.py's `extrapolate` / `study` door opens it with importlib, by name
    core = [p for p in tracked("*.py") if not p.startswith(("tests/", "picollama/lab/"))]
    reaching = [
        f"{path}:{node.lineno}"
        for path in core
        for name, node in imports(path)
        if name.startswith("picollama.lab") or name == "picollama.lab"
    ]
    assert not reaching, reaching
    assert "picollama.lab." in (REPO / "generate.py").read_text()


def model_definitions() -> dict[str, list[tuple[str | None, ast.FunctionDef]]]:
    """model.py's functions and methods by name: [(class or None, node)]."""
    tree = ast.parse((REPO / "model.py").read_text())
    found = {}
    for node in tree.body:
        members = node.body if isinstance(node, ast.ClassDef) else [node]
        owner = node.name if isinstance(node, ast.ClassDef) else None
        for f in members:
            if isinstance(f, ast.FunctionDef):
                found.setdefault(f.name, []).append((owner, f))
    return found


def test_the_forward_pass_reads_in_one_file_in_150_lines():
    # every definition of model.py that a forward reaches by name, from the model's and each
    # LLaMA module's forward: what a newcomer reads to follow Transformer.forward
    defined = model_definitions()
    todo = [(owner, "forward") for owner, _ in defined["forward"]] + [(None, "sdpa_attention")]
    seen, lines = set(), 0
    while todo:
        owner, name = todo.pop()
        for where, f in defined.get(name, []):
            if (owner is not None and where != owner) or (where, name) in seen:
                continue
            seen.add((where, name))
            lines += f.end_lineno - f.lineno + 1
            used = {n.id for n in ast.walk(f) if isinstance(n, ast.Name)}
            used |= {n.attr for n in ast.walk(f) if isinstance(n, ast.Attribute)}
            todo += [(None, n) for n in used if n in defined]
    assert ("Transformer", "forward") in seen and ("Attention", "forward") in seen
    assert lines <= 150, (lines, sorted(seen, key=str))


def test_no_import_cycle_among_the_projects_modules():
    modules = {
        p[:-3].replace("/", ".").removesuffix(".__init__"): p
        for p in tracked("*.py")
        if not p.startswith("tests/")
    }
    graph = {
        name: {
            target
            for imported, node in imports(path)
            if node.col_offset == 0  # top-level imports: what runs when the module loads
            for target in (imported, imported.rpartition(".")[0])
            if target in modules and target != name
        }
        for name, path in modules.items()
    }
    state = {}

    def visit(name, trail):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", " -> ".join(trail + [name])
        state[name] = "open"
        for target in graph[name]:
            visit(target, trail + [name])
        state[name] = "done"

    for name in graph:
        visit(name, [])
