"""Hugging Face Llama and llama.cpp GGUF export and import: to-hf, from-hf, to-gguf, from-gguf."""

import argparse
import hashlib
import json
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from data.prepare import cache_dir
from data.tokenizer import HFTokenizer, prompt_start, tokenizer_file
from model import ModelArgs, Transformer, rope_frequencies
from picollama import cli
from picollama.checkpoint import (
    is_hf_directory,
    load_model,
    model_bytes,
    model_from_state_dict,
    read_tokenizer,
    save_model,
)
from picollama.cli import (
    ArgumentParser,
    UserError,
    add_out,
    add_run,
    atomic_output,
    check_type,
    check_writable,
    resolved,
    run_command,
)
from picollama.config import checked_model_args
from picollama.gguf_import import import_gguf

# picollama name -> Hugging Face name, per layer
LAYER_KEYS = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# picollama name -> llama.cpp's GGUF name, per layer (blk.N.…)
GGUF_LAYER_KEYS = {
    "attention.wq": "attn_q",
    "attention.wk": "attn_k",
    "attention.wv": "attn_v",
    "attention.wo": "attn_output",
    "feed_forward.w1": "ffn_gate",
    "feed_forward.w2": "ffn_down",
    "feed_forward.w3": "ffn_up",
    "attention_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
}
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
# ModelArgs key -> the LlamaConfig key it is read from
HF_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "vocab_size": "vocab_size",
    "n_kv_heads": "num_key_value_heads",
    "max_seq_len": "max_position_embeddings",
    "rope_factor": "factor",
    "ffn_hidden_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
}
# What --force may replace, beside an empty directory: a GGUF file (its magic), or a directory
# holding model.safetensors and config.json and nothing picollama does not write there (a run's
# train_state/, metrics.jsonl and extrapolation/; an export's tokenizer files; what an interrupted
# save left): never a user's own files.
OWN_FILES = (
    r"model\.safetensors|config\.json|tokenizer(\.model|\.json|_config\.json)|metrics\.jsonl"
)
OWN_FOLDERS = r"train_state|extrapolation"


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute wq/wk rows from RoPE's interleaved pairs (Meta) to rotate-half (Hugging Face)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of interleaved_to_half."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def check_llama(args: ModelArgs, target: str = "Hugging Face's Llama"):
    """The one export gate, asked by every exporter: UserError naming the first switch of args away
    from LLaMA's defaults, which `target` cannot compute."""
    for key in args.non_llama():
        raise UserError(
            f"{target} has no model.{key} = {getattr(args, key)!r} "
            f"(only {getattr(ModelArgs, key)!r}): this model cannot be exported"
        )


def weight_names(args: ModelArgs):
    """(our name, Hugging Face name, heads whose RoPE rows to permute or None) for every weight."""
    yield "tok_embeddings.weight", "model.embed_tokens.weight", None
    yield "norm.weight", "model.norm.weight", None
    if not args.tie_embeddings:
        yield "output.weight", "lm_head.weight", None
    heads = {"attention.wq": args.n_heads, "attention.wk": args.n_kv_heads}
    for i in range(args.n_layers):
        for ours, theirs in LAYER_KEYS.items():
            yield f"layers.{i}.{ours}.weight", f"model.layers.{i}.{theirs}.weight", heads.get(ours)


def to_hf_state_dict(model: Transformer) -> dict:
    """Our weights under Hugging Face Llama names, with wq/wk permuted to rotate-half."""
    check_llama(model.args)
    sd = model.state_dict()
    return {
        theirs: (sd[ours] if heads is None else interleaved_to_half(sd[ours], heads)).contiguous()
        for ours, theirs, heads in weight_names(model.args)
    }


def hf_config(args: ModelArgs) -> dict:
    """A LlamaConfig dict for our ModelArgs."""
    check_llama(args)
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    original_len = args.original_seq_len
    max_positions = args.max_seq_len
    if args.rope_scaling == "ntk":  # static NTK is a change of base: plain RoPE with a larger theta
        rope["rope_theta"] = args.rope_theta * args.rope_factor ** (
            args.head_dim / (args.head_dim - 2)
        )
    elif args.rope_scaling in ("linear", "dynamic"):
        rope.update(rope_type=args.rope_scaling, factor=args.rope_factor)
        if args.rope_scaling == "dynamic":  # HF scales dynamic NTK from max_position_embeddings
            max_positions = original_len
    elif args.rope_scaling == "yarn":
        rope.update(
            rope_type="yarn",
            factor=args.rope_factor,
            original_max_position_embeddings=original_len,
            beta_fast=32.0,
            beta_slow=1.0,
        )
    elif args.rope_scaling == "llama3":
        rope.update(
            rope_type="llama3",
            factor=args.rope_factor,
            original_max_position_embeddings=original_len,
            low_freq_factor=args.rope_low_freq_factor,
            high_freq_factor=args.rope_high_freq_factor,
        )
    elif args.rope_scaling != "none":  # a method added to model.py that is not mapped here
        raise UserError(
            f"RoPE scaling {args.rope_scaling!r} is not exported to Hugging Face's Llama"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


def model_args_from_hf(config) -> ModelArgs:
    """ModelArgs for a LlamaConfig (or its dict); ValueError for what picollama does not run."""
    c = config if isinstance(config, dict) else config.to_dict()
    if c.get("model_type", "llama") != "llama" or any(
        a != "LlamaForCausalLM" for a in c.get("architectures") or []
    ):
        raise ValueError(
            f"not a Llama model (model_type {c.get('model_type')!r}, {c.get('architectures')})"
        )
    if c.get("attention_bias") or c.get("mlp_bias") or c.get("hidden_act", "silu") != "silu":
        raise ValueError("biases and activations other than SiLU are not implemented")
    value = hf_reader(c, "config.json")
    dim, n_heads = value("hidden_size", int), value("num_attention_heads", int)
    if value("head_dim", int | None, None) not in (None, dim // n_heads):
        raise ValueError(
            f"head_dim {c['head_dim']} != hidden_size/num_attention_heads is not implemented"
        )
    rope = (
        value("rope_parameters", dict | None, None)
        or value("rope_scaling", dict | None, None)
        or {}
    )
    rope_value = hf_reader(rope, "config.json rope_parameters")
    scaling = rope_scaling_from_hf(rope, rope_value)
    theta = rope_value("rope_theta", float, value("rope_theta", float, 10000.0))
    return checked_model_args(
        dim=dim,
        n_layers=value("num_hidden_layers", int),
        n_heads=n_heads,
        n_kv_heads=value("num_key_value_heads", int | None, None) or n_heads,
        vocab_size=value("vocab_size", int),
        ffn_hidden_dim=value("intermediate_size", int),
        norm_eps=value("rms_norm_eps", float, 1e-6),
        rope_theta=theta,
        max_seq_len=value("max_position_embeddings", int, 2048),
        tie_embeddings=value("tie_word_embeddings", bool, False),
        **scaling,
    )


def rope_scaling_from_hf(rope: dict, value) -> dict:
    """ModelArgs' RoPE scaling keys for a LlamaConfig's rope_parameters (`value`: its hf_reader)."""
    rope_type = value("rope_type", str, value("type", str, "default"))
    if rope_type == "default":
        return {"rope_scaling": "none"}
    if rope_type not in ("linear", "dynamic", "yarn", "llama3"):
        raise ValueError(f"RoPE type {rope_type!r} is not implemented")
    kwargs = {"rope_scaling": rope_type, "rope_factor": value("factor", float)}
    if rope_type in ("yarn", "llama3"):
        kwargs["rope_original_max_seq_len"] = value(
            "original_max_position_embeddings", int | None, None
        )
    if rope_type == "yarn" and (
        rope.get("beta_fast") not in (None, 32)
        or rope.get("beta_slow") not in (None, 1)
        or rope.get("attention_factor") is not None
        or rope.get("mscale")
        or rope.get("mscale_all_dim")
    ):
        raise ValueError(
            "yarn is implemented with beta_fast=32, beta_slow=1 and the default attention factor "
            "only"
        )
    if rope_type == "llama3":
        kwargs["rope_low_freq_factor"] = value("low_freq_factor", float)
        kwargs["rope_high_freq_factor"] = value("high_freq_factor", float)
    return kwargs


def hf_reader(config: dict, where: str):
    """value(key, type, default): config[key] checked for its type (UserError naming the key);
    KeyError when a key without a default is missing."""
    if not isinstance(config, dict):
        raise UserError(f"{where} must be a JSON object, not {type(config).__name__}")

    def value(key: str, kind, default=KeyError):
        if key not in config and default is KeyError:
            raise KeyError(key)
        return check_type(f"{where} {key}", config.get(key, default), kind)

    return value


def from_hf_state_dict(state_dict: dict, config) -> Transformer:
    """A Transformer holding a Hugging Face Llama state dict (tensors keep their dtype)."""
    args = model_args_from_hf(config)
    missing = [theirs for _, theirs, _ in weight_names(args) if theirs not in state_dict]
    if missing:
        raise ValueError(
            f"not a Llama state dict for this config: {len(missing)} weights missing, "
            f"e.g. {missing[0]}"
        )
    ours = {
        ours: (
            state_dict[theirs] if heads is None else half_to_interleaved(state_dict[theirs], heads)
        ).contiguous()
        for ours, theirs, heads in weight_names(args)
    }
    return model_from_state_dict(args, ours)


# ---------------------------------------------------------------- command line


@contextmanager
def output(path: Path, needed: int | None = None):
    """atomic_output at the path `path` resolves to, so that a symbolic link's target is replaced
    (the temporary beside it, on its disk), its missing folders made first and removed again if
    the write fails."""
    path = resolved(path)
    made = [folder for folder in path.parents if not folder.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_output(path, needed) as tmp:
            yield tmp
    except BaseException:
        for folder in made:  # the deepest first
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def check_replaceable(out: Path):
    """UserError unless `out` is absent, empty or something picollama wrote (OWN_FILES and
    OWN_FOLDERS), so that --force never deletes what picollama did not write."""
    if out.is_file():
        with open(out, "rb") as file:
            magic = file.read(4)
        if magic not in (b"", b"GGUF"):
            raise UserError(
                f"not replacing {out}: it is not a GGUF file, so picollama did not write it "
                "(--force replaces only a GGUF file); choose another output"
            )
        return
    what = (
        "--force replaces only a run or export directory: model.safetensors, config.json and only "
        "files picollama writes"
    )
    marks = ["model.safetensors", "config.json"]
    cli.check_replaceable(out, OWN_FILES, OWN_FOLDERS, marks=marks, what=what)


def export_hf(run_dir: Path, hf_dir: Path):
    """Write run_dir as a Hugging Face Llama directory (config, safetensors weights, tokenizer)."""
    check_replaceable(hf_dir)
    model, _ = load_model(run_dir)
    check_llama(model.args)
    tokenizer_path = tokenizer_file(run_dir)
    if tokenizer_path is None:
        raise UserError(f"{run_dir} has no tokenizer.model or tokenizer.json")
    tokenizer = read_tokenizer(tokenizer_path)
    dtype = str(model.output.weight.dtype).removeprefix("torch.")
    ids = {
        "bos_token": tokenizer.bos_id(),
        "eos_token": tokenizer.eos_id(),
        "unk_token": tokenizer.unk_id(),
    }
    special = {name: tokenizer.id_to_piece(i) if i >= 0 else None for name, i in ids.items()}
    config = hf_config(model.args) | {
        "bos_token_id": tokenizer.bos_id(),
        "eos_token_id": tokenizer.eos_id(),
        "torch_dtype": dtype,
    }
    if isinstance(
        tokenizer, HFTokenizer
    ):  # its own config, for the class that reads tokenizer.json
        kind = {**tokenizer.config, "tokenizer_class": "PreTrainedTokenizerFast"}
        kind |= {"add_bos_token": tokenizer.add_bos}
    else:
        kind = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": bool(prompt_start(tokenizer))}
        kind |= {"add_prefix_space": has_dummy_prefix(tokenizer), "legacy": False}
    tokenizer_config = {
        **kind,
        **special,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model.args.max_seq_len,
    }
    needed = model_bytes(model) + tokenizer_path.stat().st_size + 64 * 1024
    with output(hf_dir, needed) as tmp:
        tmp.mkdir()
        save_file(to_hf_state_dict(model), tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        shutil.copyfile(tokenizer_path, tmp / tokenizer_path.name)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def has_dummy_prefix(tokenizer) -> bool:
    """Whether sentencepiece puts a space before the text ("a" → "▁a"); ours do not, while Hugging
    Face's and llama.cpp's Llama tokenizers add one unless told."""
    return tokenizer.encode_as_pieces("a")[0].startswith("\u2581")


def gguf_rope(args: ModelArgs) -> tuple[float, torch.Tensor | None]:
    """(rope_freq_base, per-dimension frequency divisors or None) reproducing our RoPE in llama.cpp:
    static NTK is a larger base; linear and llama3 scaling divide each frequency (rope_freqs)."""
    d = args.head_dim
    if args.rope_scaling == "none":
        return args.rope_theta, None
    if args.rope_scaling == "ntk":
        return args.rope_theta * args.rope_factor ** (d / (d - 2)), None
    if args.rope_scaling in ("linear", "llama3"):
        plain = 1.0 / args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        return args.rope_theta, plain / rope_frequencies(args, args.max_seq_len)[0]
    raise UserError(
        f"RoPE scaling {args.rope_scaling!r} is not exported to GGUF "
        "(none, ntk, linear and llama3 are)"
    )


def export_gguf(run_dir: Path, out: Path, type_: str):
    """Write run_dir as a llama.cpp GGUF file (see write_gguf)."""
    check_replaceable(out)
    model, _ = load_model(run_dir)
    check_llama(model.args, "llama.cpp's llama")
    tokenizer_path = tokenizer_file(run_dir)
    if tokenizer_path is None:
        raise UserError(f"{run_dir} has no tokenizer.model or tokenizer.json")
    write_gguf(model, read_tokenizer(tokenizer_path), out, type_, run_dir.resolve().name)


def write_gguf(model: Transformer, tokenizer, out: Path, type_: str, name: str):
    """Write a llama.cpp GGUF file: the llama architecture, the sentencepiece vocabulary with scores
    and token types, and the weights in f32, f16, bf16 or q8_0 (norms and rope_freqs stay f32)."""
    try:
        import gguf
    except ImportError:
        raise UserError(
            "to-gguf needs the gguf package (llama.cpp's writer): pip install gguf"
        ) from None
    args = model.args
    check_llama(args, "llama.cpp's llama")
    freq_base, freq_divisors = gguf_rope(args)
    qtype = gguf.GGMLQuantizationType[type_.upper()]
    file_type = (
        gguf.LlamaFileType.ALL_F32
        if type_ == "f32"
        else gguf.LlamaFileType[f"MOSTLY_{type_.upper()}"]
    )
    with output(out) as tmp:
        writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
        writer.add_name(name)
        writer.add_context_length(args.max_seq_len)
        writer.add_embedding_length(args.dim)
        writer.add_block_count(args.n_layers)
        writer.add_feed_forward_length(args.hidden_dim)
        writer.add_head_count(args.n_heads)
        writer.add_head_count_kv(args.n_kv_heads)
        writer.add_rope_dimension_count(args.head_dim)
        writer.add_rope_freq_base(freq_base)
        writer.add_layer_norm_rms_eps(args.norm_eps)
        writer.add_vocab_size(args.vocab_size)
        writer.add_file_type(file_type)
        add_gguf_vocab(writer, tokenizer, args.vocab_size, gguf)
        state = model.state_dict()
        tensors = {
            "token_embd": state["tok_embeddings.weight"],
            "output_norm": state["norm.weight"],
        }
        if not args.tie_embeddings:  # llama.cpp reuses token_embd when output is absent
            tensors["output"] = state["output.weight"]
        if freq_divisors is not None:
            tensors["rope_freqs"] = freq_divisors
        for i in range(args.n_layers):
            for ours, theirs in GGUF_LAYER_KEYS.items():
                tensors[f"blk.{i}.{theirs}"] = state[f"layers.{i}.{ours}.weight"]
        for name, tensor in tensors.items():
            data = tensor.detach().float().numpy()
            # llama.cpp's own rules: vectors stay f32, quantized rows need whole blocks (else f16)
            kind = qtype if data.ndim == 2 else gguf.GGMLQuantizationType.F32
            if data.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
                kind = gguf.GGMLQuantizationType.F16
            writer.add_tensor(f"{name}.weight", gguf.quants.quantize(data, kind), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def add_gguf_vocab(writer, tokenizer, vocab_size: int, gguf):
    """The sentencepiece vocabulary as llama.cpp's "llama" tokenizer: pieces, scores, token types,
    special ids; rows past the tokenizer (a padded embedding) as unused [PADn] tokens."""
    if isinstance(tokenizer, HFTokenizer):
        return add_gguf_bpe_vocab(writer, tokenizer, vocab_size, gguf)
    pieces, scores, types = [], [], []
    for i in range(vocab_size):
        if i >= tokenizer.get_piece_size():
            pieces.append(f"[PAD{i}]".encode())
            scores.append(-10000.0)
            types.append(gguf.TokenType.UNUSED)
            continue
        pieces.append(tokenizer.id_to_piece(i).encode())
        scores.append(tokenizer.get_score(i))
        if tokenizer.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif tokenizer.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif tokenizer.is_unused(i):
            types.append(gguf.TokenType.UNUSED)
        elif tokenizer.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(has_dummy_prefix(tokenizer))
    writer.add_remove_extra_whitespaces(False)
    for name, token_id in (
        ("bos", tokenizer.bos_id()),
        ("eos", tokenizer.eos_id()),
        ("unk", tokenizer.unk_id()),
    ):
        if token_id >= 0:
            getattr(writer, f"add_{name}_token_id")(token_id)
    writer.add_add_bos_token(bool(prompt_start(tokenizer)))  # as our prompts start
    writer.add_add_eos_token(False)


def add_gguf_bpe_vocab(writer, tokenizer: HFTokenizer, vocab_size: int, gguf):
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" tokenizer: tokens, merges, types, the
    pre-tokenizer's llama.cpp name, special ids; rows past the tokenizer as unused [PADn] tokens."""
    spec = json.loads(tokenizer.backend.to_str())
    if spec["model"]["type"] != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise UserError("to-gguf takes sentencepiece and byte-level BPE tokenizers only")
    pre = gguf_pre_name(spec.get("pre_tokenizer") or {})
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    n = tokenizer.get_piece_size()
    spelled = tokenizer.backend.id_to_token  # in the byte alphabet, as llama.cpp reads them
    tokens = [spelled(i) if i < n else f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types + [gguf.TokenType.UNUSED] * (vocab_size - n))
    writer.add_token_merges(merges)
    for name in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{name}_id")()
        if token_id >= 0:
            getattr(writer, f"add_{name}_token_id")(token_id)
    writer.add_add_bos_token(tokenizer.add_bos)
    if tokenizer.config.get("chat_template"):
        writer.add_chat_template(tokenizer.config["chat_template"])


def gguf_pre_name(pre: dict) -> str:
    """llama.cpp's tokenizer.ggml.pre for a tokenizer.json pre-tokenizer: GPT-2's split ("gpt-2"),
    or single digits first ("smollm"); UserError for others."""
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if parts[-1:] and kinds[-1] == "ByteLevel" and parts[-1].get("use_regex", True):
        if kinds == ["ByteLevel"]:
            return "gpt-2"
        if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
            return "smollm"
    raise UserError(f"to-gguf: llama.cpp has no name for the pre-tokenizer {json.dumps(pre)}")


def read_hf_weights(hf_dir: Path) -> dict:
    """The state dict of model.safetensors, or of the shards model.safetensors.index.json names."""
    index = hf_dir / "model.safetensors.index.json"
    if (hf_dir / "model.safetensors").is_file():
        files = [hf_dir / "model.safetensors"]
    elif index.is_file():
        files = [hf_dir / name for name in shard_names(index)]
    else:
        raise UserError(
            f"{hf_dir} has no model.safetensors or model.safetensors.index.json "
            "(PyTorch .bin checkpoints are not read: re-save with safe_serialization)"
        )
    state = {}
    for path in tqdm(files, desc="reading weights", unit="file", disable=len(files) == 1 or None):
        try:
            state.update(load_file(path))
        except (OSError, SafetensorError) as e:
            raise UserError(f"{path}: unreadable weights ({e})") from None
    return state


def shard_names(index: Path) -> list[str]:
    """The shard files an index's weight_map names; UserError naming what is wrong."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:  # not JSON or UTF-8; not an object with the key
        raise UserError(f"{index}: unreadable index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict):
        raise UserError(f"{index}: weight_map must be an object, not {type(weight_map).__name__}")
    for name, file in weight_map.items():
        check_type(f"{index}: weight_map {name!r}", file, str)
    return sorted(set(weight_map.values()))


def import_hf(hf_dir: Path, run_dir: Path):
    """Write a Hugging Face Llama directory (safetensors, sentencepiece tokenizer) as a run."""
    check_replaceable(run_dir)
    try:
        config = json.loads((hf_dir / "config.json").read_text())
    except FileNotFoundError:
        raise UserError(
            f"{hf_dir} has no config.json: not a Hugging Face model directory"
        ) from None
    except json.JSONDecodeError as e:
        raise UserError(f"{hf_dir}/config.json: not JSON ({e})") from None
    try:
        args = model_args_from_hf(config)  # fails early on an architecture we do not implement
    except UserError as e:  # a value of the wrong type
        raise UserError(f"{hf_dir}/{e}") from None
    except (KeyError, TypeError, AttributeError) as e:
        raise UserError(
            f"{hf_dir}/config.json is not a Hugging Face Llama config ({type(e).__name__}: {e})"
        ) from None
    except ValueError as e:  # what picollama does not run, in ModelArgs' words: name the file's key
        theirs = HF_KEYS.get(str(e).split()[0])
        raise UserError(
            f"{hf_dir}/config.json: {e}" + (f" ({theirs} there)" if theirs else "")
        ) from None
    tokenizer_path = tokenizer_file(hf_dir)
    if tokenizer_path is None:
        raise UserError(
            f"{hf_dir} has no sentencepiece tokenizer.model or Hugging Face tokenizer.json"
        )
    pieces = read_tokenizer(tokenizer_path).get_piece_size()
    if pieces > args.vocab_size:  # generate could not decode what the model never embeds
        raise UserError(
            f"{hf_dir}: {tokenizer_path.name} has {pieces} pieces but config.json vocab_size is "
            f"{args.vocab_size}: not this model's tokenizer; copy the one it was trained with"
        )
    weights = read_hf_weights(hf_dir)
    try:
        model = from_hf_state_dict(weights, config)
    except UserError as e:  # weights of the wrong shapes
        raise UserError(f"{hf_dir}: {e}") from None
    with output(run_dir) as tmp:
        save_model(
            model,
            tmp,
            {"converted_from": {"hf_dir": str(hf_dir), "config": config}},
            tokenizer=tokenizer_path,
        )


def imported_run(source: Path) -> Path:
    """What --run names, as a run directory: a .gguf file or a Hugging Face directory is imported
    into the cache once (again when its files change); anything else is passed through."""
    if source.is_file() and source.suffix == ".gguf":
        files = [source]
    elif source.is_dir() and is_hf_directory(source):
        files = sorted(p for p in source.iterdir() if p.is_file())
    else:
        return source
    stamps = [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    key = hashlib.sha256("\n".join(stamps).encode()).hexdigest()[:12]
    run = cache_dir() / "imported" / f"{source.resolve().name}-{key}"
    if not (run / "config.json").is_file():
        (import_gguf if source.is_file() else import_hf)(source, run)
        print(f"imported {source} into {run} (once)", file=sys.stderr)
    return run


class OldPaths(argparse.Action):
    """The old positional spelling `COMMAND IN OUT`, kept one more release: IN and OUT fill the
    flags, with a note naming the new spelling."""

    def __init__(self, *args, source: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.source = source

    def __call__(self, parser, namespace, values, option_string=None):
        if not values:
            return
        flag = "--" + self.source.replace("_", "-")
        if len(values) != 2:
            parser.error(f"give {flag} and --out")
        print(
            f"note: the positional IN OUT is now {flag} IN --out OUT ({parser.prog} {flag} IN "
            "--out OUT); the old spelling goes in the next release",
            file=sys.stderr,
        )
        setattr(namespace, self.source, values[0])
        namespace.out = values[1]


def parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m picollama.convert", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    to_hf = commands.add_parser(
        "to-hf", help="export a run directory for transformers.AutoModelForCausalLM"
    )
    add_run(to_hf)
    add_out(to_hf, "the Hugging Face directory written")
    from_hf = commands.add_parser(
        "from-hf", help="import a Hugging Face Llama directory as a run directory"
    )
    from_hf.add_argument(
        "--hf-dir", type=Path, metavar="DIR", help="the Hugging Face Llama directory read"
    )
    from_hf.needed = [("hf_dir", "--hf-dir")]
    add_out(from_hf, "the run directory written")
    from_gguf = commands.add_parser(
        "from-gguf", help="import a llama.cpp GGUF file (llama architecture) as a run directory"
    )
    from_gguf.add_argument("--gguf", type=Path, metavar="FILE", help="the .gguf file read")
    from_gguf.needed = [("gguf", "--gguf")]
    add_out(from_gguf, "the run directory written")
    to_gguf = commands.add_parser(
        "to-gguf", help="export a run directory as one GGUF file for llama.cpp"
    )
    add_run(to_gguf)
    add_out(to_gguf, "the .gguf file written")
    to_gguf.add_argument(
        "--type", choices=GGUF_TYPES, default="f32", help="weight type (default f32)"
    )
    for sub, source in ((to_hf, "run"), (from_hf, "hf_dir"), (from_gguf, "gguf"), (to_gguf, "run")):
        sub.needed.append(("out", "--out"))
        sub.add_argument(
            "--force", action="store_true", help="replace an existing (non-empty) output"
        )
        sub.add_argument(
            "paths", nargs="*", type=Path, action=OldPaths, source=source, help=argparse.SUPPRESS
        )
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    source = getattr(args, {"from-hf": "hf_dir", "from-gguf": "gguf"}.get(args.command, "run"))
    out = args.out
    directory = args.command != "to-gguf"
    check_writable(out, inputs=[source], directory=directory)
    if out.exists() and (not directory or any(out.iterdir())) and not args.force:
        raise UserError(
            f"{out} exists{' and is not empty' if directory else ''}; pass --force to replace it"
        )
    if args.command == "to-gguf":
        export_gguf(source, out, args.type)
    elif args.command == "from-gguf":
        check_replaceable(out)
        import_gguf(source, out)
    else:
        (export_hf if args.command == "to-hf" else import_hf)(source, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
