"""Dual Chunk Attention (rope_scaling dca; An et al., "Training-Free Long-Context Scaling of
Large Language Models", ICML 2024), training-free: every relative position a query sees stays
inside the trained context, however long the sequence. registry.py puts dca_attention in
model.py's ROPE_ATTENTIONS. The branches' merge is attention_branches.py's. This module does not
scale RoPE's frequencies (ROPE_INIT gives dca plain RoPE) nor pick keys.

The index rules are those of the paper's code (HKUNLP/ChunkLlama, chunkllama_attn_replace.py).
With c the trained context, the chunk size there is 3c/4, of which the local window w = c/16 (or
rope_window) is kept for locality: the sequence is cut, from position 0, into chunks of
s = 3c/4 - w tokens. Key j sits at j mod s. Query i sits at
- i mod s, over the keys of its own chunk (intra-chunk: the exact distance i - j),
- min(s + i mod s, s + w), over the keys of the chunk just before (successive-chunk: the first w
  queries of a chunk see it at the exact distance, the rest as the inter-chunk queries),
- s + w, over the keys of every earlier chunk (inter-chunk).
So no distance passes s + w = 3c/4. The paper writes the constant as c - 1 with w = c - s (its
Figure 2: s = 6, c = 10). The code uses s + w, one more, and a chunk size of 3c/4, not c.
The first s + w + 1 tokens (3c/4 + 1) see every distance as it is: plain RoPE. At rope_factor 1
model.py does not call DCA."""

from functools import partial

from model import ModelArgs
from picollama.components.attention_branches import (
    branch,
    causal,
    inverse_frequencies,
    key_span,
    merged,
    pairs,
    turns,
)
from picollama.components.windowed_rope import blockwise, turn


def chunk_sizes(args: ModelArgs) -> tuple[int, int]:
    """(s, w): DCA's chunk length s = 3c/4 - w and local window w = c/16 (or rope_window), c the
    trained context, as ChunkLlama's replace_with_chunkllama sets them."""
    window = args.rope_window or args.original_seq_len // 16
    chunk = 3 * args.original_seq_len // 4 - window
    if not 0 < window < chunk:
        raise ValueError(
            f"dca's local window ({window}) must be positive and below its chunk, 3/4 of "
            f"original_seq_len less the window ({chunk})"
        )
    return chunk, window


class DualChunk:
    """DCA over the queries at `positions` ((T,) or (B, T)) and the keys at `key_positions`.

    The keys arrive turned to their own positions, as the KV cache holds them. Rotations compose,
    so each branch turns its queries by the difference from their positions to the ones the
    branch gives them, and the inter-chunk keys back by whole chunks (j to j mod s)."""

    def __init__(self, args: ModelArgs, positions, key_positions):
        self.chunk, self.window = chunk_sizes(args)
        self.positions, self.key_positions = positions, key_positions
        s, w, inv_freq = self.chunk, self.window, inverse_frequencies(args, positions.device)
        self.successive_turn = turns(inv_freq, (w - positions % s).clamp(max=0))
        self.inter_turn = turns(inv_freq, s + w - positions)
        self.key_turn = turns(inv_freq, -(key_positions // s) * s)

    def attend(self, q, k, v, attention):
        """Attention of queries (B, heads, T, head_dim) over keys and values (B, kv heads, S,
        head_dim), all turned as usual. A layer that does not rotate attends plain causal."""
        far_k = turn(k, self.key_turn) if attention.rotary else None
        return blockwise(partial(self.block, k=k, far_k=far_k, v=v), q, k.shape[2])

    def block(self, q, first: int, k, far_k, v):
        """The attention of the queries first.. (q), merged from the three branches, each over
        the keys of the chunks it may see."""
        rows = slice(first, first + q.shape[2])
        positions, keys, s = self.positions[..., rows], self.key_positions, self.chunk
        if far_k is None:
            return causal(q, k, v, positions, keys)
        low, high = int(positions.min()) // s * s, int(positions.max()) // s * s
        branches = [
            (intra_chunk, None, k, key_span(keys, low, high + s)),
            (successive_chunk, self.successive_turn, k, key_span(keys, low - s, high)),
            (inter_chunk, self.inter_turn, far_k, key_span(keys, 0, high - s)),
        ]
        parts = []
        for sees, turns_to, key, span in branches:
            if span.stop > span.start:
                at = keys[..., span]
                allowed = sees(pairs(positions, at), pairs(positions // s, at // s))
                query = q if turns_to is None else turn(q, turns_to[..., rows, :])
                parts.append(branch(query, key[:, :, span], v[:, :, span], allowed))
        return merged(parts).type_as(q)


def intra_chunk(distance, ahead):
    """The keys of the query's own chunk, up to it (ahead: chunks the query's is past the key's)."""
    return (ahead == 0) & (distance >= 0)


def successive_chunk(distance, ahead):
    return ahead == 1


def inter_chunk(distance, ahead):
    return ahead > 1


def dca_attention(args: ModelArgs, positions, key_positions):
    """The attention function of a forward past the context (model.ROPE_ATTENTIONS)."""
    return DualChunk(args, positions, key_positions).attend


dca_attention.stretch_only = True  # rope_factor turns DCA on and maps no distance (length.py)
