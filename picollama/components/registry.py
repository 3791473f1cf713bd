"""The one registry: it puts every component besides LLaMA's into model.py's tables.

model.py fills its tables with LLaMA's own parts only. The leaves of this package define the
others and fill nothing when imported. This module fills the rest in plain statements, in the
order messages list the choices. Whatever builds a model from settings imports it, through
picollama/config/model_args.py.

The lists of choices are derived from the tables at the end, never written out. So a new entry
takes a definition in a leaf and a line here. Flags, config checks and messages follow."""

import torch.nn.functional as F
from torch import nn

from model import (
    ACTIVATIONS,
    ATTENTION_WRAPS,
    ATTENTIONS,
    BLOCKS,
    INITS,
    NORMS,
    OUTPUT_GATES,
    POSITIONS,
    QUERY_SCALES,
    ROPE_ATTENTIONS,
    ROPE_INIT,
    FeedForward,
    Positions,
    plain_rope,
)
from picollama.components import (
    attention_gate,
    dca,
    length_encodings,
    reattention,
    rope_scaling,
    variants,
    windowed_rope,
)

# variants.py: the alternatives the seed lectures teach
NORMS["layernorm"] = nn.LayerNorm  # (x − mean) / std · γ + β
INITS["norm.bias"] = nn.init.zeros_  # LayerNorm's β starts at 0
ACTIVATIONS["geglu"] = FeedForward, F.gelu
ACTIVATIONS["reglu"] = FeedForward, F.relu
ACTIVATIONS["gelu"] = variants.MLP, F.gelu
ACTIVATIONS["relu"] = variants.MLP, F.relu
ACTIVATIONS["relu2"] = variants.MLP, variants.relu2
BLOCKS["pre", True] = variants.ParallelBlock
BLOCKS["post", False] = variants.PostNormBlock
BLOCKS["post", True] = variants.ParallelPostNormBlock
BLOCKS["sandwich", False] = variants.SandwichBlock
BLOCKS["sandwich", True] = variants.ParallelSandwichBlock
ATTENTION_WRAPS.append(variants.logn_attention)  # it leaves attend as is unless logn_attention
POSITIONS["alibi"] = variants.ALiBi
POSITIONS["nope"] = Positions  # the interface itself adds no positions
POSITIONS["sinusoidal"] = variants.Sinusoidal
POSITIONS["learned"] = variants.LearnedPositions

# rope_scaling.py: RoPE's frequencies scaled to run past the training context
ROPE_INIT["linear"] = rope_scaling.linear
ROPE_INIT["ntk"] = rope_scaling.ntk
ROPE_INIT["dynamic"] = rope_scaling.dynamic
ROPE_INIT["yarn"] = rope_scaling.yarn
ROPE_INIT["llama3"] = rope_scaling.llama3

# windowed_rope.py: RoPE's frequencies as they are, and far keys attended apart
ROPE_INIT["rerope"] = plain_rope
ROPE_ATTENTIONS["rerope"] = windowed_rope.windowed_attention
ROPE_INIT["self_extend"] = plain_rope
ROPE_ATTENTIONS["self_extend"] = windowed_rope.windowed_attention
ROPE_INIT["rerope_topk"] = plain_rope
ROPE_ATTENTIONS["rerope_topk"] = windowed_rope.windowed_attention

# dca.py, reattention.py: RoPE's frequencies as they are, each key at a position kept in range
ROPE_INIT["dca"] = plain_rope
ROPE_ATTENTIONS["dca"] = dca.dca_attention
ROPE_INIT["reattention"] = plain_rope
ROPE_ATTENTIONS["reattention"] = reattention.reattention_attention

# length_encodings.py: the trained length encodings
POSITIONS["prope"] = length_encodings.PRoPE
POSITIONS["fox"] = length_encodings.ForgetPositions  # FoX has no positions but its forget gates
ATTENTIONS["fox"] = length_encodings.ForgettingAttention
QUERY_SCALES["ssmax"] = length_encodings.SSMax
INITS["wf.bias"] = nn.init.zeros_  # FoX's forget gates start at σ(0) = 1/2, as its code's
INITS["ssmax.scale"] = length_encodings.as_made

# attention_gate.py: gated attention
OUTPUT_GATES["attention_gate"] = attention_gate.AttentionGate

# The lists derived from the tables, for flags, config checks and messages.
ROPE_SCALINGS = tuple(ROPE_INIT)  # rope_scaling's choices
WINDOWED = tuple(ROPE_ATTENTIONS)  # the scalings that attend in branches
PLACEMENTS = tuple(dict.fromkeys(placement for placement, _ in BLOCKS))  # norm_placement's
