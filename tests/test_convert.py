"""picollama.convert: HF mapping (same logits, exact round trip), GGUF in llama.cpp, commands."""

import dataclasses
import itertools
import json
import shutil
from contextlib import closing

import pytest
import torch

from model import ModelArgs, Transformer
from picollama.cli.command import run_command
from picollama.convert import main as convert
from picollama.convert import to_gguf as gguf_export
from picollama.convert.hf import from_hf_state_dict, hf_config, to_hf_state_dict
from picollama.run_files import load_model, load_run, save_model
from picollama.sampling.decode import generate
from picollama.sampling.prompts import encode_prompt
from picollama.sampling.sampler import Sampling

TINY = dict(dim=64, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=32, multiple_of=16)
CONFIGS = {
    "mha": ModelArgs(**TINY),
    "gqa": ModelArgs(**TINY, n_kv_heads=2),
    "tied": ModelArgs(**TINY, n_kv_heads=1, tie_embeddings=True),
}


def make_model(args: ModelArgs, seed=0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(args).eval()


def hf_llama(args: ModelArgs, seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**hf_config(args))
    return transformers.LlamaForCausalLM(config).eval(), config


@pytest.mark.parametrize("name", list(CONFIGS))
def test_from_hf_matches_hf_logits(name):
    hf, config = hf_llama(CONFIGS[name])
    # HF's default init is too small to tell permutations apart: give it real variance
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 1.0)
    ours = from_hf_state_dict(hf.state_dict(), config).eval()
    tokens = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_to_hf_matches_our_logits(name):
    ours = make_model(CONFIGS[name])
    hf, _ = hf_llama(CONFIGS[name], seed=1)
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(ours), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    tokens = torch.randint(0, 97, (2, 24))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() <= 1e-4


def test_hf_round_trip_is_exact():
    ours = make_model(CONFIGS["tied"])
    back = from_hf_state_dict(to_hf_state_dict(ours), hf_config(ours.args))
    assert back.args.hidden_dim == ours.args.hidden_dim
    sizing = ("multiple_of", "ffn_hidden_dim")  # other spellings of the same hidden_dim
    back_args, our_args = back.args.to_dict(), ours.args.to_dict()
    assert {k: v for k, v in back_args.items() if k not in sizing} == {
        k: v for k, v in our_args.items() if k not in sizing
    }
    assert back.output.weight is back.tok_embeddings.weight
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.fixture(scope="module")
def run_dir(make_tiny_run, one_thread):
    return make_tiny_run(5)[0]


def convert_command(command: str, source, out, *flags) -> int:
    """`python -m picollama.convert COMMAND --run SOURCE --out OUT FLAGS` (--hf-dir for from-hf), in
    this process."""
    source_flag = "--hf-dir" if command == "from-hf" else "--run"
    argv = [command, source_flag, str(source), "--out", str(out), *flags]
    return run_command(convert.main, argv)


def test_to_hf_loads_in_transformers_with_the_same_logits(run_dir, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    assert convert_command("to-hf", run_dir, tmp_path / "hf") == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'hf'}"
    ours, _ = load_model(run_dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 320, (2, 40))
    with torch.no_grad():
        assert torch.allclose(theirs(tokens).logits, ours(tokens), atol=1e-5)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    special = (config["bos_token_id"], config["eos_token_id"], config["torch_dtype"])
    assert special == (1, 2, "float32")
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(run_dir / "tokenizer.model"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in ["ab cd ef.", "  two spaces\nand a line", "Héllo ✓ 123"]:
        assert tokenizer(text).input_ids == [sp.bos_id(), *sp.encode(text)]
    # the output is not overwritten without --force
    assert convert_command("to-hf", run_dir, tmp_path / "hf") == 2
    assert "--force" in capsys.readouterr().err
    assert convert_command("to-hf", run_dir, tmp_path / "hf", "--force") == 0


def test_exports_keep_the_chat_template(run_dir, tmp_path):
    """A run trained here (sentencepiece, the default template written in) keeps its template in
    to-hf, where transformers renders it as we do, and in to-gguf, read back by from-gguf."""
    transformers = pytest.importorskip("transformers")
    gguf = pytest.importorskip("gguf")
    from picollama.chat_template import (
        DEFAULT_TEMPLATE,
        render_chat,
        run_chat_template,
        write_default_template,
    )

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    assert write_default_template(run) and (run / "tokenizer.model").is_file()
    assert convert_command("to-hf", run, tmp_path / "hf") == 0
    assert convert_command("to-gguf", run, tmp_path / "m.gguf") == 0
    saved = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == DEFAULT_TEMPLATE
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat += [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    rendered = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == render_chat(DEFAULT_TEMPLATE, chat, load_run(run, "cpu", torch.float32)[2])
    field = gguf.GGUFReader(tmp_path / "m.gguf").fields["tokenizer.chat_template"]
    assert bytes(field.parts[field.data[0]]).decode() == DEFAULT_TEMPLATE
    back = ["from-gguf", "--gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "back")]
    assert run_command(convert.main, back) == 0
    assert run_chat_template(tmp_path / "back") == DEFAULT_TEMPLATE


def test_an_output_overlapping_the_input_is_refused_even_with_force(run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    before = sorted(p.name for p in run.iterdir())
    for out in (run, run / "hf", tmp_path):  # the run itself, inside it, and a folder holding it
        assert convert_command("to-hf", run, out, "--force") == 2
        assert "overlaps the input" in capsys.readouterr().err
        assert sorted(p.name for p in run.iterdir()) == before
    assert convert_command("from-hf", run, run, "--force") == 2
    assert "overlaps the input" in capsys.readouterr().err
    assert load_model(run)[0].args.vocab_size == 320


def random_hf_llama(directory, shard=False, dtype=torch.float32, **overrides):
    """A random LlamaForCausalLM (GQA, llama3 RoPE scaling) saved by save_pretrained."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    sizes = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    llama3 = {"rope_type": "llama3", "factor": 4.0, "original_max_position_embeddings": 16}
    llama3 |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope = dict(rope_theta=500000.0, rope_scaling=llama3)
    config = transformers.LlamaConfig(**sizes | heads | rope | overrides)
    model = transformers.LlamaForCausalLM(config).eval().to(dtype)
    model.save_pretrained(directory, max_shard_size="100KB" if shard else "5GB")
    return model


@pytest.mark.parametrize("shard, tied", [(False, False), (True, True)])
def test_from_hf_gives_the_same_logits(run_dir, tmp_path, shard, tied):
    theirs = random_hf_llama(tmp_path / "hf", shard=shard, tie_word_embeddings=tied)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() == shard
    shutil.copyfile(run_dir / "tokenizer.model", tmp_path / "hf" / "tokenizer.model")
    assert convert_command("from-hf", tmp_path / "hf", tmp_path / "run") == 0
    ours, config = load_model(tmp_path / "run")
    assert ours.args.rope_scaling == "llama3" and ours.args.n_kv_heads == 2
    assert "converted_from" in config
    assert ours.args.tie_embeddings == tied
    assert (tmp_path / "run" / "tokenizer.model").is_file()
    tokens = torch.randint(0, 320, (2, 48))  # past the original 16-token context: llama3 at work
    with torch.no_grad():
        assert torch.allclose(ours(tokens), theirs(tokens).logits, atol=1e-5)


def test_from_hf_refuses_what_it_cannot_read(run_dir, tmp_path, capsys):
    random_hf_llama(tmp_path / "hf")
    assert convert_command("from-hf", tmp_path / "hf", tmp_path / "run") == 2
    assert "no sentencepiece tokenizer.model" in capsys.readouterr().err
    shutil.copyfile(run_dir / "tokenizer.model", tmp_path / "hf" / "tokenizer.model")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps(config | {"model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    )
    assert convert_command("from-hf", tmp_path / "hf", tmp_path / "run") == 2
    assert "not a Llama model" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing half-written


@pytest.mark.parametrize(
    "overrides, dtype",
    [
        ({}, torch.float32),
        (dict(tie_word_embeddings=True, rope_scaling=None), torch.bfloat16),
        ({}, torch.float16),
    ],
)
def test_a_from_hf_import_is_a_run_generate_loads(run_dir, tmp_path, overrides, dtype):
    """What from-hf writes, generate reads: tied embeddings, no RoPE scaling, half precision."""
    random_hf_llama(tmp_path / "hf", dtype=dtype, **overrides)
    shutil.copyfile(run_dir / "tokenizer.model", tmp_path / "hf" / "tokenizer.model")
    assert convert_command("from-hf", tmp_path / "hf", tmp_path / "run") == 0
    model, _, tokenizer = load_run(tmp_path / "run", "cpu", torch.float32)  # what generate.py loads
    prompt = encode_prompt(tokenizer, "the cat")
    assert len(generate(model, [prompt], Sampling(4, temperature=0))[0]) == 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(vocab_size=300), "tokenizer.model has 320 pieces but config.json vocab_size is 300"),
        (
            dict(max_position_embeddings=10**9),
            "max_seq_len must be at most 16,777,216, not 1000000000 (max_position_",
        ),
    ],
)
def test_from_hf_refuses_what_generate_could_not_load(
    run_dir, tmp_path, capsys, overrides, message
):
    """A 320-piece tokenizer for 300 embeddings, or a context no model has: once imported, then
    refused by generate (or out of memory there)."""
    random_hf_llama(tmp_path / "hf", **overrides)
    shutil.copyfile(run_dir / "tokenizer.model", tmp_path / "hf" / "tokenizer.model")
    capsys.readouterr()  # transformers' progress bars
    assert convert_command("from-hf", tmp_path / "hf", tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["to-hf", "--run", "{missing}", "--out", "{out}"], "not a picollama run directory"),
        (["from-hf", "--hf-dir", "{run}", "--out", "{out}"], "not a Hugging Face Llama config"),
        (["sideways", "{run}", "{out}"], "invalid choice"),
        (["to-gguf", "--run", "{missing}", "--out", "{out}"], "not a picollama run directory"),
        (["to-gguf", "--run", "{run}", "--out", "{out}", "--type", "q4_0"], "invalid choice"),
    ],
)
def test_command_errors_are_one_line(run_dir, tmp_path, capsys, argv, message):
    # in this process (test_cli_errors.test_as_scripts_too runs python -m picollama.convert)
    argv = [a.format(run=run_dir, missing=tmp_path / "missing", out=tmp_path / "out") for a in argv]
    assert run_command(convert.main, argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error:") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- GGUF for llama.cpp


def llama_cpp_logits(llama_cpp, path, tokens: list[int]) -> torch.Tensor:
    """The logits (T, vocab) llama.cpp computes for tokens with f32 attention, through its C API
    with the extra (AMX, repacked) CPU kernels off: ggml_backend_amx_mul_mat crashes on q8_0 weights
    on this Xeon (llama-cpp-python 0.3.36), also for files that llama.cpp quantized itself."""
    model_params = llama_cpp.llama_model_default_params()
    model_params.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    context_params = llama_cpp.llama_context_default_params()
    context_params.n_ctx = context_params.n_batch = len(tokens)
    context_params.n_threads = context_params.n_threads_batch = 1
    # f32 attention: llama.cpp's defaults (f16 KV cache, flash attention in f16) cost ~1e-3
    context_params.type_k = context_params.type_v = llama_cpp.GGML_TYPE_F32
    context_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    context = llama_cpp.llama_init_from_model(model, context_params)
    try:
        batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.logits[i] = token, i, 1
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, 0
        assert llama_cpp.llama_decode(context, batch) == 0
        vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        logits = llama_cpp.llama_get_logits(context)
        values = [logits[i] for i in range(len(tokens) * vocab)]
        return torch.tensor(values).view(len(tokens), vocab)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(context)
        llama_cpp.llama_model_free(model)


@pytest.fixture(scope="module")
def gguf_files(run_dir, tmp_path_factory, llama_cpp):
    """run_dir exported as f32, f16 and q8_0 GGUF files (for llama.cpp to read)."""
    out = tmp_path_factory.mktemp("gguf")
    for kind in gguf_export.GGUF_TYPES:
        assert convert_command("to-gguf", run_dir, out / f"{kind}.gguf", "--type", kind) == 0
    return {kind: out / f"{kind}.gguf" for kind in gguf_export.GGUF_TYPES}


def test_gguf_continues_like_generate_in_llama_cpp(run_dir, gguf_files, llama_cpp):
    model, _, tokenizer = load_run(run_dir, "cpu", torch.float32)
    prompt = encode_prompt(tokenizer, "ab cd")
    ours = generate(model, [prompt], Sampling(24, temperature=0))[0]
    llama = llama_cpp.Llama(str(gguf_files["f32"]), n_ctx=32, n_threads=1, verbose=False)
    with closing(llama) as llm:
        assert list(itertools.islice(llm.generate(prompt, temp=0.0), 24)) == ours
        # the tokenizer round-trips
        for text in ["ab cd ef.", "  two spaces\nand a line", "Héllo ✓ 123"]:
            ids = llm.tokenize(text.encode(), add_bos=True)
            assert ids == encode_prompt(tokenizer, text)
            assert llm.detokenize(ids[1:]) == text.encode()


@pytest.mark.parametrize(
    "kind, tolerance", [("f32", 1e-5), ("f16", 2e-3), ("bf16", 0.01), ("q8_0", 0.02)]
)
def test_gguf_logits_match_ours(run_dir, gguf_files, kind, tolerance, llama_cpp):
    model, _ = load_model(run_dir)
    tokens = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens[None])[0]
    theirs = llama_cpp_logits(llama_cpp, gguf_files[kind], tokens.tolist())
    assert (theirs - ours).abs().max() <= tolerance * ours.abs().max()


@pytest.mark.parametrize(
    "scaling",
    [
        dict(rope_scaling="ntk", rope_factor=4.0),
        dict(rope_scaling="linear", rope_factor=4.0),
        dict(rope_scaling="llama3", rope_factor=4.0, rope_original_max_seq_len=16),
    ],
    ids=lambda d: d["rope_scaling"],
)
def test_gguf_carries_rope_scaling(run_dir, tmp_path, scaling, llama_cpp):
    args = ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=32, multiple_of=32
    )
    plain = make_model(args)
    with torch.no_grad():  # sharp weights, so that positions matter
        for p in plain.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3)
    scaled = Transformer(dataclasses.replace(args, **scaling)).eval()
    scaled.load_state_dict(plain.state_dict())
    save_model(scaled, tmp_path / "run", tokenizer=run_dir / "tokenizer.model")
    assert convert_command("to-gguf", tmp_path / "run", tmp_path / "m.gguf") == 0
    tokens = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, unscaled = scaled(tokens[None])[0], plain(tokens[None])[0]
    error = (llama_cpp_logits(llama_cpp, tmp_path / "m.gguf", tokens.tolist()) - ours).abs().max()
    assert error <= 1e-5 * ours.abs().max()
    assert (ours - unscaled).abs().max() > 0.1 * ours.abs().max()  # the scaling matters here


def test_gguf_refuses_dynamic_ntk_and_an_existing_file(run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    config = json.loads((run / "config.json").read_text())
    config["model"] |= {"rope_scaling": "dynamic", "rope_factor": 2.0}
    (run / "config.json").write_text(json.dumps(config))
    assert convert_command("to-gguf", run, tmp_path / "m.gguf") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: RoPE scaling 'dynamic'") and err.count("\n") == 1
    assert not list(tmp_path.glob("*.gguf*"))  # nothing half-written
    (tmp_path / "m.gguf").write_text("keep")
    assert convert_command("to-gguf", run_dir, tmp_path / "m.gguf") == 2
    assert "--force" in capsys.readouterr().err and (tmp_path / "m.gguf").read_text() == "keep"
