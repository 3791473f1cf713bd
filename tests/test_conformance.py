"""Every LLaMA config in configs/, each study run's too, found by non_llama: trained a few steps
at a tiny size with its architecture kept, exported with to-hf and to-gguf, read by transformers
and llama.cpp as we read it, and imported back to the same weights. The rest must be refused.

The retrieval task's runs have no tokenizer (token ids of their own), which both exports need:
their weights are checked through the Hugging Face mapping alone, and no GGUF is made."""

import itertools
import json
import random
import shutil
import tomllib
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import sentencepiece as spm
import torch
from conftest import write_corpus
from test_unigram import UNICODE, heldout_texts, without_byte_fallback

import train
from data import prepare
from model import ModelArgs, Transformer
from picollama.chat_template import read_tokenizer_config, render_chat, run_chat_template
from picollama.cli.command import run_command
from picollama.components.variants import non_llama
from picollama.config.model_args import checked_model_args
from picollama.config.training import Config, parse_cli
from picollama.convert import main as convert
from picollama.convert.hf import from_hf_state_dict, hf_config, to_hf_state_dict
from picollama.convert.spm_unigram import LLAMA_CPP_BYTE_FALLBACK, is_unigram
from picollama.lab.recipe import load_recipe
from picollama.lab.study import plan
from picollama.run_files import load_model, load_run, save_model
from picollama.sampling.decode import generate
from picollama.sampling.prompts import encode_prompt
from picollama.sampling.sampler import Sampling

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")
# The size each config shrinks to. Its architecture stays: the ratio of n_heads to n_kv_heads, the
# FFN's sizing keys, RoPE and its scaling, norms, activation, tying, the tokenizer's type.
SEQ = 32  # train.seq_len of a run trained from scratch, the context keys shrunk as much
HEADS = 4  # at most
HEAD_DIM = 16
LAYERS = 2  # at most
VOCAB = 320  # the tiny prepared datasets' (a retrieval task keeps its own)
STEPS = 12
# Configs that fine-tune another config's run (train.init_from) on conversations, by file name.
# A config missing here trains from scratch on the tiny text, as any other file does.
FINE_TUNES = {"sft": "small"}
# What the sft case's base run gets as its chat template, so that the one the exports carry is
# the conversations' own (the dataset's, then the run's), not the default written when missing.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Héllo 😀"},
    {"role": "assistant", "content": "the cat."},
    {"role": "user", "content": "and the dog?"},
]
# Known failures (measured), each case of one marked xfail(strict=True) with its cause: once
# fixed, the strict xfail fails, and its entry in HF_FAILURES or GGUF_FAILURES goes.
HF_SPELLED_PIECES = (
    "the unigram export's tokenizer.json (tokenizers' Unigram model) matches the spellings of "
    "control and byte pieces in text ('<s>' is id 1, '<0x41>' the byte 0x41), where "
    "sentencepiece and llama.cpp read them as the characters they are"
)


@dataclass
class Case:
    """One config (a file, or a run of a study recipe), as found in configs/."""

    name: str  # e.g. small, study/text:rope
    argv: list[str]  # train.py's arguments, but for the size and the output
    config: Config  # as written, unshrunk
    model: ModelArgs  # the run's model, the fine-tuned run's for a fine-tune
    source: str | None = None  # the case whose run this one fine-tunes
    recipe: Path | None = None  # a study run's recipe

    @property
    def text(self) -> bool:
        return self.config.data.task == "text"

    @property
    def away(self) -> list[str]:
        return non_llama(self.model)


def study_args(out: Path) -> SimpleNamespace:
    """The options of `generate.py study` that plan() reads: the full recipe, on the CPU."""
    return SimpleNamespace(out=out, quick=False, steps=None, seeds=1, device="cpu", dtype="float32")


def discover() -> dict[str, Case]:
    """Every config of configs/**/*.toml: a file, or each run of a study recipe (a file with
    [[runs]]), with the model it trains."""
    cases = {}
    root = REPO / "configs"
    for path in sorted(root.glob("**/*.toml")):
        name = path.relative_to(root).with_suffix("").as_posix()
        raw = tomllib.loads(path.read_text())
        if "runs" in raw:
            recipe = load_recipe(path)
            # plan() names the runs' folders there and writes nothing
            commands, configs = plan(recipe, study_args(REPO / "out" / "conformance-unused"))
            for run in recipe.runs:
                config = configs[run.name]
                source = run.source and f"{name}:{run.source}"
                argv = commands[run.name]
                cases[f"{name}:{run.name}"] = Case(
                    f"{name}:{run.name}", argv, config, config.model, source, path
                )
            continue
        argv = ["--config", str(path), "--device", "cpu", "--dtype", "float32"]
        config, _ = parse_cli(argv)
        model, source = config.model, FINE_TUNES.get(name)
        if source:  # train.init_from's model, with the context keys the config sets itself
            base, _ = parse_cli(["--config", str(root / f"{source}.toml")])
            model = replace(base.model, **raw.get("model", {}))
        cases[name] = Case(name, argv, config, model, source)
    return cases


CASES = discover()
LLAMA = [name for name, case in CASES.items() if not case.away]
TEXT = [name for name in LLAMA if CASES[name].text]


def tokenizer_type(case: Case) -> str:
    """bpe or unigram: a fine-tune's is its source's (its dataset is tokenized with that run's)."""
    return tokenizer_type(CASES[case.source]) if case.source else case.config.data.tokenizer_type


def known(names: list[str], failures: list) -> list:
    """names as parameters, a case of a known failure marked xfail(strict=True) naming the cause.

    failures: (whether a Case has it, its cause) pairs."""
    marked = []
    for name in names:
        causes = [cause for has, cause in failures if has(CASES[name])]
        marks = [pytest.mark.xfail(strict=True, reason=causes[0])] if causes else []
        marked.append(pytest.param(name, marks=marks))
    return marked


HF_FAILURES = [(lambda case: tokenizer_type(case) == "unigram", HF_SPELLED_PIECES)]
GGUF_FAILURES = []  # to-gguf exports every LLaMA config's RoPE scaling, YaRN's too


def test_the_configs_the_issue_names_are_llama():
    """The issue's list: a switch added to one of these leaves the conformance tests without it."""
    named = ["default", "cpu-10min", "small", "base", "llama-1b", "retrieval", "sft"]
    named += ["study/text:rope", "study/retrieval:rope"]
    assert [name for name in named if name not in LLAMA] == []
    assert set(TEXT) >= set(named) - {"retrieval", "study/retrieval:rope"}
    assert {tokenizer_type(CASES[name]) for name in TEXT} == {"bpe", "unigram"}


# ---------------------------------------------------------------- tiny runs of the configs


def shrink_factor(case: Case) -> int:
    """How many times shorter the context gets: a fine-tune's as its source's. A window keeps
    room for the copy data's span and its copies."""
    if case.source:
        return shrink_factor(CASES[case.source])
    data = case.config.data
    copies = data.copy_span * (data.copy_repeats + 1) - 1 if data.copy_fraction else 0
    return max(1, case.config.train.seq_len // max(SEQ, copies))


def tiny_model(case: Case) -> dict:
    """The model keys that shrink the case: its context, and but for a fine-tune (whose model is
    its source run's) its width, depth and vocabulary. Heads keep their ratio to KV heads."""
    m, k = case.config.model, shrink_factor(case)
    keys = {"max_seq_len": m.max_seq_len // k}
    if m.rope_original_max_seq_len:
        keys["rope_original_max_seq_len"] = m.rope_original_max_seq_len // k
    if not case.source:
        ratio = m.n_heads // m.n_kv_heads
        kv = max(1, min(m.n_kv_heads, HEADS // ratio))
        dim = kv * ratio * HEAD_DIM
        keys |= {"dim": dim, "n_heads": kv * ratio, "n_kv_heads": kv}
        keys["n_layers"] = min(m.n_layers, LAYERS)
        if m.ffn_hidden_dim:
            keys["ffn_hidden_dim"] = m.ffn_hidden_dim * dim // m.dim
        if case.text:
            keys["vocab_size"] = VOCAB
    return keys


def tiny_flags(case: Case) -> list[str]:
    """train.py's flags that shrink the case's size and training, keeping its architecture."""
    cfg = case.config
    flags = {f"model.{key}": value for key, value in tiny_model(case).items()}
    flags |= {
        "train.seq_len": cfg.train.seq_len // shrink_factor(case),
        "train.max_steps": STEPS,
        "train.batch_size": 4 * cfg.train.grad_accum,
        "train.log_interval": STEPS,
        "train.sample_tokens": 0,
        "train.early_stop": 0,  # sft.toml's compares evaluations, and these runs evaluate once
        "train.compile": False,
        "optim.warmup_steps": min(cfg.optim.warmup_steps, 2),
        "eval.interval": 0,
        "eval.batches": 2,
        "eval.batch_size": 4,
        "eval.interim_batches": 0,
        "checkpoint.interval": 0,
        "wandb.enabled": False,
    }
    return [
        f"--{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, value in flags.items()
    ]


def chats_jsonl(path: Path) -> Path:
    """200 conversations of word salad, some with a system message, some of two turns."""
    rng = random.Random(0)
    words = "the cat sat on a mat and dog ran far away from home héllo 😀 日本".split()

    def salad():
        return " ".join(rng.choices(words, k=rng.randint(2, 8)))

    lines = []
    for i in range(200):
        chat = [{"role": "system", "content": salad()}] if i % 4 == 0 else []
        for _ in range(1 + i % 2):
            chat += [
                {"role": "user", "content": salad()},
                {"role": "assistant", "content": salad()},
            ]
        lines.append(json.dumps({"messages": chat}) + "\n")
    path.write_text("".join(lines))
    return path


class Runs:
    """Each case's tiny run, trained on first use by train.py in this process, and its exports."""

    def __init__(self, root: Path):
        self.root = root
        corpus = write_corpus(root / "corpus", num_docs=6, words_per_doc=1500)
        self.data = {}
        for kind in ("bpe", "unigram"):
            argv = ["--source", str(corpus), "--vocab-size", str(VOCAB)]
            argv += ["--tokenizer-type", kind, "--out", str(root / kind)]
            assert run_command(prepare.main, argv) == 0
            self.data[kind] = root / kind
        self.runs, self.exports = {}, {}

    def folder(self, case: Case) -> Path:
        """Where a case's files go: a study run's where its recipe's `from` finds it."""
        if case.recipe:
            recipe, _, run = case.name.partition(":")
            return self.root / recipe.replace("/", "-") / run
        return self.root / case.name

    def dataset(self, case: Case) -> Path:
        """The case's tiny dataset: conversations for a fine-tune on them, else text."""
        if case.name in FINE_TUNES:  # chats tokenized with the base run's tokenizer
            base = self.folder(case).with_name(f"{case.name}-base")
            shutil.copytree(self.run(case.source), base)
            config = read_tokenizer_config(base / "tokenizer_config.json")
            text = json.dumps(config | {"chat_template": CHAT_TEMPLATE}, indent=2)
            (base / "tokenizer_config.json").write_text(text)
            chats = chats_jsonl(self.folder(case).with_name(f"{case.name}-chats.jsonl"))
            out = self.folder(case).with_name(f"{case.name}-data")
            argv = ["--source", str(chats), "--tokenizer", str(base), "--out", str(out)]
            # the fine-tune's rows (its train.seq_len) are longer than the base run's context
            argv += ["--context", str(case.config.train.seq_len // shrink_factor(case))]
            assert run_command(prepare.main, argv) == 0
            return out
        return self.data[tokenizer_type(case)]

    def run(self, name: str) -> Path:
        if name not in self.runs:
            case = CASES[name]
            argv, out = list(case.argv), self.folder(case)
            out.parent.mkdir(parents=True, exist_ok=True)
            if case.recipe:  # the study's own command, its from's run in place
                if case.source:
                    self.run(case.source)
                commands, _ = plan(load_recipe(case.recipe), study_args(out.parent))
                argv = commands[name.partition(":")[2]]
            else:
                argv.append(f"--train.out_dir={out}")
                if case.source:
                    argv.append(f"--train.init_from={self.run(case.source)}")
            if case.text:
                argv.append(f"--data.dir={self.dataset(case)}")
            assert run_command(train.main, [*argv, *tiny_flags(case)]) == 0
            self.runs[name] = out
        return self.runs[name]

    def export(self, name: str, command: str) -> tuple[int, Path]:
        """(exit status, output) of `convert to-hf` or `to-gguf` (f32) of the case's run."""
        if (name, command) not in self.exports:
            run = self.run(name)
            out = run.with_name(f"{run.name}.gguf" if command == "to-gguf" else f"{run.name}-hf")
            argv = [command, "--run", str(run), "--out", str(out)]
            self.exports[name, command] = run_command(convert.main, argv), out
        return self.exports[name, command]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("conformance"))


def our_tokenizer(run: Path):
    return spm.SentencePieceProcessor(model_file=str(run / "tokenizer.model"))


def val_shards(data: Path) -> list[Path]:
    """The held-out split's token shards (not a conversations dataset's loss masks beside them)."""
    return [f for f in sorted(data.glob("val-*.bin")) if not f.name.endswith(".mask.bin")]


def run_data(run: Path) -> Path:
    return Path(json.loads((run / "config.json").read_text())["data"]["dir"])


def heldout_rows(run: Path, count: int = 3) -> torch.Tensor:
    """`count` rows of the held-out split, as long as the model's context."""
    data, length = run_data(run), load_model(run)[0].args.max_seq_len
    dtype = json.loads((data / "meta.json").read_text())["dtype"]
    ids = np.concatenate([np.fromfile(f, dtype=dtype) for f in val_shards(data)])
    assert len(ids) >= count * length
    return torch.from_numpy(ids[: count * length].astype(np.int64)).view(count, length)


def texts(run: Path) -> list[str]:
    """The held-out split's text, then the Unicode set. Text in pieces of UNIGRAM_CHUNK
    characters (test_unigram.heldout_texts), conversations as each decodes."""
    data = run_data(run)
    meta = json.loads((data / "meta.json").read_text())
    heldout = heldout_texts(data) if meta.get("kind") != "conversations" else []
    if meta.get("kind") == "conversations":
        sp = our_tokenizer(run)
        for shard in val_shards(data):
            ids = np.fromfile(shard, dtype=meta["dtype"]).tolist()
            starts = np.load(shard.with_suffix(".docs.npy")).tolist()
            heldout += [sp.decode(ids[a:b]) for a, b in zip(starts, [*starts[1:], len(ids)])]
    assert len(heldout) > 1 and sum(map(len, heldout)) > 500
    return [*heldout, *UNICODE]


def spells_a_piece(sp, text: str) -> bool:
    """Whether text spells a control, unknown or byte piece (<s>, <unk>, <0x41>)."""
    special = (sp.is_control, sp.is_unknown, sp.is_byte)
    return any(any(is_(i) for is_ in special) and sp.id_to_piece(i) in text for i in range(len(sp)))


def same_weights(back: Path, run: Path, precision=float):
    """back's model is run's: every tensor equal, and the architecture (FFN sizing aside), its
    numbers as precise as `precision` (GGUF's metadata keeps them in float32)."""
    ours, theirs = load_model(run)[0], load_model(back)[0]
    state = theirs.state_dict()
    assert sorted(state) == sorted(ours.state_dict())
    for key, value in ours.state_dict().items():
        assert torch.equal(state[key], value), key
    sizing = ("multiple_of", "ffn_dim_multiplier", "ffn_hidden_dim")
    assert theirs.args.hidden_dim == ours.args.hidden_dim
    for key, value in ours.args.to_dict().items():
        if key == "rope_original_max_seq_len" and ours.args.rope_scaling == "none":
            continue  # what a RoPE scaling stretches from: read by none here (a fine-tune sets it)
        if isinstance(value, float):
            assert precision(getattr(theirs.args, key)) == precision(value), key
        else:
            assert key in sizing or getattr(theirs.args, key) == value, key


# ---------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("name", TEXT)
def test_to_hf_loads_in_transformers_with_our_logits_and_template(runs, name):
    transformers = pytest.importorskip("transformers")
    run = runs.run(name)
    status, hf = runs.export(name, "to-hf")
    assert status == 0
    model, _, tokenizer = load_run(run, "cpu", torch.float32)
    theirs = transformers.LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    rows = heldout_rows(run)
    with torch.no_grad():
        error = (theirs(rows).logits - model(rows)).abs().max().item()
    assert error <= 1e-4, error
    template = run_chat_template(run)
    assert template is not None  # every text run has one: its dataset's, else the default
    if name in FINE_TUNES:  # the conversations' template, through their dataset
        assert template == CHAT_TEMPLATE
    assert json.loads((hf / "tokenizer_config.json").read_text())["chat_template"] == template
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    rendered = hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == render_chat(template, CHAT, tokenizer)


def hf_tokenizers(runs, name: str):
    """(run, our tokenizer, the HF export's tokenizer), special tokens not parsed from text."""
    transformers = pytest.importorskip("transformers")
    run = runs.run(name)
    theirs = transformers.AutoTokenizer.from_pretrained(
        runs.export(name, "to-hf")[1], split_special_tokens=True
    )
    return run, our_tokenizer(run), theirs


@pytest.mark.parametrize("name", TEXT)
def test_hf_tokenizer_encodes_as_ours(runs, name):
    """On the held-out split and the Unicode set, plain text (special tokens not parsed)."""
    run, sp, theirs = hf_tokenizers(runs, name)
    differ = []
    for text in texts(run):
        if not spells_a_piece(sp, text):
            ours = [sp.bos_id(), *sp.encode(text)]
            differ += [text] if theirs(text).input_ids != ours else []
    assert differ == []


@pytest.mark.parametrize("name", known(TEXT, HF_FAILURES))
def test_hf_tokenizer_reads_spelled_pieces_as_text(runs, name):
    """Text that spells <s> or <0x41> is those characters, as in sentencepiece."""
    run, sp, theirs = hf_tokenizers(runs, name)
    spelled = [text for text in texts(run) if spells_a_piece(sp, text)]
    assert spelled
    for text in spelled:
        assert theirs(text).input_ids == [sp.bos_id(), *sp.encode(text)], text


@pytest.mark.parametrize("name", TEXT)
def test_from_hf_gives_back_the_same_run(runs, name, tmp_path):
    run = runs.run(name)
    status, hf = runs.export(name, "to-hf")
    assert status == 0
    argv = ["from-hf", "--hf-dir", str(hf), "--out", str(tmp_path / "back")]
    assert run_command(convert.main, argv) == 0
    same_weights(tmp_path / "back", run)
    assert run_chat_template(tmp_path / "back") == run_chat_template(run)


@pytest.mark.parametrize("name", [name for name in LLAMA if name not in TEXT])
def test_a_run_without_a_tokenizer_maps_to_hf_llama_and_back(runs, name, capsys):
    """The retrieval task's runs: token ids of their own, no text, so no tokenizer. to-hf and
    to-gguf both need one, and say so in one line. The weights and config map as any run's do:
    transformers computes our logits from them, and from_hf_state_dict gives them back."""
    transformers = pytest.importorskip("transformers")
    run = runs.run(name)
    for command in ("to-hf", "to-gguf"):
        capsys.readouterr()
        status, out = runs.export(name, command)
        err = capsys.readouterr().err
        assert status == 2 and not out.exists()
        assert err.startswith("error: ") and err.count("\n") == 1
        assert "has no tokenizer.model or tokenizer.json" in err
    model, _ = load_model(run)
    config = hf_config(model.args)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    missing, unexpected = theirs.load_state_dict(to_hf_state_dict(model), strict=False)
    assert not unexpected and set(missing) <= (
        {"lm_head.weight"} if model.args.tie_embeddings else set()
    )
    rows = torch.randint(0, model.args.vocab_size, (3, model.args.max_seq_len))
    with torch.no_grad():
        error = (theirs(rows).logits - model(rows)).abs().max().item()
    assert error <= 1e-4, error
    back = from_hf_state_dict(to_hf_state_dict(model), config)
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


# ---------------------------------------------------------------- llama.cpp


@pytest.mark.parametrize("name", known(TEXT, GGUF_FAILURES))
def test_to_gguf_tokenizes_as_ours_in_llama_cpp_and_keeps_the_template(runs, name, llama_cpp):
    """Equal ids on the held-out split and the Unicode set, but that a unigram vocabulary gives
    one <unk> where sentencepiece gives the bytes of characters no piece covers
    (LLAMA_CPP_BYTE_FALLBACK, as tests/test_unigram.py says)."""
    gguf = pytest.importorskip("gguf")
    run = runs.run(name)
    status, path = runs.export(name, "to-gguf")
    assert status == 0
    sp = our_tokenizer(run)
    expected = without_byte_fallback if is_unigram(sp) else lambda sp, ids: ids
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    with closing(llm):
        for text in texts(run):
            ours = [sp.bos_id(), *sp.encode(text)]
            theirs = llm.tokenize(text.encode(), add_bos=True, special=False)
            assert theirs == expected(sp, ours), (text, LLAMA_CPP_BYTE_FALLBACK)
    field = gguf.GGUFReader(path).fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == run_chat_template(run)


@pytest.mark.parametrize("name", known(TEXT, GGUF_FAILURES))
def test_gguf_continues_like_generate_in_llama_cpp(runs, name, llama_cpp):
    """Greedy decoding to the context's end in f32, llama.cpp's attention and cache in f32 too:
    the same tokens, the same text, and at every step (the prompt in a batch, then one token at a
    time on its cache) logits within 1e-5 of their range. These tiny runs' greedy text mostly
    repeats a token: the logits are the stronger check."""
    pytest.importorskip("gguf")
    run = runs.run(name)
    status, path = runs.export(name, "to-gguf")
    assert status == 0
    model, _, tokenizer = load_run(run, "cpu", torch.float32)
    text = tokenizer.decode(heldout_rows(run, 1)[0, 1:9].tolist())
    f32 = llama_cpp.GGML_TYPE_F32
    options = dict(type_k=f32, type_v=f32, flash_attn=False, logits_all=True, verbose=False)
    llm = llama_cpp.Llama(str(path), n_ctx=model.args.max_seq_len, n_threads=1, **options)
    with closing(llm):
        prompt = llm.tokenize(text.encode(), add_bos=True)
        assert prompt == encode_prompt(tokenizer, text)
        length = model.args.max_seq_len - len(prompt)
        ours = generate(model, [prompt], Sampling(length, temperature=0))[0]
        theirs = list(itertools.islice(llm.generate(prompt, temp=0.0), length))
        assert theirs == ours
        assert llm.detokenize(theirs).decode() == tokenizer.decode(ours)
        tokens = prompt + ours[:-1]  # what llama.cpp evaluated: all but the last token
        assert llm.n_tokens == len(tokens)
        logits = torch.tensor(llm.scores[: len(tokens)])
    with torch.no_grad():
        expected = model(torch.tensor([tokens]))[0]
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("name", known(TEXT, GGUF_FAILURES))
def test_from_gguf_gives_back_the_same_run(runs, name, tmp_path):
    pytest.importorskip("gguf")
    run = runs.run(name)
    status, path = runs.export(name, "to-gguf")
    assert status == 0
    argv = ["from-gguf", "--gguf", str(path), "--out", str(tmp_path / "back")]
    assert run_command(convert.main, argv) == 0
    same_weights(tmp_path / "back", run, np.float32)
    assert run_chat_template(tmp_path / "back") == run_chat_template(run)
    ours, theirs = our_tokenizer(run), our_tokenizer(tmp_path / "back")
    for text in UNICODE:
        assert theirs.encode(text) == ours.encode(text), text


# ---------------------------------------------------------------- the rest: refused


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.away])
def test_a_non_llama_config_is_refused_in_one_line_naming_its_key(runs, name, tmp_path, capsys):
    """A switch off LLaMA's architecture: to-hf and to-gguf each say so in one error line naming
    the key, and write nothing. Untrained: the refusal reads the config alone."""
    case = CASES[name]
    keys = tiny_model(case)
    if case.source:  # its model is its source's, shrunk as that is, but for the context
        keys = tiny_model(CASES[case.source]) | keys
    model = checked_model_args(**(case.model.to_dict() | keys))
    assert non_llama(model) == case.away
    torch.manual_seed(0)
    data = runs.data[tokenizer_type(case)]
    run = save_model(
        Transformer(model).eval(),
        tmp_path / "run",
        tokenizer=data / "tokenizer.model" if case.text else None,
    )
    for command, out in (("to-hf", tmp_path / "hf"), ("to-gguf", tmp_path / "m.gguf")):
        argv = [command, "--run", str(run), "--out", str(out)]
        capsys.readouterr()
        assert run_command(convert.main, argv) == 2
        out_text, err = capsys.readouterr()
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert f"model.{case.away[0]} = " in err and "cannot be exported" in err
        assert out_text == "" and not out.exists()
