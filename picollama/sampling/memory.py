"""What a sampling batch needs in memory, mostly its KV cache and logits.

A batch that cannot fit is refused with a UserError before anything is allocated."""

from model import Transformer
from picollama.cli import UserError
from picollama.device import gib
from picollama.sampling.decode import TokenRing

# What each new token of a row costs beyond its key, value and id. The returned sample holds it
# as a Python int, a 32-byte object plus the list's 8-byte pointer. It also holds decoded text.
SAMPLE_BYTES = 48


def bytes_per_token(model: Transformer) -> int:
    """The bytes each token of a batch holds while sampled: keys and values in every layer, and
    its id."""
    args = model.args
    size = model.tok_embeddings.weight.element_size()  # The activations' dtype, as the cache's.
    return 2 * args.n_layers * args.n_kv_heads * args.head_dim * size + 8


def free_bytes(model: Transformer, memory: int | None) -> int | None:
    """The memory left beside the model's weights."""
    if memory is None:
        return None
    tensors = [*model.parameters(), *model.buffers()]
    return memory - sum(t.numel() * t.element_size() for t in tensors)


def prompt_file_limit(model: Transformer, tokenizer, free: int | None) -> int | None:
    """The most bytes of prompts whose tokens' KV cache could fit in `free` bytes.

    Each token spells at most the tokenizer's longest piece."""
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
    """UserError, before anything is allocated, when a batch cannot fit in `free` bytes.

    There are `rows` rows. `lengths` is (shortest prompt, longest prompt + new tokens). We count
    at least these:
    - the KV cache, of at most `window` tokens with attention sinks.
    - each token's id. With sinks, only the `longest` prompt's and TokenRing's few.
    - each row's new tokens in the returned sample, where `kept` (SAMPLE_BYTES).
    - the first step's logits over the shortest prompt, alive while the second step's are made.
    - a step's float32 logits and probabilities, where `sampled` (a temperature above 0).
    Every buffer that grows with a flag is counted. With sinks and one streamed row, nothing
    grows with --max-new-tokens."""
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
