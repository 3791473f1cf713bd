"""model.attention_gate against its outside definition: one layer of ours equals transformers'
Qwen3NextAttention (gated attention) given the same weights."""

from functools import partial

import pytest
import torch

from model import ModelArgs, Transformer, sdpa_attention
from picollama.convert.hf import interleaved_to_half

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_gated_layer_equals_qwen3_next_attention():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as qwen

    torch.manual_seed(0)
    dim, heads, head_dim, length = 32, 4, 8, 12
    # qk_norm: Qwen3-Next always norms queries and keys (its weights start at 0: a scale of 1)
    args = ModelArgs(
        dim=dim, n_layers=1, n_heads=heads, max_seq_len=16, qk_norm=True, attention_gate=True
    )
    model = Transformer(args)
    ours = model.layers[0].attention
    with torch.no_grad():
        for p in ours.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3)
    config = Qwen3NextConfig(
        hidden_size=dim,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        partial_rotary_factor=1.0,
        rope_theta=args.rope_theta,
        rms_norm_eps=args.norm_eps,
        attn_implementation="eager",
    )
    theirs = qwen.Qwen3NextAttention(config, layer_idx=0).eval()
    half = partial(interleaved_to_half, n_heads=heads)
    # q_proj's rows hold each head's query, then its gate: the gate scales that head's output
    query = half(ours.wq.weight).view(heads, head_dim, dim)
    gate = ours.attention_gate.wg.weight.view(heads, head_dim, dim)
    with torch.no_grad():
        theirs.q_proj.weight.copy_(torch.cat([query, gate], dim=1).reshape(-1, dim))
        theirs.k_proj.weight.copy_(half(ours.wk.weight))
        theirs.v_proj.weight.copy_(ours.wv.weight)
        theirs.o_proj.weight.copy_(ours.wo.weight)

    x = torch.randn(2, length, dim)
    positions = torch.arange(length)
    rotations, _ = model.pos_embeddings(args, positions, positions, None, length)
    with torch.no_grad():
        got = ours(x, rotations, None, partial(sdpa_attention, mask=None))
        cos_sin = qwen.Qwen3NextRotaryEmbedding(config)(x, positions[None])
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
        expected, _ = theirs(x, cos_sin, causal)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the gate matters: without it the layer differs
    with torch.no_grad():
        ours.gates = []
        ungated = ours(x, rotations, None, partial(sdpa_attention, mask=None))
    assert (ungated - expected).abs().max() > 0.1
