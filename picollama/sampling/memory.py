"""What a sampling batch needs in memory: its KV cache and logits, refused before they are made."""

from model import Transformer
from picollama.cli import UserError
from picollama.device import gib
from picollama.sampling.decode import TokenRing

# what each new token of a row costs beside its key, value and id: the sample returned holds it as
# a Python int (a 32-byte object and the list's 8-byte pointer) and as decoded text
SAMPLE_BYTES = 48


def bytes_per_token(model: Transformer) -> int:
    """What each token of a batch holds while it is sampled: its keys and values in every layer,
    and its id."""
    args = model.args
    size = model.tok_embeddings.weight.element_size()  # the activations' (and the cache's) dtype
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * size + 8


def free_bytes(model: Transformer, memory: int | None) -> int | None:
    """The memory left beside the model's weights."""
    if memory is None:
        return None
    tensors = [*model.parameters(), *model.buffers()]
    return memory - sum(t.numel() * t.element_size() for t in tensors)


def prompt_file_limit(model: Transformer, tokenizer, free: int | None) -> int | None:
    """The most bytes of prompts whose tokens' KV cache could fit in `free` bytes, each token
    spelling at most the tokenizer's longest piece."""
    if free is None:
        return None
    pieces = range(tokenizer.get_piece_size())
    longest = max(len(tokenizer.id_to_piece(i).encode()) for i in pieces)
    return max(free, 0) // bytes_per_token(model) * longest


def check_memory(
    model: Transformer,
    rows: int,
    lengths: tuple[int, int],
    sampled: bool,
    free,
    window: int | None = None,
    longest: int | None = None,
    kept: bool = True,
):
    """UserError, before anything is allocated, when `rows` rows of prompts (shortest, longest +
    new tokens) = `lengths` cannot fit in `free` bytes: at least their KV cache (with attention
    sinks, of `window` tokens at most), every token's id (with sinks, the `longest` prompt's and
    TokenRing's few: decoding.generate's buffer), where `kept` each row's new tokens as the sample
    returned (SAMPLE_BYTES; a streamed row keeps none), the first step's logits over the shortest
    prompt (alive while the second step's are made), and where `sampled` (a temperature above 0)
    the float32 logits and probabilities of a step. Every buffer that grows with a flag is
    counted: with sinks and one streamed row, nothing grows with --max-new-tokens."""
    if free is None:
        return
    shortest, total = lengths
    cached = total if window is None else min(total, window)
    ids = total if window is None else min(total, (longest or total) + TokenRing.RING)
    size = model.tok_embeddings.weight.element_size()
    first = min(shortest, cached)
    logits = rows * model.args.vocab_size * ((first + 1) * size + (8 if sampled else 0))
    kv = cached * (bytes_per_token(model) - 8)
    samples = (total - shortest) * SAMPLE_BYTES if kept else 0
    needed = rows * (kv + ids * 8 + samples) + logits
    if needed > free:
        cache = f"KV cache ({cached:,} tokens: --window)" if cached < total else "KV cache"
        raise UserError(
            f"{rows:,} row{'s' * (rows != 1)} of up to {total:,} tokens need at least "
            f"{gib(needed)} for their "
            f"{cache}, token ids and logits, but {gib(free)} of memory is left beside the weights: "
            "lower --num-samples or --max-new-tokens, or give fewer prompts"
        )
