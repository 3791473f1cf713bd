"""The docs: a README a newcomer finishes; every relative link in README.md and docs/ resolves, and
every path, module, name and `python -m` command of picollama they give exists."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_BYTES = 15_000
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def prose(page: Path) -> str:
    """A Markdown page without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def relative_links(page: Path) -> list[str]:
    """The page's link targets that are paths or anchors, not URLs."""
    targets = [match[1] for match in LINK.finditer(prose(page))]
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercase, no punctuation, hyphens for spaces."""
    headings = re.findall(r"^#+ (.+)$", prose(page), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_short():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_BYTES, f"README.md is {size} bytes: move detail into docs/"


def test_there_are_links_to_check():
    assert len(PAGES) > 1 and relative_links(REPO / "README.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_resolves(page):
    where = page.relative_to(REPO)
    for target in relative_links(page):
        name, _, anchor = target.partition("#")
        path = (page.parent / name).resolve() if name else page
        assert path.exists(), f"{where} links to {target}, which does not exist"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{where} links to {target}: no such heading"


# picollama's code as the docs name it: a path (picollama/serve/app.py), a module or a name in one
# (picollama.convert.hf.to_hf_state_dict, or from a sub-package: cli.outputs.check_writable)
PACKAGE = REPO / "picollama"
SUB_PACKAGES = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
ROOT_MODULES = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
PATH = re.compile(r"(?<![\w./-])picollama/[\w./-]*[\w/]")
DOTTED = re.compile(r"(?<![\w./-])picollama(?:\.\w+)+")
RELATIVE = re.compile(r"`((?:\w+\.)+\w+)")  # a backticked dotted name, first part a sub-package
FILE_NAME = re.compile(r"`((?:[\w.-]+/)*\w+\.py)`(?:'s `(\w+)`)?")  # `x.py`, `x.py`'s `name`
RUN = re.compile(r"python -m (picollama[\w.]*[\w*…])")
IMPORT = re.compile(r"^from (picollama[\w.]*) import (.+)$", flags=re.M)
PLACEHOLDER = re.compile(r"\b[A-Z]{2,}\b|[*…]")  # picollama.lab.bench.NAME, .*: a name to fill in
NOT_MODULES = {"json", "jsonl", "md", "toml", "py", "png", "cpp", "html", "gguf", "safetensors"}


def module_file(dotted: str) -> Path | None:
    """The file of a module or package named by dots from the repository (picollama.cli.flags)."""
    path = REPO.joinpath(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def top_level_names(path: Path) -> set[str]:
    """What a module defines, assigns or imports at its top level (under an if, try or with too),
    with a package's sub-modules."""
    names = {p.stem for p in path.parent.glob("*.py")} if path.name == "__init__.py" else set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            todo += [line for handler in getattr(node, "handlers", []) for line in handler.body]
    return names


def unresolved(dotted: str) -> str | None:
    """Why a dotted name is not picollama's: its longest module prefix lacks the next name."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path:
            rest = parts[cut:]
            if rest and rest[0] not in top_level_names(path):
                return f"{path.relative_to(REPO)} has no {rest[0]}"
            return None
    return "no such module"


def repository_files() -> list[Path]:
    """The files a commit of the tree would hold (tracked or new, not ignored)."""
    done = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return [REPO / name for name in done.stdout.split() if (REPO / name).is_file()]


def named_modules(page: Path) -> list[str]:
    """Every dotted name of picollama a page gives: picollama.x.y anywhere, a sub-package's
    cli.outputs.check_writable in backticks, and what a `from picollama... import` line imports."""
    text = page.read_text()
    names = DOTTED.findall(text)
    names += [
        f"picollama.{name}"
        for name in RELATIVE.findall(prose(page))
        if name.split(".")[0] in SUB_PACKAGES | ROOT_MODULES
        and name.split(".")[1] not in NOT_MODULES
    ]
    for module, imported in IMPORT.findall(text):
        names += [f"{module}.{name.strip()}" for name in imported.split(",")]
    return names


def runnable(module: str) -> bool:
    """Whether `python -m module` runs a file of picollama's."""
    path = module_file(module)
    return bool(path) and (path.name != "__init__.py" or (path.parent / "__main__.py").is_file())


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_picollama_path_a_page_names_exists(page):
    text = page.read_text()
    missing = [
        path
        for path in PATH.findall(text)
        if not PLACEHOLDER.search(path) and not (REPO / path.rstrip("/")).exists()
    ]
    assert not missing, f"{page.relative_to(REPO)} names {missing}, which do not exist"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_picollama_module_and_name_a_page_gives_exists(page):
    wrong = [
        f"{name}: {why}"
        for name in named_modules(page)
        if not PLACEHOLDER.search(name) and (why := unresolved(name))
    ]
    assert not wrong, f"{page.relative_to(REPO)}: {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_python_dash_m_command_a_page_gives_runs_a_module(page):
    commands = [
        module for module in RUN.findall(page.read_text()) if not PLACEHOLDER.search(module)
    ]
    wrong = [module for module in commands if not runnable(module)]
    assert not wrong, f"{page.relative_to(REPO)}: python -m {wrong} runs nothing"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_python_file_a_page_names_exists_with_the_name_it_gives(page):
    files = repository_files()
    wrong = []
    for name, defined in FILE_NAME.findall(prose(page)):
        if PLACEHOLDER.search(name):
            continue
        if "/" in name:
            places = [p for p in (REPO / name, PACKAGE / name) if p.is_file()]
        else:
            places = [p for p in files if p.name == name]
        if not places:
            wrong.append(f"{name}: no such file")
        elif defined and not any(defined in top_level_names(p) for p in places):
            wrong.append(f"{name} has no {defined}")
    assert not wrong, f"{page.relative_to(REPO)}: {wrong}"
