"""A hostile user's inputs to generate.py, run directories and convert: one line, or they work."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import generate
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.convert import hf as hf_format
from picollama.convert import main as convert
from picollama.run_files import load_model, load_run
from picollama.sampling import memory as memory_budget
from picollama.sampling.sampler import Sampler, Sampling


@pytest.fixture(scope="module")
def run_dir(make_tiny_run, one_thread):
    return make_tiny_run(5)[0]


def sample_text(run_dir, capsys, *flags) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of generate.py on run_dir, 8 new tokens after "ab"."""
    prompt = [] if "--prompt" in flags else ["--prompt", "ab"]
    argv = ["--run", str(run_dir), *prompt, "--max-new-tokens", "8", *flags]
    status = run_command(generate.main, argv)
    out, err = capsys.readouterr()
    return status, out, err


def one_error_line(err: str) -> str:
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- sampling


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40, 1e-30])
def test_a_tiny_temperature_samples_greedily(temperature):
    """logits / temperature overflows (inf; NaN where the temperature is 0 in float32): the limit of
    a temperature going to 0 is greedy, never a failed torch.multinomial."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [-5.0, -1.0, -3.0, -2.0], [0.0, 0.5, 0.0, 0.2]])
    for top_k, top_p in [(None, None), (2, None), (None, 0.5), (3, 0.9)]:
        for seed in (0, None):  # its own generator, or torch's global one
            sampler = Sampler([Sampling(1, temperature, top_k, top_p, seed)] * 3, logits.device)
            assert sampler(logits, [True] * 3).tolist() == [1, 1, 1]


def test_ordinary_temperatures_sample_as_before():
    """The overflow guard changes no sample: the same draws as softmax(logits / t) alone."""
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1)) * 4
    every = [True] * len(logits)
    for temperature in (0.5, 0.8, 1.0, 2.0):
        probs = (logits / temperature).softmax(-1)
        # each row seeded 7 + row: its own generator
        seeded = [Sampling(1, temperature, seed=7 + row) for row in range(len(logits))]
        ours = Sampler(seeded, logits.device)(logits, every)
        for row, token in enumerate(ours.tolist()):
            generator = torch.Generator().manual_seed(7 + row)
            assert token == torch.multinomial(probs[row], 1, generator=generator).item()
        # no seed: one draw of every row from torch's global generator
        torch.manual_seed(7)
        ours = Sampler([Sampling(1, temperature)] * len(logits), logits.device)(logits, every)
        torch.manual_seed(7)
        assert torch.equal(ours, torch.multinomial(probs, 1).squeeze(-1))


def test_a_tiny_temperature_on_the_command_line_is_greedy(run_dir, capsys):
    greedy = sample_text(run_dir, capsys, "--temperature", "0")
    assert greedy[0] == 0, greedy[2]
    tiny = sample_text(run_dir, capsys, "--temperature", "1e-300", "--seed", "3")
    assert tiny[0] == 0 and tiny[1] == greedy[1], tiny[2]


def test_seeds_beyond_32_bits_are_refused():
    """torch's CPU generator keeps a seed's low 32 bits (seeds 1, 2**32 + 1 and 2**63 + 1 sample
    alike): a seed it cannot tell from a smaller one is refused; every other one is distinct."""
    assert Sampling(seed=2**32 - 1).seed == 2**32 - 1
    for seed in (2**32, 2**32 + 1, 2**63 + 1, 2**64 + 1, -1):
        with pytest.raises(UserError, match=r"--seed must be in 0\.\.4294967295"):
            Sampling(seed=seed)


def test_a_seed_beyond_32_bits_on_the_command_line_is_one_line(run_dir, capsys):
    status, out, err = sample_text(run_dir, capsys, "--seed", str(2**63 + 1))
    assert status == 2 and out == "" and "--seed must be in 0..4294967295" in one_error_line(err)
    assert sample_text(run_dir, capsys, "--seed", str(2**32 - 1))[0] == 0


# ---------------------------------------------------------------- prompts


@pytest.mark.parametrize("prompt, byte", [("\udcff\udcfe", 0), ("ab\udcff", 2), ("é\udcc3", 2)])
def test_a_prompt_that_is_not_utf8_is_one_line(run_dir, capsys, prompt, byte):
    """Bytes that are not UTF-8 reach Python's argv as lone surrogates ($'\\xff\\xfe' is
    "\\udcff\\udcfe"), which sentencepiece cannot take."""
    status, out, err = sample_text(run_dir, capsys, "--prompt", prompt)
    assert status == 2 and out == ""
    assert f"--prompt is not UTF-8 text (byte {byte})" in one_error_line(err)


def test_a_prompt_file_that_is_not_utf8_is_one_line(run_dir, tmp_path, capsys):
    (tmp_path / "utf16.txt").write_bytes("ab\n".encode("utf-16"))  # starts with \xff\xfe
    argv = ["--run", str(run_dir), "--prompt-file", str(tmp_path / "utf16.txt")]
    assert run_command(generate.main, argv) == 2
    assert "utf16.txt is not UTF-8 text (byte 0)" in one_error_line(capsys.readouterr().err)


def test_a_prompt_file_that_is_not_a_regular_file_is_refused_unopened(run_dir, tmp_path, capsys):
    """/dev/zero would be read until memory runs out, a FIFO without a writer blocks forever: each
    is refused saying what it is, before the model is even loaded."""
    os.mkfifo(tmp_path / "fifo")
    for path, kind in [
        ("/dev/zero", "a character device"),
        (tmp_path / "fifo", "a FIFO"),
        (tmp_path, "a directory"),
    ]:
        argv = ["--run", str(tmp_path / "no-run"), "--prompt-file", str(path)]
        assert run_command(generate.main, argv) == 2
        err = one_error_line(capsys.readouterr().err)
        assert f"--prompt-file {path} is {kind}, not a regular file" in err


def test_a_prompt_file_larger_than_memory_could_take_is_refused_before_reading(
    run_dir, tmp_path, capsys, monkeypatch
):
    """The most prompt text whose KV cache could fit (each token at most the longest piece) bounds
    the file, checked on its size: a sparse terabyte is refused at once."""
    (tmp_path / "huge.txt").write_bytes(b"")
    os.truncate(tmp_path / "huge.txt", 2**40)
    argv = ["--run", str(run_dir), "--prompt-file", str(tmp_path / "huge.txt")]
    assert run_command(generate.main, argv) == 2
    err = one_error_line(capsys.readouterr().err)
    assert "huge.txt holds 1,099,511,627,776 bytes: more prompt text than this model" in err
    (tmp_path / "huge.txt").unlink()  # sparse, but no terabyte file left behind
    # on a machine with 1 MiB beside the weights: its limit, exactly
    model, _ = load_model(run_dir)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    monkeypatch.setattr(generate, "memory_bytes", lambda device: weights + 2**20)
    tokenizer = load_run(run_dir, "cpu", torch.float32)[2]
    limit = memory_budget.prompt_file_limit(model, tokenizer, 2**20)
    assert 0 < limit < 2**20
    (tmp_path / "big.txt").write_bytes(b"ab cd\n" * (limit // 6 + 1))
    argv[-1] = str(tmp_path / "big.txt")
    assert run_command(generate.main, [*argv, "--dtype", "float32"]) == 2
    assert f"(at most {limit:,} bytes)" in one_error_line(capsys.readouterr().err)
    (tmp_path / "small.txt").write_bytes(b"ab cd\n" * 3)
    argv[-1] = str(tmp_path / "small.txt")
    assert run_command(generate.main, [*argv, "--max-new-tokens", "4"]) == 0


def test_more_samples_than_memory_holds_are_refused_with_the_estimate(run_dir, capsys, monkeypatch):
    status, out, err = sample_text(run_dir, capsys, "--num-samples", "1000000000")
    assert status == 2 and out == ""
    err = one_error_line(err)
    assert "1,000,000,000 rows of up to 11 tokens need at least" in err and " GiB " in err
    assert "lower --num-samples or --max-new-tokens" in err
    assert sample_text(run_dir, capsys, "--num-samples", "3")[0] == 0  # what fits still runs
    # 4 MiB beside the weights: 400 rows of 11 tokens fit (1.1 MiB of float32 KV cache and ids,
    # 0.15 MiB of samples, 2 MiB of logits), 800 do not
    model, _ = load_model(run_dir)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    monkeypatch.setattr(generate, "memory_bytes", lambda device: weights + 4 * 2**20)
    flags = ["--dtype", "float32", "--temperature", "0"]
    assert sample_text(run_dir, capsys, "--num-samples", "400", *flags)[0] == 0
    status, _, err = sample_text(run_dir, capsys, "--num-samples", "800", *flags)
    assert status == 2 and "800 rows of up to 11 tokens need at least 6.4 MiB" in one_error_line(
        err
    )


# ---------------------------------------------------------------- run directories


def edited_run(run_dir, tmp_path, edit, name="edited"):
    """A copy of run_dir whose config.json's "model" is changed by edit(dict)."""
    copy = tmp_path / name
    shutil.copytree(run_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    edit(config["model"])
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def without_recorded_model(run_dir, tmp_path):
    """A copy of run_dir as picollama saved it before model.safetensors recorded its model."""
    copy = tmp_path / "old"
    shutil.copytree(run_dir, copy)
    save_file(load_file(copy / "model.safetensors"), copy / "model.safetensors")
    return copy


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"n_heads": 8, "n_kv_heads": 4}, "model.n_heads is 8 there, 4 in the weights"),
        ({"activation": "geglu"}, "model.activation is geglu there, swiglu in the weights"),
        ({"tie_embeddings": True}, "model.tie_embeddings is True there, False in the weights"),
        ({"rope_theta": 500000.0}, "model.rope_theta is 500000.0 there, 10000.0 in the weights"),
        ({"norm_eps": 1e-6}, "model.norm_eps is 1e-06 there, 1e-05 in the weights"),
        ({"parallel_block": True}, "model.parallel_block is True there, False in the weights"),
    ],
)
def test_a_config_json_the_weights_contradict_is_one_line(
    run_dir, tmp_path, capsys, changes, named
):
    """Edits that keep every weight's shape would load and sample other text: the weights record
    the model they were saved with."""
    edited = edited_run(run_dir, tmp_path, lambda model: model.update(changes))
    status, out, err = sample_text(edited, capsys)
    assert status == 2 and out == ""
    assert f"weights do not match config.json: {named}" in one_error_line(err)


def test_the_context_may_change_in_config_json_and_old_runs_load(run_dir, tmp_path, capsys):
    """What train.init_from may change (the context, RoPE scaling) config.json may too; a run saved
    before the weights recorded their model loads as before."""
    status, greedy, err = sample_text(run_dir, capsys, "--temperature", "0")
    assert status == 0, err
    stretched = edited_run(
        run_dir,
        tmp_path,
        lambda m: m.update(max_seq_len=64, rope_scaling="linear", rope_factor=2.0),
    )
    assert sample_text(stretched, capsys, "--temperature", "0")[0] == 0
    old = without_recorded_model(run_dir, tmp_path)
    assert sample_text(old, capsys, "--temperature", "0")[1] == greedy


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"rope_theta": -10000.0}, "model.rope_theta must be positive"),
        ({"rope_theta": 0.0}, "model.rope_theta must be positive"),
        ({"norm_eps": 0.0}, "model.norm_eps must be positive"),
        ({"norm_eps": -1e-5}, "model.norm_eps must be positive"),
    ],
)
def test_impossible_values_in_config_json_are_one_line(run_dir, tmp_path, capsys, changes, named):
    """A run saved before the weights recorded their model: config.json's values are checked for
    their range (config/model_args.py's model_args_from_dict). A newer one's: refused either way."""
    old = without_recorded_model(run_dir, tmp_path)
    edited = edited_run(old, tmp_path, lambda model: model.update(changes))
    status, out, err = sample_text(edited, capsys)
    assert status == 2 and out == ""
    assert f"config.json is corrupt: {named}" in one_error_line(err)
    edited = edited_run(run_dir, tmp_path, lambda model: model.update(changes), "new")
    status, out, err = sample_text(edited, capsys)
    assert status == 2 and out == "" and named.split()[0] in one_error_line(err)


def test_a_missing_model_key_is_named_not_defaulted(run_dir, tmp_path, capsys):
    """max_seq_len, which every version wrote, missing: an error, not the default 256; a key added
    since (qk_norm) missing is an older run's, read as its default."""
    edited = edited_run(run_dir, tmp_path, lambda model: model.pop("max_seq_len"))
    status, _, err = sample_text(edited, capsys)
    assert status == 2
    assert "config.json is corrupt: model.max_seq_len is missing" in one_error_line(err)
    older = edited_run(run_dir, tmp_path, lambda model: model.pop("qk_norm"), "older")
    assert sample_text(older, capsys)[0] == 0


def test_weights_of_a_shape_no_config_has_are_one_line(run_dir, tmp_path, capsys):
    copy = without_recorded_model(run_dir, tmp_path)
    state = load_file(copy / "model.safetensors")
    state["tok_embeddings.weight"] = state["tok_embeddings.weight"].flatten()
    save_file(state, copy / "model.safetensors")
    status, _, err = sample_text(copy, capsys)
    assert status == 2 and "weights do not match config.json" in one_error_line(err)


# ---------------------------------------------------------------- convert


@pytest.mark.parametrize(
    "index, named",
    [
        ({"weight_map": {"lm_head.weight": 5}}, "weight_map 'lm_head.weight' must be str, not int"),
        ({"weight_map": ["model-00001.safetensors"]}, "weight_map must be an object, not list"),
        (["weight_map"], "unreadable index"),
        ({"metadata": {}}, "unreadable index"),
    ],
)
def test_a_broken_shard_index_is_one_line(run_dir, tmp_path, capsys, index, named):
    hf = tmp_path / "hf"
    hf_format.export_hf(run_dir, hf)
    (hf / "model.safetensors").unlink()
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    argv = ["from-hf", "--hf-dir", str(hf), "--out", str(tmp_path / "out")]
    assert run_command(convert.main, argv) == 2
    assert named in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_outputs_through_symbolic_links_and_into_new_folders(run_dir, tmp_path, capsys):
    """A link to an empty folder (or one on another disk) is written through: the temporary lies
    beside its target, not beside the link (where renaming a folder over a link fails). Missing
    folders are made; a dangling link gets its target."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    (tmp_path / "dangling").symlink_to(tmp_path / "target")
    for command, out, force in [
        ("to-hf", "link", []),
        ("to-hf", "link", ["--force"]),
        ("to-hf", "dangling", []),
        ("to-hf", "new/deeper/hf", []),
        ("to-gguf", "new/model.gguf", []),
    ]:
        argv = [command, "--run", str(run_dir), "--out", str(tmp_path / out), *force]
        assert run_command(convert.main, argv) == 0, capsys.readouterr().err
    names = ["config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"]
    for folder in ("empty", "target", "new/deeper/hf"):
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == names
    assert (tmp_path / "link").is_symlink() and (tmp_path / "dangling").is_symlink()
    argv = ["from-hf", "--hf-dir", str(tmp_path / "link"), "--out", str(tmp_path / "run/in/here")]
    assert run_command(convert.main, argv) == 0, capsys.readouterr().err
    assert (tmp_path / "run/in/here/model.safetensors").is_file()
    assert not list(tmp_path.rglob(".*"))  # no temporary left


def test_a_failed_write_removes_the_folders_it_made(run_dir, tmp_path, capsys, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_format, "save_file", full_disk)
    argv = ["to-hf", "--run", str(run_dir), "--out", str(tmp_path / "a" / "b" / "hf")]
    assert run_command(convert.main, argv) == 2
    assert "No space left on device" in one_error_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []
