"""The registry issue: picollama/components/registry.py is the one module that fills model.py's
tables, and every list of choices is derived from a table, never copied by hand."""

import ast
import subprocess
import sys
from pathlib import Path

import model
from model import (
    ACTIVATIONS,
    BLOCKS,
    NORMS,
    OUTPUT_GATES,
    POSITIONS,
    QUERY_SCALES,
    ROPE_ATTENTIONS,
    ROPE_INIT,
    ModelArgs,
)
from picollama.components.registry import PLACEMENTS, ROPE_SCALINGS, WINDOWED
from picollama.components.variants import switches
from picollama.config.model_args import model_choices

REPO = Path(__file__).resolve().parent.parent
TABLES = (
    "NORMS ACTIVATIONS BLOCKS POSITIONS ATTENTIONS QUERY_SCALES OUTPUT_GATES ROPE_INIT"
    " ROPE_ATTENTIONS ATTENTION_WRAPS INITS"
).split()
# What model.py puts in its own tables: LLaMA's parts, and nothing else.
LLAMA_ONLY = {
    "NORMS": ["rmsnorm"],
    "ACTIVATIONS": ["swiglu"],
    "BLOCKS": [("pre", False)],
    "POSITIONS": ["rope"],
    "ATTENTIONS": [],
    "QUERY_SCALES": [],
    "OUTPUT_GATES": [],
    "ROPE_INIT": ["none"],
    "ROPE_ATTENTIONS": [],
    "ATTENTION_WRAPS": [],
    "INITS": ["norm.weight"],
}
LEAVES = ["variants", "rope_scaling", "windowed_rope", "length_encodings", "attention_gate"]
LEAVES += ["attention_branches", "dca", "reattention"]


def option(parser, flag: str):
    return next(action for action in parser._actions if flag in action.option_strings)


def test_the_derived_lists_equal_their_tables():
    assert ROPE_SCALINGS == tuple(ROPE_INIT)
    assert WINDOWED == tuple(ROPE_ATTENTIONS)
    assert set(BLOCKS) == {(p, parallel) for p in PLACEMENTS for parallel in (False, True)}
    assert switches()[-len(QUERY_SCALES) - len(OUTPUT_GATES) :] == [*QUERY_SCALES, *OUTPUT_GATES]


def test_the_config_offers_each_tables_keys():
    choices = model_choices()
    assert choices["norm"] == tuple(NORMS)
    assert choices["norm_placement"] == PLACEMENTS
    assert choices["activation"] == tuple(ACTIVATIONS)
    assert choices["position"] == tuple(POSITIONS)
    assert choices["rope_scaling"] == tuple(ROPE_INIT)
    for key in [*QUERY_SCALES, *OUTPUT_GATES, "parallel_block", "qk_norm", "logn_attention"]:
        assert choices[key] == (False, True), key
    on_off = {key for key, allowed in choices.items() if allowed == (False, True)}
    assert all(isinstance(getattr(ModelArgs, key), bool) for key in on_off)


def test_the_flags_offer_each_tables_keys():
    import generate
    from picollama.kernels.caches import KV_CACHES
    from picollama.sampling.decode import SCALING_METHODS
    from picollama.serve import main as serve_main

    assert tuple(option(generate.parser(), "--rope-scaling").choices) == tuple(ROPE_INIT)
    assert SCALING_METHODS.split("|") == [m for m in ROPE_INIT if m != "none"]
    for parser in (generate.parser(), serve_main.parser()):
        kv_cache = option(parser, "--kv-cache")
        assert tuple(kv_cache.choices) == tuple(KV_CACHES)
        assert all(name in kv_cache.help for name in KV_CACHES)


def test_llamas_own_entries_come_first():
    # model.py fills its tables before registry.py does, so messages list LLaMA's choice first
    for name, own in LLAMA_ONLY.items():
        table = getattr(model, name)
        assert list(table)[: len(own)] == own, name


def test_no_leaf_fills_a_table_when_imported():
    # in a fresh interpreter: every leaf imported, the registry not, and the tables as model.py
    # left them
    code = (
        "import sys, model\n"
        + "".join(f"import picollama.components.{leaf}\n" for leaf in LEAVES)
        + "import picollama.components.length\n"
        + "assert 'picollama.components.registry' not in sys.modules\n"
        + f"print({{name: list(getattr(model, name)) for name in {TABLES!r}}})\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    tables = ast.literal_eval(done.stdout.strip())
    assert tables == LLAMA_ONLY


def writes_to_a_table(tree: ast.AST) -> list[int]:
    """The lines of a module that write into one of model.py's tables."""

    def named(node) -> bool:
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        return name in TABLES

    lines = []
    for node in ast.walk(tree):
        targets = list(node.targets) if isinstance(node, ast.Assign) else []
        targets += [node.target] if isinstance(node, ast.AugAssign) else []
        for target in targets:
            parts = target.elts if isinstance(target, ast.Tuple) else [target]
            lines += [node.lineno for t in parts if isinstance(t, ast.Subscript) and named(t.value)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            mutating = {"update", "append", "extend", "insert", "setdefault", "__setitem__"}
            if node.func.attr in mutating and named(node.func.value):
                lines.append(node.lineno)
    return lines


def test_only_model_py_and_the_registry_fill_the_tables():
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    paths = [p for p in listed.stdout.split() if not p.startswith("tests/")]
    fillers = {
        path
        for path in paths
        if (REPO / path).is_file() and writes_to_a_table(ast.parse((REPO / path).read_text()))
    }
    assert fillers == {"model.py", "picollama/components/registry.py"}
