"""Wrong commands: exit 2, one `error:` line, no traceback, and every file left byte for byte."""

import functools
import gc
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import generate
import train
from data import prepare, tokenizer_training
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.cli.outputs import atomic_output, exclusive
from picollama.convert import hf as hf_format
from picollama.convert import main as convert
from picollama.lab.bench.common import module_of

REPO = Path(__file__).resolve().parent.parent
TRAIN = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.n_heads=2",
    "--model.vocab_size=320",
    "--model.max_seq_len=32",
    "--train.seq_len=32",
    "--train.batch_size=8",
    "--train.max_steps=2",
    "--train.sample_tokens=0",
    "--eval.batches=1",
    "--train.compile=false",  # the default config compiles: not for two steps
]


@functools.cache
def small_tokenizer() -> bytes:
    """A real sentencepiece model with fewer pieces (280) than the runs' 320, of another text
    (trained once: three copies hold it)."""
    return tokenizer_training.train_tokenizer(["the cat sat on the mat.\n"] * 50, 280, 0)


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """train.main ends in a full gc.collect() (device.close, before it destroys its process group),
    which in this process, holding torch, transformers and the suite's objects, costs 0.1-0.3 s of
    CPU: ~25 times here. gc.freeze() takes what exists now out of the collector's sight (collected
    first); what the commands make is collected as before."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def ws(make_tiny_run, tmp_path_factory):
    """A workspace of good and broken inputs; every case runs in it and must leave it as it was."""
    run_dir, data_dir = make_tiny_run(steps=5)
    ws = tmp_path_factory.mktemp("ws")
    shutil.copytree(run_dir, ws / "run")
    shutil.copytree(data_dir, ws / "data")
    shutil.copytree(data_dir.parent / "corpus", ws / "corpus")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    argv = [*TRAIN, f"--data.dir={ws / 'data'}", f"--train.out_dir={ws / 'trained'}"]
    assert run_command(train.main, argv) == 0
    hf_format.export_hf(ws / "run", ws / "hf")
    torch.set_num_threads(threads)
    add_broken_runs(ws)
    add_broken_data(ws)
    add_wrong_json(ws)
    add_foreign_files(ws)
    return ws


def add_broken_runs(ws: Path):
    """Copies of ws/run with wrong weights or tokenizers."""
    shutil.copytree(ws / "run", ws / "nan_run")  # weights that are not finite
    state = load_file(ws / "nan_run" / "model.safetensors")
    state["tok_embeddings.weight"][3, 5] = float("nan")
    save_file(state, ws / "nan_run" / "model.safetensors")

    shutil.copytree(ws / "run", ws / "mismatch_run")  # config.json does not describe the weights
    config = json.loads((ws / "mismatch_run" / "config.json").read_text())
    config["model"]["dim"] = 64
    (ws / "mismatch_run" / "config.json").write_text(json.dumps(config))

    # another, smaller tokenizer than the model's
    shutil.copytree(ws / "run", ws / "small_tokenizer_run")
    (ws / "small_tokenizer_run" / "tokenizer.model").write_bytes(small_tokenizer())

    edit_json(ws, "run", "no_bos_run", "config.json", lambda c: c.pop("tokenizer_sha256"))
    (ws / "no_bos_run" / "tokenizer.model").write_bytes(
        without_bos((ws / "run" / "tokenizer.model").read_bytes())
    )
    # config.json edited: the same weight shapes, another model (the weights record theirs)
    heads = {"n_heads": 8, "n_kv_heads": 4}
    edit_json(ws, "run", "n_heads_run", "config.json", lambda c: c["model"].update(heads))
    edit_json(ws, "run", "no_context_run", "config.json", lambda c: c["model"].pop("max_seq_len"))
    # a run saved before the weights recorded their model: config.json's values are checked
    shutil.copytree(ws / "run", ws / "old_run")
    save_file(load_file(ws / "old_run" / "model.safetensors"), ws / "old_run" / "model.safetensors")
    for name, key, value in [
        ("old_negative_theta_run", "rope_theta", -1.0),
        ("old_zero_eps_run", "norm_eps", 0.0),
    ]:
        edit_json(
            ws, "old_run", name, "config.json", lambda c, k=key, v=value: c["model"].update({k: v})
        )
    (ws / "config_only").mkdir()  # a run directory holding nothing to resume or start from
    shutil.copy(ws / "run" / "config.json", ws / "config_only")


def add_broken_data(ws: Path):
    """Copies of ws/data: another tokenizer's, truncated, and one holding a text."""
    # the same shards, claimed by another tokenizer
    shutil.copytree(ws / "data", ws / "other_tokenizer_data")
    (ws / "other_tokenizer_data" / "tokenizer.model").write_bytes(small_tokenizer())
    meta = json.loads((ws / "other_tokenizer_data" / "meta.json").read_text())
    meta["tokenizer_sha256"] = hashlib.sha256(small_tokenizer()).hexdigest()
    (ws / "other_tokenizer_data" / "meta.json").write_text(json.dumps(meta))

    shutil.copytree(ws / "data", ws / "truncated_data")  # the val shard one token short
    val = ws / "truncated_data" / "val-00000.bin"
    val.write_bytes(val.read_bytes()[:-2])

    # values no prepare writes: an IndexError mid-run, an AttributeError, silently wrong rows
    shutil.copytree(ws / "data", ws / "past_vocab_data")  # ids past the model's embedding
    tokens = np.fromfile(ws / "past_vocab_data" / "train-00000.bin", dtype=np.uint16)
    tokens[5:40] = 65000
    tokens.tofile(ws / "past_vocab_data" / "train-00000.bin")
    shutil.copytree(ws / "data", ws / "array_meta_data")  # meta.json a JSON array
    (ws / "array_meta_data" / "meta.json").write_text("[1, 2]\n")
    shutil.copytree(ws / "data", ws / "reversed_docs_data")  # document offsets out of order
    offsets = np.load(ws / "reversed_docs_data" / "train-00000.docs.npy")
    offsets[1:] = offsets[1:][::-1]
    np.save(ws / "reversed_docs_data" / "train-00000.docs.npy", offsets)

    # a prepared dataset holding a text the command reads
    shutil.copytree(ws / "data", ws / "data_with_text")
    (ws / "data_with_text" / "notes.txt").write_text(
        "a few words to tokenize, read from inside the output\n" * 40
    )


def add_wrong_json(ws: Path):
    """Copies whose config.json or meta.json holds a value of the wrong type or size."""
    edit_json(
        ws,
        "run",
        "bool_as_string_run",
        "config.json",
        lambda c: c["model"].update(tie_embeddings="yes"),
    )
    edit_json(ws, "run", "null_dim_run", "config.json", lambda c: c["model"].update(dim=None))
    edit_json(ws, "data", "string_vocab_data", "meta.json", lambda m: m.update(vocab_size="320"))
    edit_json(
        ws, "hf", "hf_string_tie", "config.json", lambda c: c.update(tie_word_embeddings="false")
    )
    edit_json(ws, "hf", "hf_null_eps", "config.json", lambda c: c.update(rms_norm_eps=None))
    edit_json(ws, "hf", "hf_zero_eps", "config.json", lambda c: c.update(rms_norm_eps=0.0))
    edit_json(ws, "hf", "hf_negative_theta", "config.json", negative_theta)
    shutil.copytree(ws / "hf", ws / "hf_number_shard")  # a shard index naming a number, not a file
    (ws / "hf_number_shard" / "model.safetensors").unlink()
    (ws / "hf_number_shard" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": 5}})
    )
    meta = "train_state/step_000002/meta.json"
    edit_json(ws, "trained", "string_step_trained", meta, lambda m: m.update(step="2"))
    # a checkpoint saved before meta.json recorded the optimizer
    edit_json(
        ws,
        "trained",
        "unrecorded_optim_trained",
        meta,
        lambda m: m["settings"].pop("optim.name", None),
    )
    edit_json(
        ws, "trained", "huge_context_trained", meta, lambda m: m["model"].update(max_seq_len=10**12)
    )
    for name, key, value in [  # sizes no model has: once "out of memory", a traceback or a hang
        ("huge_context_run", "max_seq_len", 10**12),
        ("zero_context_run", "max_seq_len", 0),
        ("huge_dim_run", "dim", 10**12),
        ("many_layers_run", "n_layers", 10**8),
        ("more_layers_run", "n_layers", 1000),
    ]:
        edit_json(
            ws, "run", name, "config.json", lambda c, k=key, v=value: c["model"].update({k: v})
        )


def add_foreign_files(ws: Path):
    """What picollama did not write: outputs must leave them alone."""
    (ws / "file").write_text("a regular file\n")
    # a folder picollama did not write: --force leaves it alone
    (ws / "home" / "Documents").mkdir(parents=True)
    (ws / "home" / "Documents" / "thesis.txt").write_text("years of work\n")
    (ws / "home" / ".bashrc").write_text("export EDITOR=vi\n")
    # an output that is not a file (never /dev/null itself: old code replaced it)
    make_device(ws / "null")
    (ws / "latin1.txt").write_bytes("café au lait\n".encode("latin-1"))  # not UTF-8


def negative_theta(config: dict):
    """An HF config.json with a negative RoPE base (in both places it is written)."""
    config["rope_theta"] = config["rope_parameters"]["rope_theta"] = -10000.0


def without_bos(model_proto: bytes) -> bytes:
    """The sentencepiece model without a BOS token (its piece kept as an ordinary one), as some
    imported models are."""
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto.FromString(model_proto)
    model.trainer_spec.bos_id = -1
    model.pieces[1].type = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    return model.SerializeToString()


def make_device(path: Path):
    """A character device like /dev/null at path (root only), else a FIFO: no output replaces it."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        os.mkfifo(path)


def edit_json(ws: Path, source: str, copy: str, name: str, edit):
    """A copy of ws/source whose JSON file `name` is changed by edit(dict)."""
    shutil.copytree(ws / source, ws / copy)
    value = json.loads((ws / copy / name).read_text())
    edit(value)
    (ws / copy / name).write_text(json.dumps(value))


def snapshot(root: Path) -> dict:
    """Every path under root, with its bytes' hash for files."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(root.rglob("*"))
    }


def stat_signature(root: Path) -> list:
    """Every path under root with its inode, size, mtime and ctime (any write changes the last)."""
    return [
        (str(p), s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)
        for p in sorted(root.rglob("*"))
        for s in [p.lstat()]
    ]


LAST_SNAPSHOT = {}  # the workspace as the previous case left it: {"signature": ..., "hashes": ...}


def snapshot_before(ws: Path) -> dict:
    """snapshot(ws), taken by the previous case after its command where nothing has touched ws
    since (the same paths, inodes, sizes, mtimes and ctimes), else anew: the cases run one after
    another, and each one's `after` is the next one's `before`."""
    if LAST_SNAPSHOT.get("signature") == stat_signature(ws):
        return LAST_SNAPSHOT["hashes"]
    return snapshot(ws)


def snapshot_after(ws: Path) -> dict:
    """snapshot(ws), kept for the next case's snapshot_before."""
    hashes = snapshot(ws)
    LAST_SNAPSHOT.update(signature=stat_signature(ws), hashes=hashes)
    return hashes


def bench_main(name: str):
    """A benchmark's main (picollama.lab.bench.NAME or lab.measure.NAME)."""
    return importlib.import_module(module_of(name)).main


def train_args(*args):
    return [*TRAIN, "--data.dir={ws}/data", "--train.out_dir={ws}/new", *args]


# One case a line: the command (train, generate, convert, prepare or bench.NAME), its arguments
# (split at spaces; {ws} is the workspace; train's come after train_args' flags), and after "=>" a
# piece of the one error line. A line that starts with spaces continues the one before.
CASES_TABLE = """
# train.py: outputs, values, sizes, resumes, data
train --train.out_dir={ws}/file/run => is a file, not a directory
train --train.out_dir=/proc/picollama-run => cannot write /proc/picollama-run
train --optim.lr=nan => --optim.lr must be finite, not nan
train --optim.lr=-1 => --optim.lr must be positive
train --train.batch_size=0 => --train.batch_size must be positive, not 0
train --checkpoint.interval=-1 => --checkpoint.interval must be zero or more
train --model.multiple_of=0 => --model.multiple_of must be positive
train --model.rope_theta=-1 => --model.rope_theta must be positive
train --model.vocab_size=100000000000 => [model] vocab_size must be at most 4,194,304
train --model.vocab_size=4000000 --model.dim=65536
    => the model (627,375,931,392 parameters) cannot fit in memory: its weights, gradients and
train --train.out_dir={ws}/huge_context_trained --resume => model.max_seq_len must be at most
train --no_such.key=1 => unknown config key no_such.key
train --config {ws}/missing.toml => --config {ws}/missing.toml: No such file or directory
train --resume => nothing to resume
train --train.out_dir={ws}/trained => already holds a run
train --train.out_dir={ws}/trained --resume --model.dim=64 => different model
train --train.out_dir={ws}/trained --resume --train.max_steps=3 --data.dir={ws}/other_tokenizer_data
    => trained with another tokenizer (sha256
train --train.out_dir={ws}/trained --resume --train.max_steps=3 --data.dir={ws}/other_tokenizer_data
    => than data.dir {ws}/other_tokenizer_data has (sha256
train --train.out_dir={ws}/trained --resume --train.max_steps=3 --data.dir={ws}/other_tokenizer_data
    => resume with the dataset it was trained on (--data.dir={ws}/data, as its config.json records)
train --data.dir={ws}/truncated_data => truncated
train --data.dir={ws}/past_vocab_data => past_vocab_data/train-00000.bin holds token id 65,000
    (token 5), outside the model's vocabulary of 320 (model.vocab_size)
train --data.dir={ws}/array_meta_data
    => array_meta_data/meta.json holds [1, 2], not the JSON object prepare writes
train --data.dir={ws}/reversed_docs_data --data.pack_documents=true
    => reversed_docs_data/train-00000.docs.npy: offset 2 (
# train.py: data.dir is a prepared dataset; only data/shakespeare is prepared by itself (once a
# mistyped folder got Shakespeare, and a folder of texts or a run "choose another --out")
train --data.dir={ws}/no_such_data
    => data.dir {ws}/no_such_data is not a prepared dataset (it does not exist); make one with
    python data/prepare.py --source YOUR_TEXT --out {ws}/no_such_data, or give
    --data.source=YOUR_TEXT
train --data.dir={ws}/corpus => data.dir {ws}/corpus is not a prepared dataset (no meta.json; it
    holds doc00.txt, doc01.txt, doc02.txt and 9 more); make one with python data/prepare.py --source
train --data.dir={ws}/run --train.out_dir={ws}/run --resume
    => data.dir {ws}/run is not a prepared dataset (no meta.json; it holds config.json,
train --data.dir={ws}/file => data.dir {ws}/file is not a prepared dataset (it is a file)
# train.py: a batch past memory is refused with the estimate, before any work (it once grew for GBs)
train --train.batch_size=1000000000 => train.batch_size 1,000,000,000 cannot fit in memory:
    1,000,000,000 sequences of 32 tokens at once need at least
train --train.batch_size=1000000000 --train.grad_accum=1000 => 1,000,000 sequences of 32 tokens
train --eval.batch_size=1000000000 => eval.batch_size 1,000,000,000 cannot fit in memory:
# train.py: a run is continued only by --resume, never written into the dataset; --resume
# is exact or refused; a run without a checkpoint gets the same advice with --resume and without
train --train.out_dir={ws}/run
    => already holds a run (model.safetensors, config.json) but no checkpoint to resume
train --train.out_dir={ws}/run --resume
    => already holds a run (model.safetensors, config.json) but no checkpoint to resume
train --train.out_dir={ws}/config_only
    => holds config.json but no model.safetensors and no checkpoint (train_state/): nothing to
train --train.out_dir={ws}/config_only --resume
    => holds config.json but no model.safetensors and no checkpoint (train_state/): nothing to
# train.py: another optimizer than the checkpoint's is a mismatch, not a corrupt checkpoint
train --train.out_dir={ws}/trained --resume --train.max_steps=3 --optim.name=adamw
    => optim.name 'muon' → 'adamw'; resume with the checkpoint's values, or start a new run from
train --train.out_dir={ws}/unrecorded_optim_trained --resume --train.max_steps=3 --optim.name=adamw
    => holds the state of another optimizer or model
train --train.out_dir={ws}/data => overlaps the input
train --train.out_dir={ws}/data/run => overlaps the input
train --train.out_dir={ws}/trained --resume => nothing to do
train --train.out_dir={ws}/trained --resume --train.batch_size=16 => train.batch_size 8 → 16
train --train.out_dir={ws}/trained --resume --train.seq_len=16 => train.seq_len 32 → 16
train --train.out_dir={ws}/string_step_trained --resume => step must be int, not str '2'
train --data.dir={ws}/string_vocab_data => meta.json vocab_size must be int, not str
train --train.sample_tokens=40 => train.sample_tokens (40) and the prompt (1 tokens): 41 tok
# generate.py
generate --run {ws}/missing => not a picollama run directory
generate --run {ws}/run/model.safetensors => pass the run directory
# a Hugging Face directory is imported (into the cache): a broken one fails there, in one line
generate --run {ws}/hf_null_eps => rms_norm_eps must be float, not NoneType
generate --run {ws}/nan_run => NaN or infinite weights
generate --run {ws}/mismatch_run => model.dim is 64 there, 32 in the weights
generate --run {ws}/huge_context_run => config.json is corrupt: model.max_seq_len must be at most
generate --run {ws}/zero_context_run => corrupt: model.max_seq_len must be positive, not 0
generate --run {ws}/huge_dim_run => config.json is corrupt: model.dim must be at most 65,536
generate --run {ws}/many_layers_run => config.json is corrupt: model.n_layers must be at most
generate --run {ws}/more_layers_run => model.n_layers is 1000 there, 2 in the weights
generate --run {ws}/no_bos_run => no_bos_run: its tokenizer has no BOS token to begin an empty
generate --run {ws}/small_tokenizer_run => not the tokenizer the model was saved with
generate --run {ws}/run --temperature nan => temperature must be a finite number
generate --run {ws}/run --rope-scaling ntk --rope-factor 0 => --rope-factor
generate --run {ws}/run --rope-scaling yarn --rope-factor inf => --rope-factor
generate --run {ws}/run --rope-scaling none --rope-factor 4 => --rope-factor
generate --run {ws}/run --prompt-file {ws}/missing.txt => --prompt-file
generate --run {ws}/run --top-k 0 => --top-k
generate --run {ws}/run --prompt-file {ws}/latin1.txt => is not UTF-8 text (byte 3)
generate --run {ws}/run --device mps => MPS (Apple's GPU) is not available
generate --run {ws}/run --device meta => picollama runs on cpu, cuda
generate --run {ws}/bool_as_string_run => model.tie_embeddings must be bool, not str 'yes'
generate --run {ws}/null_dim_run => model.dim must be int, not NoneType None
generate --run {ws}/n_heads_run
    => weights do not match config.json: model.n_heads is 8 there, 4 in the weights
generate --run {ws}/no_context_run => config.json is corrupt: model.max_seq_len is missing
generate --run {ws}/old_negative_theta_run --max-new-tokens 8
    => corrupt: model.rope_theta must be positive
generate --run {ws}/old_zero_eps_run --max-new-tokens 8 => corrupt: model.norm_eps must be positive
generate --run {ws}/run --prompt-file /dev/zero
    => --prompt-file /dev/zero is a character device, not a regular file
generate --run {ws}/run --prompt-file {ws} => is a directory, not a regular file
generate --run {ws}/run --num-samples 1000000000 --max-new-tokens 8
    => 1,000,000,000 rows of up to 9 tokens need at least
generate --run {ws}/run --seed 9223372036854775809 => --seed must be in 0..4294967295
# generate.py extrapolate
generate extrapolate --run {ws}/run --out {ws}/file => is a file, not a directory
generate extrapolate --run {ws}/run --out /proc/picollama => cannot write
generate extrapolate --run {ws}/run --lengths 100,abc => 'abc' is not a positive int
generate extrapolate --run {ws}/run --seed -1 => --seed: invalid non-negative int value: '-1'
generate extrapolate --run {ws}/run --data {ws}/other_tokenizer_data => tokenizer
generate extrapolate --run {ws}/run --data {ws}/truncated_data --out {ws}/report => truncated
generate extrapolate --run {ws}/nan_run => NaN or infinite weights
generate extrapolate --run {ws}/huge_context_run => corrupt: model.max_seq_len must be at
generate extrapolate --run {ws}/run --device mps => MPS (Apple's GPU) is not available
# python -m picollama.convert
convert to-hf --run {ws}/run --out {ws}/run --force => overlaps the input
convert to-hf --run {ws}/run --out {ws} --force => overlaps the input
convert to-hf --run {ws}/run --out {ws}/run/hf --force => overlaps the input
convert to-hf --run {ws}/run --out {ws}/hf => pass --force to replace it
convert to-hf --run {ws}/run --out {ws}/file/hf => is a file, not a directory
convert to-hf --run {ws}/run --out /proc/picollama-hf => cannot write
convert to-hf --run {ws}/nan_run --out {ws}/out => NaN or infinite weights
convert to-gguf --run {ws}/huge_dim_run --out {ws}/o.gguf => config.json is corrupt: model.dim
convert from-hf --hf-dir {ws}/run --out {ws}/out => not a Hugging Face Llama config
convert from-hf --hf-dir {ws}/hf --out {ws}/hf --force => overlaps the input
convert from-hf --hf-dir {ws}/hf_string_tie --out {ws}/out
    => tie_word_embeddings must be bool, not str 'false'
convert from-hf --hf-dir {ws}/hf_null_eps --out {ws}/out => rms_norm_eps must be float, not NoneType
convert from-hf --hf-dir {ws}/hf_zero_eps --out {ws}/zero_eps_out
    => norm_eps must be positive, not 0.0 (rms_norm_eps there)
convert from-hf --hf-dir {ws}/hf_negative_theta --out {ws}/theta_out
    => rope_theta must be positive, not -10000.0
convert from-hf --hf-dir {ws}/hf_number_shard --out {ws}/shard_out
    => weight_map 'model.embed_tokens.weight' must be str, not int 5
convert to-gguf --run {ws}/run --out {ws}/null --force => null: it is a
convert to-hf --run {ws}/run --out {ws}/null --force => null: it is a
convert to-hf --run {ws}/run --out {ws}/home --force => not replacing {ws}/home: it holds
convert from-hf --hf-dir {ws}/hf --out {ws}/home --force => so picollama did not write it
convert from-hf --hf-dir {ws}/hf --out {ws}/home/Documents --force => holds thesis.txt
convert to-gguf --run {ws}/run --out {ws}/file --force => file: it is not a GGUF file, so
# data/prepare.py
prepare --source {ws}/missing --out {ws}/out => no such file or directory
prepare --source {ws}/corpus --out /proc/picollama-data => cannot write
prepare --source {ws}/corpus --out {ws}/file => is not a prepared dataset
prepare --source {ws}/corpus --out {ws}/out --vocab-size 0 => --vocab-size
prepare --source {ws}/corpus --out {ws}/out --max-bytes lots => not a size
prepare --source {ws}/data_with_text/notes.txt --out {ws}/data_with_text --force => overlaps
# python -m picollama.lab.bench.NAME
bench.train --config no-such-config --out {ws}/bench.json => no config 'no-such-config'
bench.train --threads 0 --out {ws}/bench.json => --threads: invalid positive int value: '0'
bench.decode --positions 16,abc --out {ws}/bench.json => --positions
bench.memory --smoke --out {ws}/file/bench.json => is a file, not a directory
bench.data --smoke --out /proc/picollama.json => cannot write
bench.data --smoke --out {ws}/null => null: it is a
bench.memory --smoke --out {ws}/null => null: it is a
"""


def parse_cases(table: str) -> list[tuple]:
    """(command, argv, message) for each case of a table like CASES_TABLE."""
    cases = []
    for line in re.sub(r"\n +", " ", table).strip().splitlines():
        if line.startswith("#"):
            continue
        left, message = (part.strip() for part in line.split("=>"))
        command, *argv = left.split()
        cases.append((command, train_args(*argv) if command == "train" else argv, message))
    return cases


LONG_PROMPT = "--train.sample_prompt=" + "a b c d " * 8  # words with spaces: not for the table
CASES = parse_cases(CASES_TABLE) + [
    ("train", train_args("--train.sample_tokens=20", LONG_PROMPT), "and the prompt ("),
    # bytes that are not UTF-8 ($'\xff\xfe') reach argv as lone surrogates: once a traceback
    (
        "train",
        train_args("--train.sample_prompt=\udcff\udcfe"),
        "--train.sample_prompt is not UTF-8 text (byte 0); set the terminal to UTF-8",
    ),
    (
        "train",
        train_args("--train.sample_tokens=8", "--train.sample_prompt=ab\udcff"),
        "--train.sample_prompt is not UTF-8 text (byte 2)",
    ),
]
MAINS = {
    "train": train.main,
    "generate": generate.main,
    "convert": convert.main,
    "prepare": prepare.main,
}


@pytest.mark.parametrize(
    "command, argv, message", CASES, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(CASES)]
)
def test_a_wrong_command_is_one_line_and_changes_nothing(
    ws, one_thread, capsys, monkeypatch, tmp_path, command, argv, message
):
    monkeypatch.setenv("PICOLLAMA_CACHE", str(tmp_path))  # where generate imports a model
    main = bench_main(command[6:]) if command.startswith("bench.") else MAINS[command]
    before = snapshot_before(ws)
    status = run_command(main, [arg.replace("{ws}", str(ws)) for arg in argv])
    err = capsys.readouterr().err
    after = snapshot_after(ws)
    assert status == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert message.replace("{ws}", str(ws)) in err, err
    assert after == before


def test_as_scripts_too(ws, tmp_path):
    """A few of the cases above as real processes, all at once: the `error:` line and the exit
    status come from the scripts' own entry points."""
    commands = [
        ["train.py", *train_args("--train.out_dir=/proc/picollama-run")],
        ["generate.py", "--run", "{ws}/hf_null_eps"],
        ["-m", "picollama.convert", "to-hf", "--run", "{ws}/run", "--out", "{ws}/run", "--force"],
        ["data/prepare.py", "--source", "{ws}/corpus", "--out", "/proc/picollama-data"],
        ["-m", "picollama.lab.bench.decode", "--positions", "16,abc", "--out", "{ws}/bench.json"],
    ]
    before = snapshot(ws)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PICOLLAMA_CACHE": str(tmp_path)}
    processes = [
        subprocess.Popen(
            [sys.executable, *(arg.replace("{ws}", str(ws)) for arg in command)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for command in commands
    ]
    for command, process in zip(commands, processes, strict=True):
        out, err = process.communicate(timeout=120)
        assert process.returncode == 2, (command, err)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert (
            len(errors) == 1 and err.rstrip("\n").endswith(errors[0]) and "Traceback" not in err
        ), (command, err)
    assert snapshot(ws) == before


# ---------------------------------------------------------------- non-file outputs, locks, signals


def test_outputs_that_are_not_files_are_refused_and_left_alone(ws, tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    make_device(tmp_path / "device")
    outputs = {
        tmp_path / "fifo": "a FIFO",
        tmp_path / "loop": "a symbolic link loop",
        tmp_path / "device": "it is a",
    }
    for path, kind in outputs.items():
        for argv in (
            ["to-gguf", "--run", str(ws / "run"), "--out", str(path), "--force"],
            ["to-hf", "--run", str(ws / "run"), "--out", str(path)],
        ):
            assert run_command(convert.main, argv) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"cannot write {path}: " in err and kind in err, err
        with pytest.raises(UserError, match=kind):
            with atomic_output(path) as tmp:
                tmp.write_text("never renamed over it")
    assert (
        stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode) and not (tmp_path / "device").is_file()
    )
    assert (tmp_path / "loop").is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == [
        "device",
        "fifo",
        "loop",
    ]


def test_force_replaces_what_picollama_wrote(ws, tmp_path, capsys):
    """--force replaces an export, an import, a GGUF file, an interrupted save (never a training
    run: test_rules_outputs.py)."""
    shutil.copytree(ws / "run", tmp_path / "imported")
    shutil.copytree(ws / "hf", tmp_path / "hf")
    (tmp_path / "hf" / ".model.safetensors.tmp-4242").write_bytes(b"half a save")
    for argv in (
        ["from-hf", "--hf-dir", str(ws / "hf"), "--out", str(tmp_path / "imported"), "--force"],
        ["to-hf", "--run", str(ws / "run"), "--out", str(tmp_path / "hf"), "--force"],
        ["to-gguf", "--run", str(ws / "run"), "--out", str(tmp_path / "m.gguf")],
        ["to-gguf", "--run", str(ws / "run"), "--out", str(tmp_path / "m.gguf"), "--force"],
    ):
        assert run_command(convert.main, argv) == 0, capsys.readouterr().err
    imported = sorted(p.name for p in (tmp_path / "imported").iterdir())
    # the export's files, with the tokenizer_config.json beside its tokenizer; none of the old run
    assert imported == [
        "config.json",
        "model.safetensors",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    assert not (tmp_path / "hf" / ".model.safetensors.tmp-4242").exists()


def test_a_second_prepare_into_one_out_waits_for_none(ws, tmp_path, capsys):
    """One writer: while a process holds --out, another prepare names it and writes nothing."""
    out = tmp_path / "data"
    with exclusive(out):
        assert (tmp_path / ".data.lock").read_text() == f"{os.getpid()}\n"
        assert run_command(prepare.main, ["--source", str(ws / "corpus"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"is in use by another process (pid {os.getpid()}" in err, err
    assert list(tmp_path.iterdir()) == []  # no output, and the lock file is gone with its holder


def test_a_swallowed_interrupt_still_ends_in_one_error_line(capsys):
    """Ctrl-C that lands in a __del__ is printed by Python as "Exception ignored" and swallowed: the
    command would exit 0. run_command still ends it with one `error:` line and status 130."""

    class Interrupting:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here, inside __del__

    def main(argv):
        Interrupting()
        return 0

    assert run_command(main, []) == 130
    err = capsys.readouterr().err
    assert err == "error: interrupted\n", err


def test_compile_without_a_compiler_is_refused_before_work(ws, capsys):
    import torch._inductor.config as inductor

    # inductor's own patch: a monkeypatched config entry reads as "does not exist" once restored
    with inductor.patch({"cpp.cxx": (None, "/no/such/g++")}):
        argv = [*train_args("--train.compile=true")]
        assert run_command(train.main, [arg.replace("{ws}", str(ws)) for arg in argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--compile needs a working C++ compiler" in err, err
        assert not (ws / "new").exists()
        args = generate.parser().parse_args(["--run", str(ws / "run"), "--compile"])
        with pytest.raises(UserError, match="--compile needs a working C\\+\\+ compiler"):
            generate.sample_command(args)
