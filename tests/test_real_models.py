"""Real models in: tokenizer.json runs, `convert from-gguf` checked against llama.cpp (token ids,
greedy tokens) and transformers (logits), its refusals, and the SmolLM2 GGUF where it is given."""

import io
import itertools
import json
import os
from contextlib import closing, contextmanager, nullcontext
from pathlib import Path

import pytest
import torch

from data.tokenizer import HFTokenizer
from model import ModelArgs, Transformer
from picollama.cli.command import run_command
from picollama.convert import hf as hf_format
from picollama.convert import main as convert
from picollama.convert import to_gguf as gguf_export
from picollama.run_files import load_model, load_run
from picollama.sampling.decode import generate
from picollama.sampling.prompts import TextStream, encode_prompt
from picollama.sampling.sampler import Sampling

TEXTS = [
    "Héllo wörld, ça va? Ñandú über naïve café",
    "中文字符和日本語のテキスト 한국어",
    "emoji 🤗🚀👍🏽 and a family 👨‍👩‍👧",
    "def f(x):\n    return x**2  # square\n\n\tif a != b: pass",
    "runs   of    spaces\n\n\n  and\r\n newlines \n",
    "numbers 12345 and 3.14159, 1,000,000",
    " leading space and trailing  ",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = "<|im_start|>user\nhi there<|im_end|>\n"
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, multiple_of=32)


def convert_main(argv: list[str]) -> int:
    return run_command(convert.main, [str(a) for a in argv])


def train_bpe(folder: Path, pre: str) -> Path:
    """A tiny byte-level BPE tokenizer.json (GPT-2's split, or SmolLM's digits first) with
    tokenizer_config.json, trained with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    digits = pre_tokenizers.Digits(individual_digits=True)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([digits, split]) if pre == "smollm" else split
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS * 30 + ["the quick brown fox jumps over it"] * 30, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = dict(bos_token=SPECIAL[1], eos_token=SPECIAL[2], unk_token=SPECIAL[0])
    config |= dict(add_bos_token=False, chat_template="{{ messages }}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def train_spm(folder: Path) -> Path:
    """A tiny sentencepiece BPE with a dummy prefix and byte fallback, like Llama 2's."""
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 30),
        model_prefix=str(folder / "tokenizer"),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=0.98,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    return folder / "tokenizer.model"


def write_tiny_gguf(tokenizer_file: Path, out: Path, type_="f32", seed=0, **model_args) -> Path:
    """A random tiny Llama with this tokenizer as a GGUF file of weight type `type_`."""
    tokenizer = HFTokenizer(tokenizer_file) if tokenizer_file.suffix == ".json" else None
    if tokenizer is None:
        from picollama.run_files import read_tokenizer

        tokenizer = read_tokenizer(tokenizer_file)
    torch.manual_seed(seed)
    args = ModelArgs(**TINY | dict(vocab_size=tokenizer.get_piece_size() + 3) | model_args)
    model = Transformer(args).eval()
    gguf_export.write_gguf(model, tokenizer, out, type_, "tiny")
    return out


@pytest.fixture(scope="module")
def bpe_ggufs(tmp_path_factory):
    """{pre: (tokenizer.json, GGUF file)} for GPT-2's and SmolLM's pre-tokenizer."""
    root = tmp_path_factory.mktemp("bpe")
    found = {}
    for pre in ("gpt2", "smollm"):
        tokenizer = train_bpe(root / pre, pre)
        found[pre] = tokenizer, write_tiny_gguf(tokenizer, root / f"{pre}.gguf")
    return found


def llama_cpp_ids(llama_cpp, gguf: Path, texts: list[str], special: bool) -> list[list[int]]:
    """llama.cpp's token ids of each text (no BOS), the GGUF's vocabulary read once."""
    with closing(llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)) as llm:
        return [llm.tokenize(text.encode(), add_bos=False, special=special) for text in texts]


@pytest.mark.parametrize("pre", ["gpt2", "smollm"])
def test_bpe_gguf_import_tokenizes_like_llama_cpp(bpe_ggufs, pre, tmp_path, llama_cpp):
    source, gguf = bpe_ggufs[pre]
    assert convert_main(["from-gguf", "--gguf", gguf, "--out", tmp_path / "run"]) == 0
    _, _, tokenizer = load_run(tmp_path / "run", "cpu", torch.float32)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.get_piece_size() == 423  # [PADn] rows
    original = HFTokenizer(source)
    theirs = llama_cpp_ids(llama_cpp, gguf, [*TEXTS, CHAT], special=True)
    for text, expected in zip([*TEXTS, CHAT], theirs, strict=True):
        ids = tokenizer.encode(text)
        assert ids == expected, text
        shown = text.replace(SPECIAL[1], "").replace(SPECIAL[2], "")  # decode skips specials
        assert ids == original.encode(text) and tokenizer.decode(ids) == shown
    assert (tokenizer.bos_id(), tokenizer.eos_id(), tokenizer.add_bos) == (1, 2, False)
    config = json.loads((tmp_path / "run" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == "{{ messages }}"


def test_spm_gguf_import_tokenizes_like_llama_cpp(tmp_path, llama_cpp):
    import sentencepiece as spm

    source = train_spm(tmp_path / "spm")
    gguf = write_tiny_gguf(source, tmp_path / "spm.gguf")
    assert convert_main(["from-gguf", "--gguf", gguf, "--out", tmp_path / "run"]) == 0
    _, _, tokenizer = load_run(tmp_path / "run", "cpu", torch.float32)
    original = spm.SentencePieceProcessor(model_file=str(source))
    for text, expected in zip(TEXTS, llama_cpp_ids(llama_cpp, gguf, TEXTS, False), strict=True):
        ids = tokenizer.encode(text)
        assert ids == expected, text
        assert ids == original.encode(text) and tokenizer.decode(ids) == text
    assert encode_prompt(tokenizer, "a")[0] == tokenizer.bos_id() >= 0
    config = tmp_path / "run" / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"add_bos_token": False}))
    _, _, tokenizer = load_run(tmp_path / "run", "cpu", torch.float32)
    assert encode_prompt(tokenizer, "a") == tokenizer.encode("a")  # as the file says: no BOS
    # and so it is exported: llama.cpp and transformers start prompts without BOS too
    assert convert_main(["to-gguf", "--run", tmp_path / "run", "--out", tmp_path / "m.gguf"]) == 0
    with closing(llama_cpp.Llama(str(tmp_path / "m.gguf"), vocab_only=True, verbose=False)) as llm:
        assert llm.tokenize(b"a", add_bos=True) == tokenizer.encode("a")
    transformers = pytest.importorskip("transformers")
    assert convert_main(["to-hf", "--run", tmp_path / "run", "--out", tmp_path / "hf"]) == 0
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tokenizer("a b").input_ids == tokenizer.encode("a b")


QUANTS = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]


@pytest.mark.parametrize("type_", QUANTS)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_import_logits_match_transformers(bpe_ggufs, type_, tied, tmp_path, one_thread):
    pytest.importorskip("transformers")
    tokenizer, _ = bpe_ggufs["gpt2"]
    gguf = write_tiny_gguf(tokenizer, tmp_path / "m.gguf", type_, tie_embeddings=tied)
    assert convert_main(["from-gguf", "--gguf", gguf, "--out", tmp_path / "run"]) == 0
    model, _ = load_model(tmp_path / "run")
    assert model.args.tie_embeddings == tied and model.args.n_kv_heads == 2
    theirs = transformers_from_gguf(gguf)
    tokens = torch.randint(0, 420, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, reference = model(tokens)[0], theirs(tokens).logits[0]
    assert (ours - reference).abs().max() <= 1e-4 * reference.abs().max()


def skipped_init():
    """transformers' no_init_weights where it has one (5.x; ~1.5 s of SmolLM2's random init),
    else nothing skipped."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return nullcontext()
    return no_init_weights()


def transformers_from_gguf(path: Path):
    """LlamaForCausalLM (fp32) holding transformers' reading of a GGUF file (its wq/wk rows permuted
    back to rotate-half); from_pretrained(gguf_file=) would need accelerate as well."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(str(path))["config"]
    config.pop("_model_name_or_path", None)
    with skipped_init():  # every weight is loaded below (strict), so none is drawn at random
        model = LlamaForCausalLM(LlamaConfig(**config))
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    if config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    return model.eval()


def random_blocks_gguf(path: Path, tokenizer_file: Path, kind: str) -> Path:
    """A one-layer Llama (dim 256, GQA) whose matrices are random blocks of GGUF type `kind`,
    written as raw bytes (gguf quantizes few types): bytes below 64 keep every scale finite."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    writer.add_block_count(1)
    writer.add_feed_forward_length(256)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    gguf_export.add_gguf_vocab(writer, HFTokenizer(tokenizer_file), 512, gguf)
    shapes = {"token_embd": (512, 256), "output": (512, 256), "blk.0.attn_q": (256, 256)}
    shapes |= {"blk.0.attn_k": (128, 256), "blk.0.attn_v": (128, 256)}
    for name in ("attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        shapes[f"blk.0.{name}"] = (256, 256)
    for name, (rows, cols) in shapes.items():
        raw = rng.integers(0, 64, (rows, cols // block * size), dtype=np.uint8)
        writer.add_tensor(f"{name}.weight", raw, raw_dtype=qtype)
    for name in ("output_norm", "blk.0.attn_norm", "blk.0.ffn_norm"):
        writer.add_tensor(f"{name}.weight", np.ones(256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kind", [t.name for t in __import__("gguf").quants._type_traits])
def test_every_type_gguf_dequantizes_imports_like_transformers(bpe_ggufs, kind, tmp_path):
    pytest.importorskip("transformers")
    gguf = random_blocks_gguf(tmp_path / "m.gguf", bpe_ggufs["gpt2"][0], kind)
    assert convert_main(["from-gguf", "--gguf", gguf, "--out", tmp_path / "run"]) == 0
    model, _ = load_model(tmp_path / "run")
    tokens = torch.randint(0, 420, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, reference = model(tokens)[0], transformers_from_gguf(gguf)(tokens).logits[0]
    assert (ours - reference).abs().max() <= 1e-4 * reference.abs().max()


@pytest.fixture(scope="module")
def trained(make_tiny_run, one_thread):
    return make_tiny_run()[0]


@pytest.mark.parametrize("type_", ["f32", "f16"])
def test_greedy_tokens_match_llama_cpp(trained, type_, tmp_path, llama_cpp, one_thread):
    gguf = tmp_path / "m.gguf"
    assert convert_main(["to-gguf", "--run", trained, "--out", gguf, "--type", type_]) == 0
    assert convert_main(["from-gguf", "--gguf", gguf, "--out", tmp_path / "run"]) == 0
    model, _, tokenizer = load_run(tmp_path / "run", "cpu", torch.float32)
    prompt = encode_prompt(tokenizer, "ab cd")
    ours = generate(model, [prompt], Sampling(24, temperature=0))[0]
    with closing(llama_cpp.Llama(str(gguf), n_ctx=32, n_threads=1, verbose=False)) as llm:
        assert list(itertools.islice(llm.generate(prompt, temp=0.0), 24)) == ours


@pytest.mark.parametrize(
    "scaling",
    [
        dict(rope_scaling="linear", rope_factor=4.0),
        dict(rope_scaling="llama3", rope_factor=8.0, rope_original_max_seq_len=8192),
        dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=16),
    ],
    ids=lambda d: d["rope_scaling"],
)
def test_gguf_rope_scaling_comes_back(bpe_ggufs, scaling, tmp_path, monkeypatch, one_thread):
    """linear and llama3 travel as a rope_freqs tensor (to-gguf's), yarn as llama.cpp's metadata;
    the import gives the same RoPE, so the same logits."""
    import gguf

    if scaling["rope_scaling"] == "yarn":  # to-gguf writes no yarn: llama.cpp's keys, by hand

        def add_yarn(writer, base, add=gguf.GGUFWriter.add_rope_freq_base):
            add(writer, base)
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(4.0)
            writer.add_rope_scaling_orig_ctx_len(16)

        monkeypatch.setattr(gguf.GGUFWriter, "add_rope_freq_base", add_yarn)
    tokenizer = HFTokenizer(bpe_ggufs["gpt2"][0])
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**TINY | dict(vocab_size=420, max_seq_len=16384) | scaling))
    written = model
    if scaling["rope_scaling"] == "yarn":
        written = Transformer(ModelArgs(**TINY | dict(vocab_size=420, max_seq_len=16384)))
        written.load_state_dict(model.state_dict())
    gguf_export.write_gguf(written.eval(), tokenizer, tmp_path / "m.gguf", "f32", "tiny")
    assert convert_main(["from-gguf", "--gguf", tmp_path / "m.gguf", "--out", tmp_path / "r"]) == 0
    imported, _ = load_model(tmp_path / "r")
    assert {key: getattr(imported.args, key) for key in scaling} == scaling
    tokens = torch.randint(0, 420, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(imported(tokens), model(tokens), rtol=0, atol=1e-5)


def test_text_stream_never_prints_half_a_character(bpe_ggufs):
    tokenizer = HFTokenizer(bpe_ggufs["gpt2"][0])
    text = "emoji 🤗🚀👍🏽 中文 é"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split()) + 3  # some characters span several tokens
    out = io.StringIO()
    writes = []
    out.write = writes.append
    stream = TextStream(tokenizer, [], out)
    for token in ids:
        stream.add(token)
    stream.flush_new()
    assert "".join(writes) == text and not any("\ufffd" in w for w in writes)


def custom_gguf(path: Path, arch="llama", extra=None, tensor_type=None) -> Path:
    """A tiny llama GGUF written by hand, with another architecture, extra metadata or one tensor of
    another type (the refusals' inputs)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, arch)
    for key, value in dict(block_count=1, context_length=64, embedding_length=32).items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_uint32(f"{arch}.feed_forward_length", 64)
    writer.add_uint32(f"{arch}.attention.head_count", 4)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(["t", "0", "t0", *(f"t{i}" for i in range(1, 6))])
    writer.add_token_merges(["t 0"])
    if tensor_type is not None:
        qtype = gguf.GGMLQuantizationType[tensor_type]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((8, 32 // block * size), dtype=np.uint8)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    else:
        writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def truncated(path: Path, out: Path) -> Path:
    data = path.read_bytes()
    out.write_bytes(data[: len(data) * 3 // 4])
    return out


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d, b: custom_gguf(d / "x.gguf", arch="qwen2"), "architecture 'qwen2'"),
        (
            lambda d, b: custom_gguf(d / "x.gguf", extra={"llama.attention.sliding_window": 8}),
            "sliding_window",
        ),
        (lambda d, b: custom_gguf(d / "x.gguf", tensor_type="Q8_1"), "tensor type Q8_1"),
        (lambda d, b: truncated(b["gpt2"][1], d / "x.gguf"), "truncated"),
        (lambda d, b: d / "missing.gguf", "no such GGUF file"),
    ],
    ids=["architecture", "sliding-window", "tensor-type", "truncated", "missing"],
)
def test_from_gguf_refuses_in_one_line(bpe_ggufs, make, message, tmp_path, capsys):
    gguf = make(tmp_path, bpe_ggufs)
    assert convert_main(["from-gguf", "--gguf", gguf, "--out", tmp_path / "run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_from_hf_takes_a_tokenizer_json_folder(bpe_ggufs, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    args = ModelArgs(**TINY | dict(vocab_size=423))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**hf_format.hf_config(args))
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).write_bytes((bpe_ggufs["gpt2"][0].parent / name).read_bytes())
    assert convert_main(["from-hf", "--hf-dir", tmp_path / "hf", "--out", tmp_path / "run"]) == 0
    _, _, tokenizer = load_run(tmp_path / "run", "cpu", torch.float32)
    assert tokenizer.encode(TEXTS[0]) == HFTokenizer(bpe_ggufs["gpt2"][0]).encode(TEXTS[0])
    small = hf_format.hf_config(ModelArgs(**TINY | dict(vocab_size=97)))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(small))
    argv = ["from-hf", "--hf-dir", tmp_path / "hf", "--out", tmp_path / "run2"]
    capsys.readouterr()
    assert convert_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "tokenizer.json has 420 pieces" in err and "vocab_size is 97" in err


def transformers_greedy(model, prompt: list[int], new: int) -> list[int]:
    """transformers' generate(do_sample=False): `new` tokens after `prompt`, past any EOS."""
    tokens = torch.tensor([prompt])
    out = model.generate(
        tokens,
        attention_mask=torch.ones_like(tokens),
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def exports_back_alike(run: Path, out: Path, llama_cpp, prompt: str, new: int):
    """to-hf and to-gguf (f32) of an imported run give transformers and llama.cpp our model: the
    same token ids for TEXTS and CHAT (our decoding too), transformers' logits within 1e-4
    (relative, fp32), and both greedy continuations of `prompt` (`new` tokens) equal to ours."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, _, tokenizer = load_run(run, "cpu", torch.float32)
    ids = encode_prompt(tokenizer, prompt)
    ours = generate(model, [ids], Sampling(new, temperature=0))[0]
    texts = [*TEXTS, CHAT]
    assert convert_main(["to-hf", "--run", run, "--out", out / "hf"]) == 0
    hf_tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    for text in texts:
        expected = encode_prompt(tokenizer, text)
        assert hf_tokenizer(text).input_ids == expected, text
        shown = hf_tokenizer.decode(expected, skip_special_tokens=True)
        assert shown == tokenizer.decode(expected), text
    hf = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    tokens = torch.tensor([ids + ours])
    with torch.no_grad():
        reference = hf(tokens).logits[0]
        assert (model(tokens)[0] - reference).abs().max() <= 1e-4 * reference.abs().max()
    assert transformers_greedy(hf, ids, new) == ours
    del hf, model
    gguf = out / "m.gguf"
    assert convert_main(["to-gguf", "--run", run, "--out", gguf]) == 0
    theirs = llama_cpp_ids(llama_cpp, gguf, texts, special=True)
    assert theirs == [tokenizer.encode(text) for text in texts]
    # f32 attention and KV cache, as ours: llama.cpp's f16 default moves logits by ~1e-3
    kv = dict(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False)
    llama = llama_cpp.Llama(str(gguf), n_ctx=len(ids) + new, n_threads=1, verbose=False, **kv)
    with closing(llama) as llm:
        assert list(itertools.islice(llm.generate(ids, temp=0.0), new)) == ours


@pytest.mark.parametrize("pre", ["gpt2", "smollm"])
def test_an_imported_bpe_model_exports_back_to_transformers_and_llama_cpp(
    bpe_ggufs, pre, tmp_path, llama_cpp, one_thread
):
    pytest.importorskip("transformers")
    run = import_once(bpe_ggufs[pre][1], tmp_path)
    exports_back_alike(run, tmp_path, llama_cpp, "Héllo wörld 中文 🤗 12345", 24)


SMOLLM2 = os.environ.get("PICOLLAMA_SMOLLM2_GGUF")
needs_smollm2 = pytest.mark.skipif(
    not SMOLLM2, reason="set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file"
)
HAMLET = "To be, or not to be, that is the question:"
# greedy tokens compared on SmolLM2: 12 (transformers' and ours, twice) and 8 (llama.cpp's, whose
# f32 decode here costs ~0.2 s a token), each past the 7 tokens of "\n\nThe answer to the question"
SMOLLM2_NEW = 12
SMOLLM2_EXPORT_NEW = 8


IMPORT_AND_SAMPLE = """
import sys, torch
from pathlib import Path
from picollama.convert import main as convert
from picollama.cli.command import run_command
from picollama.sampling.decode import generate
from picollama.sampling.prompts import encode_prompt
from picollama.sampling.sampler import Sampling
from picollama.run_files import load_run
gguf, run = sys.argv[1:]
print("status", run_command(convert.main, ["from-gguf", "--gguf", gguf, "--out", run]), flush=True)
model, _, tokenizer = load_run(Path(run), "cpu", torch.float32)
print(tokenizer.decode(generate(model, [encode_prompt(tokenizer, "Hi")], Sampling(8, 0))[0]))
status = Path("/proc/self/status").read_text()
print("peak_kb", next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
"""


@pytest.fixture(scope="module")
def smollm2_import(tmp_path_factory) -> tuple[Path, int]:
    """(run, peak_kb): SmolLM2's GGUF file imported once (from-gguf) for this module's tests, by a
    process of its own that then samples from it; peak_kb is that process's own peak memory
    (VmHWM: getrusage's maxrss keeps the forking parent's across exec, the suite's ~2 GB). One
    thread: on a busy 2-core machine two made its decoding 6-8x slower."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("smollm2")
    env = os.environ | {"PICOLLAMA_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", IMPORT_AND_SAMPLE, SMOLLM2, str(root / "run")]
    done = subprocess.run(
        command,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert "status 0" in done.stdout.splitlines(), done.stdout + done.stderr
    return root / "run", int(done.stdout.split("peak_kb")[-1])


@pytest.fixture(scope="module")
def smollm2_run(smollm2_import, one_thread) -> Path:
    """The run from-gguf made of SmolLM2's GGUF file; the tests on it run on one thread."""
    return smollm2_import[0]


@contextmanager
def gguf_read_once():
    """transformers parses a GGUF file's metadata anew for its config, its tensors and its
    tokenizer (~3 s each on SmolLM2's 49,152-token vocabulary): here one gguf.GGUFReader per file
    serves all three, read-only; its reading of the file is otherwise transformers' own."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


@pytest.fixture(scope="module")
def smollm2_hf(tmp_path_factory, one_thread) -> Path:
    """A Hugging Face folder of SmolLM2 written by transformers from its own reading of the GGUF
    file: LlamaForCausalLM (fp32) and the tokenizer, save_pretrained."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("smollm2_hf")
    gguf = Path(SMOLLM2)
    with gguf_read_once():
        transformers_from_gguf(gguf).save_pretrained(folder)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    return folder


@needs_smollm2
def test_smollm2_imports_tokenizes_and_samples_like_llama_cpp(smollm2_run, llama_cpp):
    # (its logits against transformers' reading: test_gguf_import_logits_match_transformers's
    # check; on this file it takes a minute, too long for CI)
    model, _, tokenizer = load_run(smollm2_run, "cpu", torch.float32)
    assert (model.args.n_layers, model.args.n_kv_heads, model.args.rope_theta) == (30, 3, 1e5)
    assert model.args.tie_embeddings and model.args.max_seq_len == 8192
    theirs = llama_cpp_ids(llama_cpp, Path(SMOLLM2), [*TEXTS, CHAT], special=True)
    assert [tokenizer.encode(text) for text in [*TEXTS, CHAT]] == theirs
    prompt = encode_prompt(tokenizer, "The capital of France is")
    ours = generate(model, [prompt], Sampling(6, temperature=0))[0]
    assert "Paris" in tokenizer.decode(ours)


@needs_smollm2
def test_smollm2_from_hf_and_from_gguf_sample_like_transformers(smollm2_hf, smollm2_run, tmp_path):
    """from-hf of the folder transformers wrote, and from-gguf of the file, continue HAMLET greedily
    as transformers does on that folder (fp32)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    assert convert_main(["from-hf", "--hf-dir", smollm2_hf, "--out", tmp_path / "run"]) == 0
    prompt = AutoTokenizer.from_pretrained(smollm2_hf)(HAMLET).input_ids
    hf = LlamaForCausalLM.from_pretrained(smollm2_hf).eval()
    theirs = transformers_greedy(hf, prompt, SMOLLM2_NEW)
    for run in (tmp_path / "run", smollm2_run):
        model, _, tokenizer = load_run(run, "cpu", torch.float32)
        assert encode_prompt(tokenizer, HAMLET) == prompt
        assert generate(model, [prompt], Sampling(SMOLLM2_NEW, temperature=0))[0] == theirs, run
    assert tokenizer.decode(theirs).startswith("\n\nThe answer to the question")


@needs_smollm2
def test_smollm2_exports_back_to_transformers_and_llama_cpp(smollm2_run, tmp_path, llama_cpp):
    pytest.importorskip("transformers")
    exports_back_alike(smollm2_run, tmp_path, llama_cpp, HAMLET, SMOLLM2_EXPORT_NEW)


@needs_smollm2
def test_smollm2_import_and_sampling_stay_under_1_5_gb(smollm2_import):
    """One process imports the file (dequantized one tensor at a time) and samples from it: no
    second full copy of the weights at any point."""
    peak_kb = smollm2_import[1]
    assert peak_kb < 1.5 * 2**20, f"{peak_kb / 2**20:.2f} GB"


def test_generate_runs_a_gguf_file_and_a_hf_folder_imported_once(
    bpe_ggufs, tmp_path, monkeypatch, capsys, one_thread
):
    import generate as generate_command

    monkeypatch.setenv("PICOLLAMA_CACHE", str(tmp_path / "cache"))
    gguf = bpe_ggufs["gpt2"][1]
    assert (
        convert_main(["to-hf", "--run", import_once(gguf, tmp_path), "--out", tmp_path / "hf"]) == 0
    )
    capsys.readouterr()
    for source in (gguf, tmp_path / "hf"):
        for first in (True, False):
            argv = ["--run", str(source), "--prompt", "Héllo", "--max-new-tokens", "4"]
            assert run_command(generate_command.main, [*argv, "--temperature", "0"]) == 0
            out, err = capsys.readouterr()
            assert out.startswith("Héllo") and ("imported" in err) == first, err
    assert len([p for p in (tmp_path / "cache" / "imported").iterdir() if p.is_dir()]) == 2


def import_once(gguf: Path, folder: Path) -> Path:
    assert convert_main(["from-gguf", "--gguf", gguf, "--out", folder / "run"]) == 0
    return folder / "run"


@pytest.fixture(scope="module")
def bpe_data(bpe_ggufs, tmp_path_factory) -> tuple[Path, Path]:
    """(the gpt2 GGUF imported as a run, a dataset prepared with its tokenizer)."""
    from data.build import prepare

    root = tmp_path_factory.mktemp("bpe_data")
    run = import_once(bpe_ggufs["gpt2"][1], root)
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text("\n".join(TEXTS[i:] + TEXTS[:i]) * 4)
    return run, prepare(str(corpus), tokenizer=str(run), out_dir=root / "data", command=["test"])


def test_a_gguf_model_fine_tunes_on_data_prepared_with_its_tokenizer(bpe_ggufs, bpe_data, tmp_path):
    import train

    run, data = bpe_data
    meta = json.loads((data / "meta.json").read_text())
    recorded = json.loads((run / "config.json").read_text())
    assert meta["tokenizer_sha256"] == recorded["tokenizer_sha256"] and meta["bos_id"] == 1
    assert (data / "tokenizer_config.json").is_file()
    sections = {
        "model": recorded["model"] | {"max_seq_len": 32},  # the source's model, as its config.json
        "data": {"dir": str(data)},
        "train": {"init_from": str(run), "max_steps": 3, "batch_size": 2, "seq_len": 32},
        "eval": {"interval": 0},
        "checkpoint": {"interval": 0},
    }
    sections["train"] |= {"sample_tokens": 0, "out_dir": str(tmp_path / "tuned")}
    config = tmp_path / "tune.toml"
    config.write_text(
        "".join(
            f"[{name}]\n"
            + "".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items() if v is not None)
            for name, table in sections.items()
        )
    )
    assert run_command(train.main, ["--config", str(config)]) == 0
    _, _, tokenizer = load_run(tmp_path / "tuned", "cpu", torch.float32)
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.encode(TEXTS[0]) == HFTokenizer(
        bpe_ggufs["gpt2"][0]
    ).encode(TEXTS[0])


def test_the_study_runs_on_a_gguf_file(bpe_ggufs, bpe_data, tmp_path, monkeypatch, one_thread):
    import generate as generate_command

    monkeypatch.setenv("PICOLLAMA_CACHE", str(tmp_path / "cache"))
    argv = ["extrapolate", "--run", str(bpe_ggufs["gpt2"][1]), "--data", str(bpe_data[1])]
    argv += ["--lengths", "48,96", "--methods", "none,yarn", "--num-windows", "1", "--probes", "2"]
    assert run_command(generate_command.main, [*argv, "--out", str(tmp_path / "study")]) == 0
    report = json.loads((tmp_path / "study" / "extrapolation.json").read_text())
    assert report["lengths"] == [48, 64, 96] and len(report["runs"]) == 1
