"""Import a llama.cpp GGUF file of the llama architecture as a run directory.

This is `python -m picollama.convert from-gguf`. It dequantizes the weights one tensor at a
time, reads the hyperparameters and rebuilds the tokenizer."""

import json
import re
import tempfile
from pathlib import Path

import numpy as np
import torch

from data.tokenizer import TOKENIZER_CONFIG
from model import ModelArgs, rope_frequencies
from picollama.cli import UserError
from picollama.cli.outputs import atomic_output
from picollama.config.model_args import checked_model_args
from picollama.run_files import model_from_state_dict, save_model

# llama.cpp's tensor names (without .weight) mapped to ours.
# In layer N, blk.N.<theirs> becomes layers.N.<ours>.
GLOBAL_TENSORS = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output"}
LAYER_TENSORS = {
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "ffn_gate": "feed_forward.w1",
    "ffn_down": "feed_forward.w2",
    "ffn_up": "feed_forward.w3",
    "attn_norm": "attention_norm",
    "ffn_norm": "ffn_norm",
}
# The GGUF metadata key each ModelArgs field is read from. Refusals name these keys.
GGUF_KEYS = {
    "dim": "llama.embedding_length",
    "n_layers": "llama.block_count",
    "n_heads": "llama.attention.head_count",
    "n_kv_heads": "llama.attention.head_count_kv",
    "vocab_size": "llama.vocab_size",
    "ffn_hidden_dim": "llama.feed_forward_length",
    "norm_eps": "llama.attention.layer_norm_rms_epsilon",
    "rope_theta": "llama.rope.freq_base",
    "max_seq_len": "llama.context_length",
    "rope_factor": "llama.rope.scaling.factor",
    "rope_original_max_seq_len": "llama.rope.scaling.original_context_length",
}
# Metadata (after "llama.") for features picollama does not implement. Such files are refused.
UNSUPPORTED_KEYS = (
    "attention.sliding_window",
    "expert_count",
    "attention.clamp_kqv",
    "attention.max_alibi_bias",
    "logit_scale",
    "attention.key_length_mla",
)
# The tokenizer.ggml.pre values that split with GPT-2's regex. True means digits are split one
# by one first, as in llama.cpp's llama-vocab.cpp. Transformers handles the other pre-tokenizers.
GPT2_SPLITS = dict.fromkeys(
    ("gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "a.x-4.0", "mellum"), False
)
GPT2_SPLITS |= dict.fromkeys(
    ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), True
)

# tokenizer_config.json's <name>_token -> GGUF's tokenizer.ggml.<key>_token_id
SPECIAL_TOKEN_KEYS = (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))


class Metadata:
    """A GGUF file's key-value metadata, read with its types checked (UserError naming the key)."""

    def __init__(self, reader, path: Path):
        self.reader, self.path = reader, path

    def get(self, key: str, kind=None, default=None):
        """The value of `key`, or `default` where absent.

        When `kind` is given the value must have it, else a UserError names the key. An int
        passes as a float. A bool never passes as an int."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is not None and (
            not isinstance(value, kind) or (kind is int and isinstance(value, bool))
        ):
            raise UserError(f"{self.path}: metadata {key} is {shown(value)}, not a {kind.__name__}")
        return value

    def items(self, key: str, kind) -> list | None:
        """The list `key` holds, or None where absent.

        Every item must be of type `kind`, else a UserError names the key and the first bad item.
        An int passes as a float. A bool passes as neither."""
        values = self.get(key, list)
        if values is None:
            return None
        allowed = (int, float) if kind is float else kind
        for i, value in enumerate(values):
            if not isinstance(value, allowed) or isinstance(value, bool):
                raise UserError(
                    f"{self.path}: metadata {key} must be a list of {ITEMS[kind]}, but item {i} is "
                    f"{shown(value)}"
                )
        return values

    def need(self, key: str, kind):
        value = self.get(key, kind)
        if value is None:
            raise UserError(f"{self.path}: metadata {key} is missing")
        return value


ITEMS = {str: "strings", int: "integers", float: "numbers"}  # How messages name each list.


def shown(value) -> str:
    """A value as a message shows it: its repr, shortened."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def open_gguf(path: Path):
    """(GGUFReader, Metadata) of a memory-mapped GGUF file. UserError if unreadable or cut short."""
    try:
        import gguf
    except ImportError:
        raise UserError("from-gguf needs the gguf package: pip install gguf") from None
    if not path.is_file():
        raise UserError(f"{path}: no such GGUF file")
    with open(path, "rb") as file:
        if file.read(4) != b"GGUF":
            raise UserError(f"{path} is not a GGUF file (no GGUF magic)")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as e:
        raise UserError(f"{path}: unreadable GGUF file, truncated or corrupt ({e})") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise UserError(f"{path} is truncated: {path.stat().st_size:,} bytes, its tensors {end:,}")
    return reader, Metadata(reader, path)


def model_args(meta: Metadata, reader) -> ModelArgs:
    """The ModelArgs of a llama GGUF, checked like every model's values.

    A UserError names the GGUF key of a value out of range, or a feature picollama lacks."""
    arch = meta.need("general.architecture", str)
    if arch != "llama":
        raise UserError(f"{meta.path}: architecture {arch!r} is not supported (only llama)")
    for key in UNSUPPORTED_KEYS:
        if meta.get(f"llama.{key}") is not None:
            raise UserError(f"{meta.path}: llama.{key} is not supported")
    n_heads = meta.need("llama.attention.head_count", int)
    n_kv = meta.get("llama.attention.head_count_kv", None, n_heads)
    if not isinstance(n_kv, int):  # An array: a different count per layer.
        raise UserError(f"{meta.path}: per-layer llama.attention.head_count_kv is not supported")
    embeddings = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embeddings is None:
        raise UserError(f"{meta.path}: tensor token_embd.weight is missing")
    vocab = meta.get("llama.vocab_size", int)
    args = dict(
        dim=meta.need("llama.embedding_length", int),
        n_layers=meta.need("llama.block_count", int),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        vocab_size=int(embeddings.shape[1]) if vocab is None else vocab,
        ffn_hidden_dim=meta.need("llama.feed_forward_length", int),
        norm_eps=meta.get("llama.attention.layer_norm_rms_epsilon", float, 1e-5),
        rope_theta=meta.get("llama.rope.freq_base", float, 10000.0),
        max_seq_len=meta.get("llama.context_length", int, 2048),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
    )
    if int(embeddings.shape[0]) != args["dim"]:
        raise UserError(
            f"{meta.path}: metadata llama.embedding_length {args['dim']} is not the width of "
            f"tensor token_embd.weight, {int(embeddings.shape[0])}"
        )
    checked(meta, args)  # Before any arithmetic. A head count of 0 would divide by zero.
    args = checked(meta, args | rope_args(meta, reader, args))
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        if meta.get(f"llama.{key}", int, args.head_dim) != args.head_dim:
            raise UserError(
                f"{meta.path}: llama.{key} {meta.get(f'llama.{key}')} is not the head size "
                f"{args.head_dim} (llama.embedding_length {args.dim} / llama.attention.head_count "
                f"{args.n_heads}); one is wrong, or picollama cannot run this model"
            )
    return args


def checked(meta: Metadata, values: dict) -> ModelArgs:
    """Run the range checks that config.json, from-hf and the flags share.

    The UserError keeps their words but names each key as the GGUF does."""
    try:
        return checked_model_args(**values)
    except ValueError as e:
        said = re.sub(r"\b\w+\b", lambda m: GGUF_KEYS.get(m[0], m[0]), str(e))
        raise UserError(f"{meta.path}: metadata {said}") from None


def rope_args(meta: Metadata, reader, args: dict) -> dict:
    """The file's RoPE scaling, read from the metadata (linear, yarn) or from rope_freqs.

    llama.cpp's converter writes llama3 and linear scaling as that tensor of per-frequency
    divisors. We find the scaling that gives them."""
    kind = meta.get("llama.rope.scaling.type", str, "none")
    factor = meta.get("llama.rope.scaling.factor", float, 1.0)
    original = meta.get("llama.rope.scaling.original_context_length", int)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        if kind not in ("none", "linear"):
            raise UserError(
                f"{meta.path}: rope_freqs with rope.scaling.type {kind} is not supported"
            )
        return scaling_of_divisors(meta, np.array(freqs.data, dtype=np.float32), args)
    if kind == "none" or factor == 1.0:
        return {}
    if kind == "linear":
        return dict(rope_scaling="linear", rope_factor=factor)
    if kind == "yarn":
        attn_factor = meta.get("llama.rope.scaling.attn_factor", float)
        if attn_factor not in (None, 1.0) or meta.get("llama.rope.scaling.yarn_log_multiplier"):
            raise UserError(f"{meta.path}: yarn with a custom attention factor is not supported")
        return dict(rope_scaling="yarn", rope_factor=factor, rope_original_max_seq_len=original)
    raise UserError(f"{meta.path}: RoPE scaling type {kind!r} is not supported")


def scaling_of_divisors(meta: Metadata, divisors: np.ndarray, args: dict) -> dict:
    """Linear or llama3 scaling (Llama 3.1's frequency factors 1 and 4) matching rope_freqs."""
    factor = float(divisors.max())
    if not np.isfinite(divisors).all() or factor < 1:  # no scaling divides by less than 1
        raise UserError(f"{meta.path}: its rope_freqs tensor holds divisors below 1 or not finite")
    candidates = [dict(rope_scaling="linear", rope_factor=factor)]
    for original in (8192, 4096, 2048, 16384, args["max_seq_len"] // max(round(factor), 1)):
        candidates.append(
            dict(rope_scaling="llama3", rope_factor=factor, rope_original_max_seq_len=original)
        )
    plain = rope_frequencies(ModelArgs(**args), args["max_seq_len"])[0]
    for candidate in candidates:
        scaled = rope_frequencies(ModelArgs(**args, **candidate), args["max_seq_len"])[0]
        if len(scaled) == len(divisors) and np.allclose(plain / scaled, divisors, rtol=1e-4):
            return candidate
    raise UserError(
        f"{meta.path}: its rope_freqs tensor is not a RoPE scaling picollama implements"
    )


def our_name(name: str, n_layers: int) -> str:
    """Our state-dict key for a GGUF tensor name; UserError for one that is no part of a Llama."""
    base = name.removesuffix(".weight")
    if name.endswith(".weight") and base in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[base] + ".weight"
    parts = base.split(".")
    if (
        name.endswith(".weight")
        and len(parts) == 3
        and parts[0] == "blk"
        and parts[1].isdigit()
        and int(parts[1]) < n_layers
        and parts[2] in LAYER_TENSORS
    ):
        return f"layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.weight"
    raise UserError(f"tensor {name} is not supported (not part of a Llama model)")


def read_weights(reader, path: Path, args: ModelArgs) -> dict:
    """Our float32 state dict, each tensor dequantized on its own from the memory-mapped file.

    GGUF keeps llama wq/wk rows in Meta's interleaved RoPE order. llama.cpp's converter permutes
    Hugging Face's rotate-half rows into it. That order is ours, so there is nothing to undo.
    Transformers' GGUF loader undoes it only because it computes rotate-half."""
    import gguf

    state = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":  # Read by rope_args.
            continue
        name = our_name(tensor.name, args.n_layers)
        kind = gguf.GGMLQuantizationType(tensor.tensor_type)
        try:
            values = gguf.quants.dequantize(tensor.data, kind)
        except NotImplementedError:
            raise UserError(
                f"{path}: tensor type {kind.name} ({tensor.name}) is not supported"
            ) from None
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest axis first.
        # f32 tensors come back as read-only views of the file. Copy them, one at a time.
        values = np.array(values, dtype=np.float32, copy=not values.flags.writeable)
        state[name] = torch.from_numpy(values.reshape(shape))
    return state


def weight_types(reader) -> dict:
    """The GGUF types of the weights, for kernels/load.py: weight_type, the commonest of the
    layers' matrices, and output_type, the output layer's (the embedding's where tied)."""
    import gguf

    kinds = {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors}
    matrices = [
        kinds[t.name] for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) > 1
    ]
    output = kinds.get("output.weight", kinds.get("token_embd.weight"))
    common = max(matrices, key=matrices.count) if matrices else None  # The first of a tie.
    return {"weight_type": common, "output_type": output}


def import_gguf(path: Path, run_dir: Path):
    """Write a llama GGUF file as a run directory of float32 weights, config.json and tokenizer.

    Nothing is written if any part is unsupported."""
    reader, meta = open_gguf(path)
    args = model_args(meta, reader)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = write_tokenizer(meta, path, Path(folder), args.vocab_size)
        try:
            model = model_from_state_dict(args, read_weights(reader, path, args), "its metadata")
        except UserError as e:  # A missing tensor or a wrong shape.
            raise UserError(f"{path}: {e}") from None
        described = {
            key: meta.get(key)
            for key in ("general.name", "general.file_type", "tokenizer.ggml.model")
        }
        kinds = weight_types(reader)
        source = {"converted_from": {"gguf": str(path), "metadata": described, **kinds}}
        with atomic_output(run_dir) as tmp:
            save_model(model, tmp, source, tokenizer=tokenizer)


def write_tokenizer(meta: Metadata, path: Path, folder: Path, vocab_size: int) -> Path:
    """Write the GGUF's tokenizer into `folder` and return its file.

    A `llama` vocabulary becomes a sentencepiece BPE tokenizer.model, a `t5` one a unigram one. A
    `gpt2` (byte-level BPE) one becomes a tokenizer.json. Beside it, tokenizer_config.json holds
    the special tokens, add_bos_token and the chat template."""
    model = meta.get("tokenizer.ggml.model", str)
    tokens = meta.items("tokenizer.ggml.tokens", str)
    for key, value in (("model", model), ("tokens", tokens)):
        if value is None:
            raise UserError(f"{path}: metadata tokenizer.ggml.{key} is missing: no tokenizer")
    if model not in ("llama", "t5", "gpt2"):
        raise UserError(f"{path}: tokenizer {model!r} is not supported (llama, t5 and gpt2 are)")
    if len(tokens) > vocab_size:
        raise UserError(
            f"{path}: the tokenizer has {len(tokens)} tokens but the model {vocab_size} embeddings"
        )

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id", int)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {f"{name}_token": token(key) for name, key in SPECIAL_TOKEN_KEYS}
    config |= {
        # llama.cpp adds BOS to a sentencepiece vocabulary unless it says otherwise.
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token", bool, model == "llama"),
        "add_eos_token": meta.get("tokenizer.ggml.add_eos_token", bool, False),
        "chat_template": meta.get("tokenizer.chat_template", str),
        "clean_up_tokenization_spaces": False,
    }
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if model in ("llama", "t5"):
        file = folder / "tokenizer.model"
        file.write_bytes(sentencepiece_proto(meta, tokens, config))
    else:
        file = folder / "tokenizer.json"
        file.write_text(byte_level_tokenizer(meta, path).to_str())
    return file


# llama.cpp's token types. They equal sentencepiece's (ModelProto.SentencePiece.Type).
TOKEN_TYPES = {1: "normal", 2: "unknown", 3: "control", 4: "user-defined", 5: "unused", 6: "byte"}


def sentencepiece_proto(meta: Metadata, tokens: list[str], config: dict) -> bytes:
    """A serialized sentencepiece model of a `llama` (BPE) or `t5` (unigram) vocabulary.

    llama.cpp's SPM tokenizer is sentencepiece's BPE and its UGM one sentencepiece's unigram, so
    pieces, scores and types copy over as they are. So do the space prefix and UGM's normalizer.
    Byte fallback is on where there are byte tokens."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    scores = meta.items("tokenizer.ggml.scores", float) or [0.0] * len(tokens)
    types = meta.items("tokenizer.ggml.token_type", int) or [1] * len(tokens)
    for key, values in (("scores", scores), ("token_type", types)):
        if len(values) != len(tokens):
            raise UserError(
                f"{meta.path}: metadata tokenizer.ggml.{key} has {len(values)} items, "
                f"tokenizer.ggml.tokens {len(tokens)}"
            )
    bad = next((i for i, kind in enumerate(types) if kind not in TOKEN_TYPES), None)
    if bad is not None:  # Else protobuf says "invalid enumerator 99", naming no key.
        raise UserError(
            f"{meta.path}: metadata tokenizer.ggml.token_type item {bad} is {types[bad]}, not a "
            f"token type (1 to 6: {', '.join(TOKEN_TYPES.values())})"
        )
    proto = pb.ModelProto()
    for piece, score, kind in zip(tokens, scores, types):
        proto.pieces.add(piece=piece, score=float(score), type=int(kind))
    trainer = proto.trainer_spec
    spm = meta.get("tokenizer.ggml.model") == "llama"
    trainer.model_type = pb.TrainerSpec.BPE if spm else pb.TrainerSpec.UNIGRAM
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = 6 in types  # Type 6 is BYTE in both gguf and sentencepiece.
    for key in ("unk", "bos", "eos", "pad"):
        token = config[f"{key}_token"]
        setattr(trainer, f"{key}_piece", token or "")
        setattr(trainer, f"{key}_id", tokens.index(token) if token else -1)
    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = meta.get("tokenizer.ggml.add_space_prefix", bool, spm)
    # llama.cpp reads these two for UGM only. The character map's bytes come as int8 or uint8.
    extra = meta.get("tokenizer.ggml.remove_extra_whitespaces", bool, False)
    normalizer.remove_extra_whitespaces = not spm and extra
    charsmap = meta.items("tokenizer.ggml.precompiled_charsmap", int) or []
    normalizer.precompiled_charsmap = b"" if spm else bytes(value % 256 for value in charsmap)
    normalizer.escape_whitespaces = True
    return proto.SerializeToString()


def byte_level_tokenizer(meta: Metadata, path: Path):
    """The `gpt2` vocabulary as a tokenizers.Tokenizer that splits text as llama.cpp does.

    Transformers' GGUF conversion builds the BPE and most pre-tokenizer splits. It is kept in
    step with llama.cpp's files, so we reuse it rather than redo it. It leaves the GPT-2-regex
    family at GPT-2's plain split, so their digit splits are set here."""

    from tokenizers import pre_tokenizers
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    pre = meta.get("tokenizer.ggml.pre", str, "default")
    if pre not in GPT2_SPLITS and pre not in GGUF_PRE_TOKENIZER_SPLITS:
        raise UserError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported")
    try:
        architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
        tokenizer, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except (KeyError, ValueError, TypeError) as e:
        raise UserError(f"{path}: unreadable gpt2 tokenizer ({type(e).__name__}: {e})") from None
    if pre in GPT2_SPLITS:
        split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        digits = pre_tokenizers.Digits(individual_digits=True)
        tokenizer.pre_tokenizer = (
            pre_tokenizers.Sequence([digits, split]) if GPT2_SPLITS[pre] else split
        )
    return tokenizer
