"""The to-gguf export: a run as one llama.cpp GGUF file, with its RoPE, vocabulary and weights."""

import errno
import json
import re
import shutil
from pathlib import Path

import torch

from data.tokenizer import HFTokenizer, prompt_start, tokenizer_file
from model import ModelArgs, Transformer, rope_frequencies
from picollama.cli import UserError
from picollama.convert.hf import check_llama, has_dummy_prefix, run_chat_template_value
from picollama.convert.outputs import check_replaceable, output
from picollama.convert.spm_unigram import add_gguf_unigram, check_gguf_unigram, is_unigram
from picollama.run_files import load_model, read_tokenizer

# Our name for each layer weight, and llama.cpp's (under blk.N.).
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


def gguf_rope(args: ModelArgs) -> tuple[float, torch.Tensor | None]:
    """(rope_freq_base, frequency divisors or None) that give our RoPE in llama.cpp.

    Static NTK is just a larger base. Linear and llama3 scaling divide each frequency, which
    llama.cpp reads from the rope_freqs tensor. YaRN is llama.cpp's own scaling type, written
    by add_gguf_yarn: its ramp and attention factor are ours."""
    d = args.head_dim
    if args.rope_scaling in ("none", "yarn"):
        return args.rope_theta, None
    if args.rope_scaling == "ntk":
        return args.rope_theta * args.rope_factor ** (d / (d - 2)), None
    if args.rope_scaling in ("linear", "llama3"):
        plain = 1.0 / args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        return args.rope_theta, plain / rope_frequencies(args, args.max_seq_len)[0]
    raise UserError(
        f"RoPE scaling {args.rope_scaling!r} is not exported to GGUF "
        "(none, ntk, linear, yarn and llama3 are)"
    )


def add_gguf_yarn(writer, args: ModelArgs, gguf):
    """YaRN's keys, for a YaRN run. llama.cpp's defaults (beta_fast 32, beta_slow 1, attention
    scaled by 0.1·ln s + 1) are ours, so they are written out to keep them fixed."""
    if args.rope_scaling != "yarn":
        return
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(args.rope_factor)
    writer.add_rope_scaling_orig_ctx_len(args.original_seq_len)
    writer.add_rope_scaling_yarn_beta_fast(32.0)
    writer.add_rope_scaling_yarn_beta_slow(1.0)


def export_gguf(run_dir: Path, out: Path, type_: str):
    """Write run_dir as a llama.cpp GGUF file (see write_gguf)."""
    check_replaceable(out)
    model, _ = load_model(run_dir)
    check_llama(model.args, "llama.cpp's llama")
    tokenizer_path = tokenizer_file(run_dir)
    if tokenizer_path is None:
        raise UserError(f"{run_dir} has no tokenizer.model or tokenizer.json")
    tokenizer, name = read_tokenizer(tokenizer_path), run_dir.resolve().name
    write_gguf(model, tokenizer, out, type_, name, run_chat_template_value(run_dir))


def write_gguf(model: Transformer, tokenizer, out: Path, type_: str, name: str, chat_template=None):
    """Write a llama.cpp GGUF file of the llama architecture.

    It holds the vocabulary with scores and token types, and the chat template. The template is
    `chat_template`, else a tokenizer.json's own. Weights are f32, f16, bf16 or q8_0. Norms and
    rope_freqs stay f32."""
    try:
        import gguf
    except ImportError:
        raise UserError(
            "to-gguf needs the gguf package (llama.cpp's writer): pip install gguf"
        ) from None
    args = model.args
    check_llama(args, "llama.cpp's llama")
    check_gguf_unigram(tokenizer)
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
        add_gguf_yarn(writer, args, gguf)
        writer.add_layer_norm_rms_eps(args.norm_eps)
        writer.add_vocab_size(args.vocab_size)
        writer.add_file_type(file_type)
        add_gguf_vocab(writer, tokenizer, args.vocab_size, gguf)
        add_gguf_chat_template(writer, tokenizer, chat_template)
        for name, tensor in gguf_tensors(model, freq_divisors).items():
            data = tensor.detach().float().numpy()
            # llama.cpp's own rules. Vectors stay f32. Quantized rows need whole blocks, else f16.
            kind = qtype if data.ndim == 2 else gguf.GGMLQuantizationType.F32
            if data.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
                kind = gguf.GGMLQuantizationType.F16
            writer.add_tensor(f"{name}.weight", gguf.quants.quantize(data, kind), raw_dtype=kind)
        write_gguf_file(writer, tmp, out)


def gguf_tensors(model: Transformer, freq_divisors: torch.Tensor | None) -> dict:
    """The model's weights by their llama.cpp names (without .weight), rope_freqs if given."""
    args, state = model.args, model.state_dict()
    tensors = {"token_embd": state["tok_embeddings.weight"], "output_norm": state["norm.weight"]}
    if not args.tie_embeddings:  # llama.cpp reuses token_embd when output is absent.
        tensors["output"] = state["output.weight"]
    if freq_divisors is not None:
        tensors["rope_freqs"] = freq_divisors
    for i in range(args.n_layers):
        for ours, theirs in GGUF_LAYER_KEYS.items():
            tensors[f"blk.{i}.{theirs}"] = state[f"layers.{i}.{ours}.weight"]
    return tensors


def write_gguf_file(writer, tmp: Path, out: Path):
    """Write the header, metadata and tensors to `tmp`, which becomes `out`.

    numpy's tofile reports a full disk only as "N requested and M written". We raise it as ENOSPC,
    which atomic_output turns into one line naming `out`."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except OSError as e:
        short = re.fullmatch(r"(\d+) requested and \d+ written", str(e))
        if e.errno is None and short and shutil.disk_usage(tmp.parent).free < int(short[1]):
            raise OSError(errno.ENOSPC, "No space left on device", str(out)) from None
        raise
    finally:
        writer.close()


def add_gguf_chat_template(writer, tokenizer, chat_template=None):
    """Add tokenizer.chat_template, and any named templates from transformers' list.

    The template is `chat_template`, else a tokenizer.json's own. Nothing is added if neither."""
    if chat_template is None:
        chat_template = getattr(tokenizer, "config", {}).get("chat_template")
    if chat_template:
        writer.add_chat_template(chat_template)


def add_gguf_vocab(writer, tokenizer, vocab_size: int, gguf):
    """Add the vocabulary with scores, token types and special ids.

    A sentencepiece BPE model becomes llama.cpp's "llama" tokenizer, a unigram one its "t5" one. A
    byte-level BPE tokenizer.json becomes its "gpt2" one. Embedding rows past the tokenizer are
    padding, written as unused [PADn] tokens."""
    if isinstance(tokenizer, HFTokenizer):
        return add_gguf_bpe_vocab(writer, tokenizer, vocab_size, gguf)
    if is_unigram(tokenizer):
        add_gguf_unigram(writer, tokenizer)
    else:
        writer.add_tokenizer_model("llama")
        writer.add_add_space_prefix(has_dummy_prefix(tokenizer))
        writer.add_remove_extra_whitespaces(False)
    writer.add_tokenizer_pre("default")
    pieces, scores, types = sentencepiece_tokens(tokenizer, vocab_size, gguf)
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    for name, token_id in (
        ("bos", tokenizer.bos_id()),
        ("eos", tokenizer.eos_id()),
        ("unk", tokenizer.unk_id()),
    ):
        if token_id >= 0:
            getattr(writer, f"add_{name}_token_id")(token_id)
    # Both set, as the "t5" tokenizer's defaults are T5's (EOS added, no BOS).
    writer.add_add_bos_token(bool(prompt_start(tokenizer)))  # As our prompts start.
    writer.add_add_eos_token(False)


def sentencepiece_tokens(tokenizer, vocab_size: int, gguf) -> tuple[list, list, list]:
    """(pieces, scores, token types) of a sentencepiece model, padded to vocab_size."""
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
    return pieces, scores, types


def add_gguf_bpe_vocab(writer, tokenizer: HFTokenizer, vocab_size: int, gguf):
    """Add a byte-level BPE tokenizer.json as llama.cpp's "gpt2" tokenizer.

    It writes tokens, merges, types, special ids and llama.cpp's name for the pre-tokenizer. Rows
    past the tokenizer become unused [PADn] tokens."""
    spec = json.loads(tokenizer.backend.to_str())
    if spec["model"]["type"] != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise UserError("to-gguf takes sentencepiece and byte-level BPE tokenizers only")
    pre = gguf_pre_name(spec.get("pre_tokenizer") or {})
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    n = tokenizer.get_piece_size()
    spelled = tokenizer.backend.id_to_token  # In the byte alphabet, as llama.cpp reads them.
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


def gguf_pre_name(pre: dict) -> str:
    """llama.cpp's tokenizer.ggml.pre name for a tokenizer.json pre-tokenizer.

    GPT-2's split is "gpt-2". Single digits first, then GPT-2's split, is "smollm". Others are
    refused."""
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if parts[-1:] and kinds[-1] == "ByteLevel" and parts[-1].get("use_regex", True):
        if kinds == ["ByteLevel"]:
            return "gpt-2"
        if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
            return "smollm"
    raise UserError(f"to-gguf: llama.cpp has no name for the pre-tokenizer {json.dumps(pre)}")
