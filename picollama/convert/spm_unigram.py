"""Unigram sentencepiece tokenizers (data/prepare.py --tokenizer-type unigram) where other tools
read them: as a Hugging Face tokenizer.json, and refused for GGUF."""

from picollama.cli import UserError


def is_unigram(tokenizer) -> bool:
    """Whether a tokenizer is a sentencepiece unigram model (not BPE, not a tokenizer.json)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    if not hasattr(tokenizer, "serialized_model_proto"):
        return False
    proto = pb.ModelProto.FromString(tokenizer.serialized_model_proto())
    return proto.trainer_spec.model_type == pb.TrainerSpec.UNIGRAM


def unigram_json(tokenizer, bos: bool) -> str:
    """A unigram sentencepiece model as a tokenizer.json that encodes as sentencepiece does
    (Viterbi over the pieces' scores, bytes for what no piece covers; the text as it is, spaces as
    ▁), adding BOS when `bos`. Transformers 5 reads tokenizer.model into its BPE Llama tokenizer,
    which splits a unigram model's text otherwise."""
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


def refuse_gguf_unigram(tokenizer):
    """UserError for a unigram sentencepiece model: llama.cpp's unigram tokenizer has no byte
    fallback (a character no piece covers becomes <unk>), and its sentencepiece one merges BPE's
    way, so neither would encode as the model was trained."""
    if is_unigram(tokenizer):
        raise UserError(
            "to-gguf takes BPE sentencepiece tokenizers: this run's is a unigram one, which "
            "llama.cpp would not encode as it was trained (no byte fallback); to-hf exports it, "
            "or train on a dataset prepared with --tokenizer-type bpe"
        )
