"""Unigram tokenizers (--tokenizer-type unigram): prepared, exported to Hugging Face encoding as
sentencepiece does (transformers the oracle), refused for GGUF, chosen by train.py's config."""

import json

import pytest
import sentencepiece as spm
import torch
from conftest import write_corpus
from sentencepiece import sentencepiece_model_pb2 as pb

import train
from data import prepare
from data.build import prepare as build
from data.sources import default_name
from model import ModelArgs, Transformer
from picollama.cli.command import run_command
from picollama.config.training import parse_cli
from picollama.convert import main as convert
from picollama.run_files import load_model, save_model
from picollama.training.dataset import check_dataset

# text the tokenizer never saw: other letters, spaces, tabs, line breaks, bytes no piece covers
TEXTS = [
    "hello world.\nthe next line",
    "  two  spaces\n\n\ttab, then a trailing space ",
    "Héllo ✓ 123 😀 日本語",
]


@pytest.fixture(scope="module")
def unigram_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("unigram")
    corpus = write_corpus(root / "corpus")
    data = build(str(corpus), 320, root / "data", command=["test"], tokenizer_type="unigram")
    return data


@pytest.fixture(scope="module")
def unigram_run(unigram_data):
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=320, max_seq_len=32)
    config = {"data": {"dir": str(unigram_data)}, "train": {"seq_len": 32}}
    tokenizer = unigram_data / "tokenizer.model"
    return save_model(Transformer(args).eval(), unigram_data.parent / "run", config, tokenizer)


def test_prepare_trains_a_unigram_tokenizer_that_round_trips_and_records_it(unigram_data):
    proto = pb.ModelProto.FromString((unigram_data / "tokenizer.model").read_bytes())
    assert proto.trainer_spec.model_type == pb.TrainerSpec.UNIGRAM
    assert proto.trainer_spec.byte_fallback
    pieces = [piece.piece for piece in proto.pieces]
    assert ".\n" in pieces  # trained on text that keeps its line breaks
    meta = json.loads((unigram_data / "meta.json").read_text())
    assert meta["inputs"]["tokenizer_type"] == "unigram" and meta["vocab_size"] == 320
    sp = spm.SentencePieceProcessor(model_file=str(unigram_data / "tokenizer.model"))
    for text in TEXTS:
        assert sp.decode(sp.encode(text)) == text


def test_a_bpe_dataset_is_not_taken_for_a_unigram_one(unigram_data, capsys):
    """The same source and out, another type: not reused as prepared (--force to rebuild)."""
    corpus = unigram_data.parent / "corpus"
    argv = ["--source", str(corpus), "--vocab-size", "320", "--out", str(unigram_data)]
    assert run_command(prepare.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "--force" in err
    assert "already prepared" not in capsys.readouterr().out


def test_to_hf_encodes_as_sentencepiece_in_transformers(unigram_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert run_command(convert.main, ["to-hf", "--run", str(unigram_run), "--out", str(out)]) == 0
    sp = spm.SentencePieceProcessor(model_file=str(unigram_run / "tokenizer.model"))
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    corpus = next((unigram_run.parent / "corpus").glob("*.txt")).read_text()[:3000]
    for text in [*TEXTS, corpus]:
        ids = theirs(text).input_ids
        assert ids == [sp.bos_id(), *sp.encode(text)]
        assert theirs.decode(ids, skip_special_tokens=True) == text


def test_to_gguf_refuses_a_unigram_tokenizer_writing_nothing(unigram_run, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    argv = ["to-gguf", "--run", str(unigram_run), "--out", str(out)]
    assert run_command(convert.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: to-gguf takes BPE sentencepiece") and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_the_decode_bench_leaves_llama_cpp_out_for_a_unigram_run(unigram_run, tmp_path, llama_cpp):
    from picollama.lab.bench.llama_cpp_runner import llama_cpp_decoders

    model, _ = load_model(unigram_run)
    tokenizer = spm.SentencePieceProcessor(model_file=str(unigram_run / "tokenizer.model"))
    decoders, why = llama_cpp_decoders(model, tokenizer, 32, tmp_path)
    assert decoders == {} and why.startswith("a unigram tokenizer, which to-gguf refuses")
    assert not list(tmp_path.iterdir())


def test_train_prepares_its_data_with_the_configured_type(tmp_path, one_thread):
    corpus = write_corpus(tmp_path / "corpus", num_docs=4, words_per_doc=600)
    data = tmp_path / "data"
    flags = {
        "data.source": corpus,
        "data.dir": data,
        "data.tokenizer_type": "unigram",
        "train.out_dir": tmp_path / "run",
        "model.vocab_size": 320,
        "model.dim": 32,
        "model.n_layers": 1,
        "model.n_heads": 2,
        "train.seq_len": 32,
        "train.batch_size": 2,
        "train.max_steps": 1,
        "train.sample_tokens": 0,
        "eval.batches": 1,
    }
    argv = [f"--{key}={value}" for key, value in flags.items()]
    assert run_command(train.main, [*argv, "--no-compile"]) == 0
    proto = pb.ModelProto.FromString((data / "tokenizer.model").read_bytes())
    assert proto.trainer_spec.model_type == pb.TrainerSpec.UNIGRAM


def test_the_default_config_prepares_its_unigram_shakespeare_in_its_own_folder(
    tmp_path, monkeypatch
):
    """configs/default.toml names the folder data/prepare.py --tokenizer-type unigram writes
    Shakespeare to, which train.py prepares when missing."""
    monkeypatch.chdir(tmp_path)
    cfg, _ = parse_cli([])
    assert (cfg.data.dir, cfg.data.tokenizer_type) == ("data/shakespeare-unigram", "unigram")
    assert f"data/{default_name(cfg.data.source, 'unigram')}" == cfg.data.dir
    check_dataset(cfg)  # no error: missing, and prepared by train.py


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokenizer-type", "wordpiece"], "invalid choice: 'wordpiece'"),
        (["--tokenizer-type", "unigram", "--tokenizer", "x.model"], "were both given"),
    ],
)
def test_prepare_refuses_a_bad_type_in_one_line(tmp_path, capsys, argv, message):
    argv = [*argv, "--source", str(tmp_path), "--out", str(tmp_path / "out")]
    assert run_command(prepare.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "out").exists()
