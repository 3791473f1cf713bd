"""Hugging Face's Llama format, both ways: the to-hf export and the from-hf import.

It maps weight names, config keys and RoPE scaling. Only LLaMA's own choices export."""

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from data.tokenizer import TOKENIZER_CONFIG, HFTokenizer, prompt_start, tokenizer_file
from model import ModelArgs, Transformer
from picollama.cli import UserError
from picollama.cli.flags import check_type
from picollama.cli.named_files import inside
from picollama.components.variants import non_llama
from picollama.config.model_args import checked_model_args
from picollama.convert.outputs import check_replaceable, output
from picollama.convert.spm_unigram import is_unigram, unigram_json
from picollama.run_files import (
    load_model,
    model_bytes,
    model_from_state_dict,
    read_tokenizer,
    save_model,
)

# Our name for each layer weight, and Hugging Face's.
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
# The LlamaConfig key each ModelArgs field is read from.
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


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute wq/wk rows from RoPE's interleaved pairs (Meta) to rotate-half (Hugging Face)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of interleaved_to_half."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def check_llama(args: ModelArgs, target: str = "Hugging Face's Llama"):
    """The one gate every exporter asks.

    `target` computes only LLaMA's defaults. A UserError names the first switch set otherwise."""
    for key in non_llama(args):
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
    if args.rope_scaling == "ntk":  # Static NTK is plain RoPE with a larger theta.
        rope["rope_theta"] = args.rope_theta * args.rope_factor ** (
            args.head_dim / (args.head_dim - 2)
        )
    elif args.rope_scaling in ("linear", "dynamic"):
        rope.update(rope_type=args.rope_scaling, factor=args.rope_factor)
        if args.rope_scaling == "dynamic":  # HF scales it from max_position_embeddings.
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
    elif args.rope_scaling != "none":  # A new method in model.py, not yet mapped here.
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
    """ModelArgs for a LlamaConfig or its dict. ValueError for what picollama does not run."""
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
    # n_heads 0 is left to checked_model_args. It refuses it and names the key.
    if n_heads and value("head_dim", int | None, None) not in (None, dim // n_heads):
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
    """ModelArgs' RoPE scaling keys for a LlamaConfig's rope_parameters. `value` is its reader."""
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
    """A reader value(key, type, default) of config[key], with its type checked.

    A wrong type is a UserError naming the key. A missing key without a default is a KeyError."""
    if not isinstance(config, dict):
        raise UserError(f"{where} must be a JSON object, not {type(config).__name__}")

    def value(key: str, kind, default=KeyError):
        if key not in config and default is KeyError:
            raise KeyError(key)
        return check_type(f"{where} {key}", config.get(key, default), kind)

    return value


def from_hf_state_dict(state_dict: dict, config) -> Transformer:
    """A Transformer holding a Hugging Face Llama state dict. Tensors keep their dtype."""
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
    unigram = is_unigram(tokenizer)
    tokenizer_json = unigram_json(tokenizer, bool(prompt_start(tokenizer))) if unigram else ""
    tokenizer_config = {
        **tokenizer_class(tokenizer, unigram),
        **special,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model.args.max_seq_len,
    }
    template = run_chat_template_value(run_dir)  # The run's own, a string or a list.
    if template is not None:
        tokenizer_config["chat_template"] = template
    needed = model_bytes(model) + tokenizer_path.stat().st_size + len(tokenizer_json) + 64 * 1024
    with output(hf_dir, needed) as tmp:
        tmp.mkdir()
        save_file(to_hf_state_dict(model), tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        shutil.copyfile(tokenizer_path, tmp / tokenizer_path.name)
        if tokenizer_json:
            (tmp / "tokenizer.json").write_text(tokenizer_json)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def run_chat_template_value(run_dir: Path):
    """The run's "chat_template" from tokenizer_config.json, as written, for an export to copy.

    It is one template, transformers' list of named ones, or None."""
    from picollama.chat_template import read_tokenizer_config  # Needs jinja2. Exports only.

    return read_tokenizer_config(Path(run_dir) / TOKENIZER_CONFIG).get("chat_template")


def tokenizer_class(tokenizer, unigram: bool) -> dict:
    """The tokenizer_config.json keys that name the class to read the exported tokenizer.

    A tokenizer.json keeps its own config. A unigram sentencepiece model gets a tokenizer.json
    written beside it. Any other reads tokenizer.model with transformers' Llama tokenizer."""
    if isinstance(tokenizer, HFTokenizer):
        kind = {**tokenizer.config, "tokenizer_class": "PreTrainedTokenizerFast"}
        return kind | {"add_bos_token": tokenizer.add_bos}
    starts = bool(prompt_start(tokenizer))
    if unigram:
        return {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": starts}
    kind = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": starts}
    return kind | {"add_prefix_space": has_dummy_prefix(tokenizer), "legacy": False}


def has_dummy_prefix(tokenizer) -> bool:
    """Whether sentencepiece puts a space before the text ("a" → "▁a").

    Ours do not. Hugging Face's and llama.cpp's Llama tokenizers add one unless told."""
    return tokenizer.encode_as_pieces("a")[0].startswith("\u2581")


def read_hf_weights(hf_dir: Path) -> dict:
    """The state dict of model.safetensors, or of the shards model.safetensors.index.json names."""
    index = hf_dir / "model.safetensors.index.json"
    if (hf_dir / "model.safetensors").is_file():
        files = [hf_dir / "model.safetensors"]
    elif index.is_file():
        files = [inside(name, index, "weight_map") for name in shard_names(index)]
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
    """The shard files an index's weight_map names. A UserError names what is wrong."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:  # Bad JSON or UTF-8, or no weight_map key.
        raise UserError(f"{index}: unreadable index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict):
        raise UserError(f"{index}: weight_map must be an object, not {type(weight_map).__name__}")
    for name, file in weight_map.items():
        check_type(f"{index}: weight_map {name!r}", file, str)
    return sorted(set(weight_map.values()))


def import_hf(hf_dir: Path, run_dir: Path):
    """Write a Hugging Face Llama directory (safetensors, a tokenizer) as a run directory."""
    check_replaceable(run_dir)
    try:
        config = json.loads((hf_dir / "config.json").read_text())
    except FileNotFoundError:
        raise UserError(
            f"{hf_dir} has no config.json: not a Hugging Face model directory"
        ) from None
    except UnicodeDecodeError as e:
        raise UserError(f"{hf_dir}/config.json is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UserError(
            f"{hf_dir}/config.json is not valid JSON (line {e.lineno}, column {e.colno})"
        ) from None
    try:
        args = model_args_from_hf(config)  # Fail early on an architecture we lack.
    except UserError as e:  # A value of the wrong type.
        raise UserError(f"{hf_dir}/{e}") from None
    except (KeyError, TypeError, AttributeError) as e:
        raise UserError(
            f"{hf_dir}/config.json is not a Hugging Face Llama config ({type(e).__name__}: {e})"
        ) from None
    except ValueError as e:  # Said in ModelArgs' words. Add the file's own key name.
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
    if pieces > args.vocab_size:  # The model could not embed the extra pieces.
        raise UserError(
            f"{hf_dir}: {tokenizer_path.name} has {pieces} pieces but config.json vocab_size is "
            f"{args.vocab_size}: not this model's tokenizer; copy the one it was trained with"
        )
    weights = read_hf_weights(hf_dir)
    try:
        model = from_hf_state_dict(weights, config)
    except UserError as e:  # Weights of the wrong shapes.
        raise UserError(f"{hf_dir}: {e}") from None
    with output(run_dir) as tmp:
        save_model(
            model,
            tmp,
            {"converted_from": {"hf_dir": str(hf_dir), "config": config}},
            tokenizer=tokenizer_path,
        )
