"""Shared test helpers: a tiny dataset and trained run, one torch thread, bench mains in-process."""

import importlib
import importlib.util
import os

import numpy as np
import pytest
import torch

from data.build import prepare
from data.loader import RandomBatches
from model import ModelArgs, Transformer
from picollama.components import registry  # noqa: F401  (fills the tables: every variant)
from picollama.lab.bench.common import module_of
from picollama.run_files import save_model

TRAIN_LEN = 32
# The slowest files first, longest first (measured with compile caches cold): with
# `--dist loadfile --no-loadscope-reorder` each goes whole to one worker in this order, and the
# quick ones fill in at the end. xdist's own order (most tests first) left a 38 s file for last.
SLOWEST_FIRST = [
    "test_train.py",
    "test_inference.py",
    "test_real_models.py",
    "test_sft_smollm2.py",
    "test_study.py",
    "test_serve.py",
    "test_bench.py",
    "test_slots.py",
    "test_sft_train.py",
    "test_data.py",
    "test_cli_errors.py",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest in order


def write_corpus(directory, num_docs=12, words_per_doc=2500, seed=0):
    """Pseudo-English documents from a fixed random word list: learnable structure, no network."""
    rng = np.random.default_rng(seed)
    letters = list("etaoinshrdlucmfwypvbgk")
    words = ["".join(rng.choice(letters, size=rng.integers(2, 7))) for _ in range(150)]
    directory.mkdir()
    for doc in range(num_docs):
        picks = rng.zipf(1.3, size=words_per_doc) % len(words)
        lines = [
            " ".join(words[i] for i in picks[start : start + 12]) + "."
            for start in range(0, words_per_doc, 12)
        ]
        (directory / f"doc{doc:02d}.txt").write_text("\n".join(lines) + "\n")
    return directory


def build_tiny_run(root, steps=60, **model_args) -> tuple:
    """(run_dir, data_dir): a dataset prepared with data.prepare and a tiny model (ModelArgs changed
    by model_args) trained on it for a few steps."""
    data_dir = prepare(
        str(write_corpus(root / "corpus")), vocab_size=320, out_dir=root / "data", command=["test"]
    )
    torch.manual_seed(0)
    model = Transformer(
        ModelArgs(
            dim=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            vocab_size=320,
            max_seq_len=TRAIN_LEN,
            multiple_of=16,
            **model_args,
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = RandomBatches(data_dir, "train", batch_size=16, seq_len=TRAIN_LEN)
    for _ in range(steps):
        x, y = batches.next_batch()
        optimizer.zero_grad()
        model(x, y).backward()
        optimizer.step()
    run_dir = save_model(
        model.eval(),
        root / "run",
        {"data": {"dir": str(data_dir)}, "train": {"seq_len": TRAIN_LEN}},
        tokenizer=data_dir / "tokenizer.model",
    )
    return run_dir, data_dir


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads; on a busy 2-core machine two stall each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def make_tiny_run(tmp_path_factory):
    """make_tiny_run(steps, **model_args) -> (run_dir, data_dir), each in a fresh directory."""
    return lambda steps=60, **model_args: build_tiny_run(
        tmp_path_factory.mktemp("run"), steps, **model_args
    )


@pytest.fixture(scope="session")
def llama_cpp():
    """llama-cpp-python (the `llama` extra: compiled from source, so not in `dev`), or a skip saying
    how to install it. CI installs every extra, so there a missing module fails rather than skips: a
    skip never passes in CI."""
    try:
        return importlib.import_module("llama_cpp")
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail(
                "llama_cpp is not installed, and CI must run the llama.cpp checks: pip install -e "
                "'.[llama]'"
            )
        pytest.skip(
            "llama-cpp-python is not installed: pip install -e '.[llama]' runs the llama.cpp checks"
        )


@pytest.fixture
def bench_main():
    """A benchmark's main, imported in this process (running it would cost a torch import each)."""

    def load(name: str):
        return importlib.import_module(module_of(name)).main

    return load
