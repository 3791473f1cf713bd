"""generate.py: sampling, batching, EOS, length limits, exact dynamic NTK, errors, the lab door."""

import ast
import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import generate
from data.tokenizer_training import train_tokenizer
from model import ModelArgs, Transformer
from picollama.cli.command import run_command
from picollama.components.length import stretched
from picollama.kernels.caches import KV_CACHES
from picollama.kernels.load import fast_step
from picollama.run_files import load_model, model_from_state_dict, save_model
from picollama.sampling import decode as decoding
from picollama.sampling.decode import DecodeOptions, decode_steps
from picollama.sampling.prompts import TextStream
from picollama.sampling.sampler import Sampling

TINY = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=32, multiple_of=16
)
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]

# tiny models on one thread throughout (conftest.one_thread: two stall each other on a busy 2-core
# machine, 5-50x slower here); the tests after the first that asked for it ran on one already
pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(std=None, **overrides) -> Transformer:
    """A random tiny model; std sharpens its weight matrices so that small numeric differences show
    in the logits."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**TINY | overrides)).eval()
    if std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.endswith("norm.weight"):
                    p.normal_(0, std)
    return model


def test_seeded_sampling_is_reproducible():
    model = make_model()
    first = decoding.generate(
        model, PROMPTS, Sampling(12, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    )
    assert first == decoding.generate(
        model, PROMPTS, Sampling(12, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    )
    assert first != decoding.generate(
        model, PROMPTS, Sampling(12, temperature=1.0, top_k=20, top_p=0.9, seed=4)
    )
    assert [len(row) for row in first] == [12, 12, 12]
    greedy = decoding.generate(model, PROMPTS, Sampling(12, temperature=0))
    assert (
        decoding.generate(model, PROMPTS, Sampling(12, temperature=1.0, top_k=1, seed=5)) == greedy
    )


@pytest.mark.parametrize("rope", ["none", "dynamic"])
def test_batch_of_different_lengths_equals_one_by_one(rope):
    # dynamic: past its context
    model = make_model(rope_scaling=rope, max_seq_len=16 if rope == "dynamic" else 32)
    batch = decoding.generate(model, PROMPTS, Sampling(20, temperature=0))
    alone = [
        decoding.generate(model, [prompt], Sampling(20, temperature=0))[0] for prompt in PROMPTS
    ]
    assert batch == alone and all(len(row) == 20 for row in batch)


def test_eos_stops_each_row_and_is_not_returned():
    model = make_model()
    free = decoding.generate(model, PROMPTS, Sampling(16, temperature=0))
    # an EOS that row 0 produces at step i > 0 for the first time
    i, eos = next((i, t) for i, t in enumerate(free[0]) if i > 0 and t not in free[0][:i])
    streamed = [[] for _ in PROMPTS]
    out = decoding.generate(
        model,
        PROMPTS,
        Sampling(16, temperature=0),
        eos_id=eos,
        on_token=lambda row, token: streamed[row].append(token),
    )
    expected = [row[: row.index(eos)] if eos in row else row for row in free]
    assert out == expected == streamed and len(out[0]) == i


def test_too_long_needs_rope_scaling():
    model = make_model()
    with pytest.raises(ValueError, match="--rope-scaling"):
        decoding.generate(model, [[1] * 10], Sampling(30))
    model.args = stretched(model.args, "linear", 64, factor=2.0)
    assert len(decoding.generate(model, [[1] * 10], Sampling(30, temperature=0))[0]) == 30


def test_dynamic_ntk_with_cache_is_exact():
    """Past the original context every step re-runs the prefix: the logits of a full forward."""
    model = make_model(std=0.3, rope_scaling="dynamic", max_seq_len=16)
    tokens = torch.zeros(1, 48, dtype=torch.long)
    tokens[0, :5] = torch.tensor([1, 5, 6, 7, 8])
    cached, full = [], []
    with torch.inference_mode():
        model.setup_cache(1, 48)
        for pos, logits in decode_steps(model, tokens, 5):
            tokens[:, pos] = logits.argmax(-1)
            cached.append(logits.clone())
            full.append(model(tokens[:, :pos])[:, -1])
        # the naive cached path: one token per step, never recomputing the stale keys and values
        model(tokens[:, :5], start_pos=0)
        naive = [model(tokens[:, pos - 1 : pos], start_pos=pos - 1)[:, -1] for pos in range(6, 48)]
        model.reset_cache()
    scale = torch.stack(full).abs().max()
    errors = torch.stack([(c - f).abs().max() for c, f in zip(cached, full, strict=True)]) / scale
    assert errors.max() < 1e-5, errors.max()
    naive_errors = (
        torch.stack([(n - f).abs().max() for n, f in zip(naive, full[1:], strict=True)]) / scale
    )
    assert naive_errors[:10].max() < 1e-5  # within the original context the plain cache is exact
    assert naive_errors[-10:].min() > 1e-3  # past it, stale keys and values change the logits


class ByteTokenizer:
    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_ids_beyond_the_tokenizer_are_never_chosen():
    model = make_model()
    with torch.no_grad():  # the ids a 60-piece tokenizer could not decode dominate the logits
        model.output.weight[60:] *= 50
    rows = decoding.generate(model, PROMPTS, Sampling(12, temperature=0))
    assert max(t for row in rows for t in row) >= 60
    for temperature in (0, 1.0):
        rows = decoding.generate(
            model,
            PROMPTS,
            Sampling(12, temperature=temperature, seed=0),
            options=DecodeOptions(vocab_limit=60),
        )
        assert all(len(row) == 12 and max(row) < 60 for row in rows)


def test_text_stream_holds_back_incomplete_characters():
    text, out = "Héllo — wörld ✓", io.StringIO()
    stream = TextStream(ByteTokenizer(), list(b"> "), out)
    for byte in text.encode():
        stream.add(byte)
        # never a U+FFFD for a character still arriving
        assert ("> " + text).startswith(out.getvalue())
    stream.flush_new()
    assert out.getvalue() == "> " + text


def test_the_thread_timing_stays_within_its_budget(one_thread):
    """fast_step times its decode steps before the first token: a slow step (a 135M model's, or one
    on two threads of a busy CPU) is timed in a few calls, not 5 rounds of 16."""
    import time

    from picollama.kernels.fused_step import DecodeStep
    from picollama.kernels.timing import step_seconds

    model = make_model()
    fast = DecodeStep(model)
    calls = []

    def slow(tokens, start_pos):
        calls.append(start_pos)
        time.sleep(0.05)
        return fast(tokens, start_pos=start_pos)

    seconds = step_seconds(model, {"slow": slow, "fast": fast}, budget=0.2)
    assert seconds["slow"] > 0.05 > seconds["fast"]
    assert len(calls) <= 5  # a warm-up, then one call a round until they took 0.2 s
    calls.clear()
    start = time.perf_counter()
    step_seconds(model, {"slow": slow, "fast": fast}, budget=1.0)
    # after the first round, rounds of up to int(1.0 / (5 * 0.05)) = 4 calls, within the budget
    assert 1 + 1 + 4 < len(calls) <= 1 + 1 + 4 * 4
    assert time.perf_counter() - start < 0.05 + 1.0 + 0.5


@pytest.fixture(scope="module")
def run_dir(make_tiny_run, one_thread):
    return make_tiny_run(20)[0]


def test_command_streams_and_summarises(run_dir, capsys):
    argv = ["--run", str(run_dir), "--prompt", "ab cd", "--max-new-tokens", "20"]
    assert generate.main([*argv, "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ab cd") and len(out) > len("ab cd\n")
    assert "prompt tokens" in err and "20 new tokens" in err and "tokens/s" in err


def test_command_batches_a_prompt_file(run_dir, tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text("ab\n\nab cd ef gh\nx\n")
    argv = ["--run", str(run_dir), "--max-new-tokens", "8", "--temperature", "0"]
    prompt_file = ["--prompt-file", str(tmp_path / "prompts.txt"), "--num-samples", "2"]
    assert generate.main([*argv, *prompt_file]) == 0
    samples = capsys.readouterr().out.split("--- sample ")[1:]
    assert len(samples) == 6 and samples[-1].startswith("6/6")
    texts = [s.split("---\n", 1)[1].rstrip("\n") for s in samples]
    assert texts[0] == texts[1] and texts[2].startswith("ab cd ef gh")
    assert generate.main([*argv, "--prompt", "ab"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == texts[0]  # greedy in a batch = alone


def test_a_tokenizer_with_fewer_pieces_than_the_model(run_dir, tmp_path, capsys):
    # a model with spare embeddings (a padded vocabulary) that it would rather choose: the text is
    # still printed
    model, config = load_model(run_dir)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name in ("tok_embeddings.weight", "output.weight"):  # ids 320..399: louder 0..79
        state[name] = torch.cat([state[name], 50 * state[name][:80]])
    wide = model_from_state_dict(ModelArgs(**config["model"] | {"vocab_size": 400}), state)
    save_model(wide, tmp_path / "wide", tokenizer=run_dir / "tokenizer.model")
    argv = ["--run", str(tmp_path / "wide"), "--prompt", "ab", "--max-new-tokens", "10"]
    assert run_command(generate.main, [*argv, "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ab") and len(out.strip()) > len("ab"), (out, err)
    assert "10 new tokens" in err, err
    # another, smaller tokenizer in place of the run's own: refused
    shutil.copytree(run_dir, tmp_path / "swapped")
    (tmp_path / "swapped" / "tokenizer.model").write_bytes(
        train_tokenizer(["a smaller tokenizer\n"] * 20, 280, 0)
    )
    assert run_command(generate.main, ["--run", str(tmp_path / "swapped")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert "not the tokenizer the model was saved with" in err


def test_command_context_limit_names_rope_scaling(run_dir, capsys):
    argv = ["--run", str(run_dir), "--max-new-tokens", "40", "--temperature", "0"]
    assert run_command(generate.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--rope-scaling" in err and err.count("\n") == 1
    assert generate.main(argv + ["--rope-scaling", "yarn"]) == 0
    assert "40 new tokens" in capsys.readouterr().err


@pytest.mark.parametrize("position", ["alibi", "nope", "sinusoidal", "learned"])
def test_sampling_past_the_context_is_the_position_encodings_to_allow(
    run_dir, tmp_path, capsys, position
):
    """ALiBi and NoPE sample 4× their context (a cache sized for the request), sinusoidal with a
    warning; a learned table cannot, and says how large it is; none takes a RoPE scaling."""
    torch.manual_seed(0)
    args = ModelArgs(
        dim=32, n_layers=2, n_heads=4, vocab_size=320, max_seq_len=32, position=position
    )
    run = save_model(
        Transformer(args).eval(), tmp_path / position, tokenizer=run_dir / "tokenizer.model"
    )
    argv = ["--run", str(run), "--prompt", "ab", "--max-new-tokens", "128", "--temperature", "0"]
    status = run_command(generate.main, argv)
    out, err = capsys.readouterr()
    if position == "learned":
        assert status == 2 and out == "" and err.count("\n") == 1, err
        assert "learned position table of 32 positions" in err
    else:
        assert status == 0 and "128 new tokens" in err, err
        assert ("warning: sinusoidal positions past 32" in err) == (position == "sinusoidal")
    assert run_command(generate.main, argv + ["--rope-scaling", "yarn"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --rope-scaling") and err.count("\n") == 1, err
    assert "position = 'rope' only" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--run", "{missing}"], "not a picollama run directory"),
        (["--run", "{run}", "--temperature", "-1"], "temperature"),
        (["--run", "{run}", "--rope-scaling", "rope9"], "invalid choice"),
        (["--run", "{run}", "--rope-scaling", "linear", "--rope-factor", "0.5"], "--rope-factor"),
    ],
)
def test_command_errors_are_one_line(run_dir, tmp_path, capsys, argv, message):
    # in this process (test_cli_errors.test_as_scripts_too runs generate.py itself)
    argv = [a.format(run=run_dir, missing=tmp_path / "missing") for a in argv]
    assert run_command(generate.main, argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error:") and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "rope",
    [
        ["--rope-scaling", "linear", "--rope-factor", "0.5"],
        ["--rope-scaling", "ntk", "--rope-factor", "0"],  # not silently replaced by the default
        ["--rope-scaling", "yarn", "--rope-factor", "inf"],
        ["--rope-scaling", "linear", "--rope-factor", "nan"],
        ["--rope-scaling", "none", "--rope-factor", "4"],  # none has no factor to use
        ["--rope-factor", "2"],
    ],
)
def test_command_refuses_a_bad_rope_factor(run_dir, capsys, rope):
    argv = ["--run", str(run_dir), "--max-new-tokens", "4", "--temperature", "0", *rope]
    assert run_command(generate.main, argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: --rope-factor") and err.count("\n") == 1


# ---------------------------------------------------------------- the core and the lab

REPO = Path(__file__).resolve().parent.parent
# the core: the top-level scripts, data/ and picollama/ outside picollama/lab/
CORE = sorted(
    [REPO / "model.py", REPO / "train.py", REPO / "generate.py"]
    + list((REPO / "data").glob("*.py"))
    + list((REPO / "picollama").glob("*.py"))
)


def imported_modules(path: Path) -> set[str]:
    """Every module the file's import statements name, anywhere (`from a import b`: a and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_no_core_module_imports_the_lab():
    for path in CORE:
        lab = {name for name in imported_modules(path) if name.startswith("picollama.lab")}
        assert not lab, f"{path.relative_to(REPO)} imports {lab}"


def test_only_generates_lab_commands_load_the_lab():
    """Importing the whole core, and parsing a sampling command, loads nothing of picollama.lab;
    generate.py's `extrapolate` and `study` open it (their flags are the lab's)."""
    modules = [
        ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for path in CORE
    ]
    script = f"""
import importlib, sys
for name in {modules!r}:
    importlib.import_module(name)
import generate
from picollama.components.length import stretched
generate.parser().parse_args(["--run", "r", "--prompt", "extrapolate"])
print(sorted(m for m in sys.modules if m.startswith("picollama.lab")))
generate.parser().parse_args(["extrapolate", "--run", "r", "--lengths", "64"])
print("picollama.lab.extrapolate" in sys.modules)
generate.parser().parse_args(["study", "--quick"])
print("picollama.lab.study" in sys.modules)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "True", "True"], result.stdout


@pytest.mark.parametrize("kv_cache", ["bfloat16", "int8"])
def test_kv_cache_flag_sets_the_cache_dtype(kv_cache):
    """--kv-cache: the fused step's KV cache dtype (KV_CACHES), which generate() sets up."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=97)).eval()
    step = fast_step(model, False, 1, KV_CACHES[kv_cache])
    seen = []
    original = model.setup_cache

    def spy(*args, dtype=None, **kwargs):
        seen.append(dtype)
        original(*args, dtype=dtype, **kwargs)

    model.setup_cache = spy
    options = DecodeOptions(step)
    tokens = decoding.generate(model, [[1, 2, 3]], Sampling(5, temperature=0), options=options)[0]
    assert len(tokens) == 5 and seen[-1] == KV_CACHES[kv_cache]
