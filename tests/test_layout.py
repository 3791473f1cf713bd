"""The layout the card and the "core and lab" and "wings" issues fix: a small top level, model.py a
leaf that reads top to bottom, short functions, and picollama/ in layered sub-packages."""

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CARD = {"pyproject.toml", "model.py", "train.py", "generate.py", "data", "configs", "tests"}
PACKAGE = REPO / "picollama"
# the modules at the package's root, shared by every layer above config. __init__ is the
# package's face (REPO_ROOT): it imports nothing of picollama, and every layer may read it.
ROOT_LEAVES = {"__init__", "device", "run_files", "chat_template", "chat_content"}
# picollama's layers, lowest first ("root": ROOT_LEAVES); a module imports only from its own layer
# and those below it
LAYERS = [
    "face",
    "cli",
    "components",
    "config",
    "root",
    "convert",
    "kernels",
    "sampling",
    "training",
    "serve",
    "lab",
]
ENTRY_SCRIPTS = {"train", "generate"}
MAX_MODULES = 15  # a sub-package's modules, __init__ and __main__ not counted
# a module's name does not repeat its folder's: serve/app.py, not serve/serve_app.py
FOLDER_WORDS = {
    "components": {"component", "components"},
    "config": {"config", "configs"},
    "convert": {"convert", "converted", "conversion"},
    "kernels": {"kernel", "kernels"},
    "sampling": {"sample", "sampled", "sampler", "sampling"},
    "training": {"train", "trained", "trainer", "training"},
    "serve": {"serve", "served", "server", "serving"},
    "bench": {"bench", "benchmark"},
    "measure": {"measure", "measured", "measurement"},
}
README_TREE_LINES = 60


def tracked(pattern: str = "*") -> list[str]:
    """The files a commit of the tree would hold: tracked or new (not ignored), and present."""
    done = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", pattern],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return [path for path in dict.fromkeys(done.stdout.split()) if (REPO / path).is_file()]


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
    """(module, node) of every import in a file, however deep (lazy ones too); a relative import
    spelled out from the file's package."""
    package = path[:-3].replace("/", ".").rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse((REPO / path).read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]
                base = f"{anchor}.{base}".rstrip(".")
            found += [(f"{base}.{alias.name}", node) for alias in node.names]
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


def source_modules() -> dict[str, str]:
    """Every module outside the tests, dotted (a package by its own name): its path."""
    return {
        p[:-3].replace("/", ".").removesuffix(".__init__"): p
        for p in tracked("*.py")
        if not p.startswith("tests/")
    }


def imported_modules(path: str, modules: dict[str, str]) -> list[tuple[str, ast.AST]]:
    """(module, node) of each of the project's modules a file imports, at any depth: `from a
    import b` counts a.b where b is a module, else a."""
    found = []
    for name, node in imports(path):
        target = name if name in modules else name.rpartition(".")[0]
        if target in modules:
            found.append((target, node))
    return found


def layer(module: str) -> str | None:
    """The layer of one of picollama's modules, by its sub-package; None outside picollama."""
    parts = module.split(".")
    if parts[0] != "picollama":
        return None
    if len(parts) == 1:  # the package's face (REPO_ROOT): Python runs it before any module
        return "face"
    return "root" if parts[1] in ROOT_LEAVES else parts[1]


def sub_packages() -> list[Path]:
    """picollama's sub-packages, at any depth (lab/bench too): the folders holding modules."""
    folders = {(REPO / p).parent for p in tracked("picollama/*.py")}
    return sorted(folder for folder in folders if folder != PACKAGE)


def test_the_package_root_holds_only_the_shared_leaves():
    leaves = {Path(p).stem for p in tracked("picollama/*.py") if p.count("/") == 1}
    assert leaves == ROOT_LEAVES, leaves ^ ROOT_LEAVES


def test_every_sub_package_has_a_layer_and_is_installed():
    top = {folder.relative_to(PACKAGE).parts[0] for folder in sub_packages()}
    expected = set(LAYERS) - {"face", "root"}
    assert top == expected, top ^ expected
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dotted = {".".join(folder.relative_to(REPO).parts) for folder in sub_packages()}
    assert dotted | {"picollama"} <= set(packages["packages"]), dotted - set(packages["packages"])


def test_each_module_imports_only_its_own_layer_and_those_below():
    modules = source_modules()
    upward = [
        f"{path}:{node.lineno} ({layer(name)}) imports {target} ({layer(target)})"
        for name, path in modules.items()
        if layer(name)
        for target, node in imported_modules(path, modules)
        if layer(target) and LAYERS.index(layer(target)) > LAYERS.index(layer(name))
    ]
    assert not upward, upward


def test_no_import_cycle_among_the_sub_packages():
    # a graph over picollama's folders (its root, cli, ..., lab, lab.bench), every import counted
    modules = source_modules()
    folder = {name: path.rpartition("/")[0].replace("/", ".") for name, path in modules.items()}
    folder["picollama"] = "picollama.__init__"  # the face: it imports nothing of picollama
    graph = {}
    for name, path in modules.items():
        if not layer(name):
            continue
        edges = graph.setdefault(folder[name], {})
        for target, node in imported_modules(path, modules):
            if layer(target) and folder[target] != folder[name]:
                edges.setdefault(folder[target], f"{path}:{node.lineno}")
    state = {}

    def visit(package, trail):
        if state.get(package) == "done":
            return
        assert state.get(package) != "open", " -> ".join(trail + [package])
        state[package] = "open"
        for target, where in graph.get(package, {}).items():
            visit(target, trail + [f"{package} ({where})"])
        state[package] = "done"

    for package in graph:
        visit(package, [])


def test_nothing_imports_an_entry_script():
    # train.py and generate.py are doors in, never a library: what they share lives in picollama
    # (training/step.py, kernels/load.py); the lab is entered by generate.py, never the reverse
    reaching = []
    for path in tracked("*.py"):
        if path.startswith("tests/"):
            continue
        tree = ast.parse((REPO / path).read_text())
        names = [(name, node) for name, node in imports(path)]
        names += [
            (node.args[0].value, node)
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ]
        reaching += [
            f"{path}:{node.lineno} {name}"
            for name, node in names
            if name.split(".")[0] in ENTRY_SCRIPTS
        ]
    assert not reaching, reaching


def test_each_sub_package_holds_at_most_15_modules():
    counts = {
        str(folder.relative_to(REPO)): sum(
            path.stem not in {"__init__", "__main__"} for path in folder.glob("*.py")
        )
        for folder in sub_packages()
    }
    crowded = {folder: count for folder, count in counts.items() if count > MAX_MODULES}
    assert not crowded, crowded


def test_each_sub_package_says_what_it_owns_in_its_init_docstring():
    silent = [
        str(folder.relative_to(REPO))
        for folder in sub_packages()
        if not (folder / "__init__.py").is_file()
        or not (ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or "").strip()
    ]
    assert not silent, silent


def test_no_module_name_repeats_its_folders():
    # serve/serve_app.py and serve/serve.py repeat it; sampling/sampler.py names a thing
    repeating = [
        str(path.relative_to(REPO))
        for folder in sub_packages()
        for path in folder.glob("*.py")
        if path.stem == folder.name
        or (
            "_" in path.stem.strip("_")
            and path.stem.split("_")[0] in FOLDER_WORDS.get(folder.name, {folder.name})
        )
    ]
    assert not repeating, repeating


def readme_tree() -> list[str]:
    """The lines of README.md's file tree: the first fenced block after the Files (or Layout)
    heading that starts at "."."""
    text = (REPO / "README.md").read_text()
    heading = re.search(r"^#+ (Files|Layout)\b.*$", text, flags=re.M)
    assert heading, "README.md has no Files or Layout heading"
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text[heading.end() :], flags=re.S | re.M)
    trees = [block.splitlines() for block in blocks if block.startswith(".\n")]
    assert trees, "README.md's Files section has no tree starting at ."
    return trees[0]


def test_the_readme_tree_is_at_most_60_lines_and_names_each_folder_and_leaf():
    tree = readme_tree()
    assert len(tree) <= README_TREE_LINES, f"README.md's tree is {len(tree)} lines"
    text = "\n".join(tree)
    folders = {folder.name for folder in sub_packages()}
    missing = [f"{name}/" for name in sorted(folders) if f" {name}/" not in text]
    missing += [f"{leaf}.py" for leaf in sorted(ROOT_LEAVES - {"__init__"}) if leaf not in text]
    assert not missing, f"README.md's tree does not name {missing}"


def test_the_readme_tree_names_every_module_of_each_folder():
    # a line a folder, then its files: a new module is a new name on its folder's lines
    words = set(re.findall(r"\w+", "\n".join(readme_tree())))
    modules = [Path(p) for p in tracked("*.py") if p.startswith(("picollama/", "data/"))]
    missing = [str(m) for m in modules if m.stem not in words | {"__init__", "__main__"}]
    assert not missing, f"README.md's tree does not name {missing}"
