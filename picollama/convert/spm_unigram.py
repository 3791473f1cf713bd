"""Unigram sentencepiece tokenizers in other tools' formats.

These come from data/prepare.py --tokenizer-type unigram. To-hf writes them as a Hugging Face
tokenizer.json. To-gguf writes them as llama.cpp's unigram tokenizer."""

from picollama.cli import UserError

# llama.cpp's unigram tokenizer has no byte fallback while this issue is open. A character that
# no piece covers becomes <unk> there, where sentencepiece gives its UTF-8 bytes as byte pieces.
# A run of such characters becomes one <unk>. Its fix is pull request 28864.
LLAMA_CPP_BYTE_FALLBACK = "https://github.com/ggml-org/llama.cpp/issues/28862"


def unigram_proto(tokenizer):
    """The ModelProto of a sentencepiece unigram model, or None for another tokenizer."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    if not hasattr(tokenizer, "serialized_model_proto"):
        return None
    proto = pb.ModelProto.FromString(tokenizer.serialized_model_proto())
    return proto if proto.trainer_spec.model_type == pb.TrainerSpec.UNIGRAM else None


def is_unigram(tokenizer) -> bool:
    """Whether a tokenizer is a sentencepiece unigram model (not BPE, not a tokenizer.json)."""
    return unigram_proto(tokenizer) is not None


def unigram_json(tokenizer, bos: bool) -> str:
    """A unigram sentencepiece model as a tokenizer.json that encodes as sentencepiece does.

    It runs Viterbi over the pieces' scores and falls back to bytes. Text is kept as it is, with
    spaces as ▁. BOS is added when `bos`. We need this because Transformers 5 reads tokenizer.model
    into its BPE Llama tokenizer, which splits a unigram model's text differently."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram

    size = tokenizer.get_piece_size()
    vocab = [(tokenizer.id_to_piece(i), tokenizer.get_score(i)) for i in range(size)]
    result = Tokenizer(Unigram(vocab, unk_id=tokenizer.unk_id(), byte_fallback=True))
    result.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=False)
    replace = decoders.Replace("\u2581", " ")
    result.decoder = decoders.Sequence([replace, decoders.ByteFallback(), decoders.Fuse()])
    control = [i for i in range(size) if tokenizer.is_control(i) or tokenizer.is_unknown(i)]
    result.add_special_tokens([AddedToken(vocab[i][0], special=True) for i in control])
    if bos:
        piece = tokenizer.id_to_piece(tokenizer.bos_id())
        result.post_processor = processors.TemplateProcessing(
            single=f"{piece} $A",
            pair=f"{piece} $A {piece} $B",
            special_tokens=[(piece, tokenizer.bos_id())],
        )
    return result.to_str()


def check_gguf_unigram(tokenizer):
    """UserError for a unigram model whose spaces llama.cpp's unigram tokenizer would misplace.

    That tokenizer writes each space as ▁ before the text that follows. GGUF has no key to say
    otherwise."""
    proto = unigram_proto(tokenizer)
    if proto is None:
        return
    suffix = proto.trainer_spec.treat_whitespace_as_suffix
    if suffix or not proto.normalizer_spec.escape_whitespaces:
        raise UserError(
            "to-gguf: llama.cpp's unigram tokenizer writes each space as ▁ before the text that "
            "follows, and this tokenizer was trained to keep spaces or put them after it "
            "(escape_whitespaces off or treat_whitespace_as_suffix on)"
        )


def add_gguf_unigram(writer, tokenizer):
    """Add the keys that make llama.cpp read a unigram model's vocabulary as its "t5" tokenizer.

    llama.cpp picks its tokenizer by this name alone, under any architecture. "t5" is UGM, which
    runs sentencepiece's Viterbi over the same pieces and scores. The normalizer goes over as
    sentencepiece's compiled character map (none for ours, which keep text as it is), with its
    space prefix and whitespace settings. UGM has no byte fallback (LLAMA_CPP_BYTE_FALLBACK)."""
    check_gguf_unigram(tokenizer)
    normalizer = unigram_proto(tokenizer).normalizer_spec
    writer.add_tokenizer_model("t5")
    if normalizer.precompiled_charsmap:  # gguf refuses an empty array.
        writer.add_precompiled_charsmap(normalizer.precompiled_charsmap)
    writer.add_add_space_prefix(normalizer.add_dummy_prefix)
    writer.add_remove_extra_whitespaces(normalizer.remove_extra_whitespaces)
