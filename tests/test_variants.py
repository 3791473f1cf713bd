"""model.py's architecture switches and position encodings: each against its definition or the seed
lectures' numbers, and every one against itself (cached decode, chunked prefill, causality, given
positions)."""

import math

import pytest
import torch
import torch.nn.functional as F

from model import (
    ACTIVATIONS,
    NORMS,
    FeedForward,
    ModelArgs,
    Transformer,
    apply_rotary,
    sdpa_attention,
)
from picollama.cli.command import run_command
from picollama.components.variants import MLP, ALiBi, Sinusoidal, given_up, switches
from picollama.config.model_args import checked_model_args
from picollama.convert import hf as hf_format
from picollama.convert import main as convert
from picollama.run_files import save_model

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, max_seq_len=32, multiple_of=16
)
VARIANTS = {
    "llama": {},
    "layernorm": dict(norm="layernorm"),
    "post": dict(norm_placement="post"),
    "sandwich": dict(norm_placement="sandwich"),
    "parallel": dict(parallel_block=True),
    "parallel-sandwich": dict(parallel_block=True, norm_placement="sandwich", norm="layernorm"),
    **{name: dict(activation=name) for name in ACTIVATIONS if name != "swiglu"},
    "qk_norm": dict(qk_norm=True),
    "attention_gate": dict(attention_gate=True),
    "softcap": dict(logit_softcap=2.0),
    "alibi": dict(position="alibi"),
    "alibi-6-heads": dict(position="alibi", dim=48, n_heads=6, n_kv_heads=3),
    "nope": dict(position="nope"),
    "sinusoidal": dict(position="sinusoidal"),
    "learned": dict(position="learned"),
    "rope_fraction": dict(rope_fraction=0.5),
    "nope_every": dict(nope_every=2),
    "logn": dict(logn_attention=True, rope_original_max_seq_len=8),
    "logn-alibi": dict(position="alibi", logn_attention=True, rope_original_max_seq_len=8),
    "yarn-partial": dict(rope_scaling="yarn", rope_factor=4.0, rope_fraction=0.5),
}
POSITIONS = ["llama", "alibi", "sinusoidal", "learned", "rope_fraction", "nope_every", "logn"]


def make_model(seed=0, std=0.3, **overrides) -> Transformer:
    """A tiny model with larger weights than the init's, so that attention is sharp and positions
    matter."""
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, std)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)  # LayerNorm's β, away from its zero init
    return model


def rotations(model: Transformer, end: int) -> torch.Tensor:
    """RoPE's rotations of positions 0..end-1 in the model."""
    return model.pos_embeddings.rotations(model.args, end, "cpu")


def sinusoid(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """The sinusoidal encoding of `positions`: what it adds to all-zero token embeddings."""
    return Sinusoidal(ModelArgs(dim=dim, n_heads=1)).embed(torch.zeros(dim), positions)


def alibi_bias(n_heads: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """ALiBi's bias ([B,] heads, T, S) for queries at q_pos over keys at k_pos."""
    args = ModelArgs(dim=8 * n_heads, n_heads=n_heads, position="alibi")
    return ALiBi(args)(args, q_pos, k_pos, None, None)[1].keywords["mask"]  # sdpa's


# ---------------------------------------------------------------- the seed lectures' worked numbers


def test_layernorm_worked_example():
    y = NORMS["layernorm"](4, eps=0.0)(torch.tensor([2.0, -1.0, 3.0, 0.0]))
    assert torch.allclose(y, torch.tensor([0.632, -1.265, 1.265, -0.632]), atol=1e-3)


def test_layernorm_has_its_bias():
    norm = NORMS["layernorm"](4, eps=0.0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 1.0, 1.0]))
        norm.bias.copy_(torch.tensor([0.0, 0.0, 0.5, 0.0]))
    y = norm(torch.tensor([2.0, -1.0, 3.0, 0.0]))
    assert torch.allclose(y, torch.tensor([0.632, -2.530, 1.765, -0.632]), atol=1e-3)


def test_relu_ffn_worked_example():
    # the lecture's scalar FFN: x=1.5, W1=2.0, b1=0.5, W2=3.0, b2=0 -> W2·ReLU(W1·x + b1) = 3·3.5 =
    # 10.5, where SwiGLU with the same numbers gives 15.28 (tests/test_model.py). The bias rides on
    # a constant input of 1.
    ffn = MLP(dim=2, hidden_dim=1, act=F.relu)
    with torch.no_grad():
        ffn.w1.weight.copy_(torch.tensor([[2.0, 0.5]]))
        ffn.w2.weight.copy_(torch.tensor([[3.0], [0.0]]))
    assert abs(ffn(torch.tensor([1.5, 1.0]))[0].item() - 10.5) < 1e-3


# ------------------------------------------------------------ each switch against its definition

DEFINITIONS = {
    "swiglu": lambda z: z * torch.sigmoid(z),
    "geglu": lambda z: 0.5 * z * (1 + torch.erf(z / math.sqrt(2))),
    "reglu": lambda z: z.clamp(min=0),
    "gelu": lambda z: 0.5 * z * (1 + torch.erf(z / math.sqrt(2))),
    "relu": lambda z: z.clamp(min=0),
    "relu2": lambda z: z.clamp(min=0) ** 2,
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_each_activation_equals_its_definition(name):
    torch.manual_seed(0)
    ffn_class, act = ACTIVATIONS[name]
    ffn = ffn_class(8, 16, act)
    x = torch.randn(3, 8)
    w1, w2 = ffn.w1.weight, ffn.w2.weight
    hidden = DEFINITIONS[name](x @ w1.T)
    gated = name in ("swiglu", "geglu", "reglu")
    assert isinstance(ffn, FeedForward) == gated
    if gated:
        hidden = hidden * (x @ ffn.w3.weight.T)
    torch.testing.assert_close(ffn(x), hidden @ w2.T)


def test_gated_and_plain_ffns_have_comparable_parameter_counts(capsys):
    counts = {}
    for name in ACTIVATIONS:
        args = ModelArgs(dim=192, n_layers=4, n_heads=4, vocab_size=4096, activation=name)
        counts[name] = (
            args.hidden_dim,
            sum(p.numel() for p in Transformer(args).layers[0].feed_forward.parameters()),
        )
    with capsys.disabled():
        print(
            "\nFFN per layer at dim 192:",
            ", ".join(f"{k} hidden {h}: {n:,}" for k, (h, n) in counts.items()),
        )
    # 2/3·4·dim
    assert counts["swiglu"] == counts["geglu"] == counts["reglu"] == (512, 3 * 192 * 512)
    assert counts["relu"] == counts["gelu"] == counts["relu2"] == (768, 2 * 192 * 768)  # 4·dim
    assert 3 * 192 * 512 == 2 * 192 * 768
    # rounding to 16
    tiny = {name: ModelArgs(**TINY, activation=name).hidden_dim for name in ("swiglu", "relu")}
    assert tiny == {"swiglu": 96, "relu": 128}
    assert ModelArgs(**TINY, activation="relu", ffn_dim_multiplier=1.5).hidden_dim == 192


@pytest.mark.parametrize("norm", list(NORMS))
def test_post_norm_output_is_normalised(norm):
    model = make_model(norm_placement="post", norm=norm)
    block = model.layers[0]
    # γ = 1 (and β = 0): the plain norm
    for p in (block.attention_norm.weight, block.ffn_norm.weight):
        assert torch.equal(p, torch.ones_like(p))
    if norm == "layernorm":
        torch.nn.init.zeros_(block.ffn_norm.bias)
    x = torch.randn(2, 5, 32) * 3 + 1
    freqs_cis = rotations(model, 5)
    with torch.no_grad():
        out = block(x, freqs_cis, None, sdpa_attention)
    if norm == "layernorm":
        torch.testing.assert_close(out.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)
        torch.testing.assert_close(out.var(-1, unbiased=False), torch.ones(2, 5), atol=1e-3, rtol=0)
    else:
        torch.testing.assert_close(out.pow(2).mean(-1), torch.ones(2, 5), atol=1e-3, rtol=0)
    assert isinstance(model.norm, torch.nn.Identity)  # the blocks' output is already normalised


@pytest.mark.parametrize(
    "switches, formula",
    [
        (
            dict(),
            lambda b, x, attn: (h := x + attn(b.attention_norm(x))) + b.feed_forward(b.ffn_norm(h)),
        ),
        (
            dict(norm_placement="post"),
            lambda b, x, attn: b.ffn_norm((h := b.attention_norm(x + attn(x))) + b.feed_forward(h)),
        ),
        (
            dict(norm_placement="sandwich"),
            lambda b, x, attn: (
                (h := x + b.post_attention_norm(attn(b.attention_norm(x))))
                + b.post_ffn_norm(b.feed_forward(b.ffn_norm(h)))
            ),
        ),
        (
            dict(parallel_block=True),
            lambda b, x, attn: x + attn(b.attention_norm(x)) + b.feed_forward(b.attention_norm(x)),
        ),
    ],
    ids=["pre", "post", "sandwich", "parallel"],
)
def test_block_equals_its_formula(switches, formula):
    model = make_model(norm="layernorm", **switches)
    block = model.layers[0]
    x = torch.randn(2, 6, 32)
    freqs_cis = rotations(model, 6)
    with torch.no_grad():
        expected = formula(block, x, lambda h: block.attention(h, freqs_cis, None, sdpa_attention))
        torch.testing.assert_close(block(x, freqs_cis, None, sdpa_attention), expected)
    if switches.get("parallel_block"):
        assert block.ffn_norm is None  # one norm, read by both sublayers


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys(qk_norm):
    model = make_model(qk_norm=qk_norm)
    tokens = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        before = model(tokens)
        for layer in model.layers:
            layer.attention.wq.weight.mul_(10.0)
            layer.attention.wk.weight.mul_(3.0)
        assert torch.allclose(model(tokens), before, atol=1e-4, rtol=1e-4) == qk_norm
    if qk_norm:
        assert model.layers[0].attention.q_norm.weight.shape == (8,)  # per head


def test_logit_softcap_is_cap_tanh_logits_over_cap():
    capped, plain = make_model(logit_softcap=2.0), make_model()
    plain.load_state_dict(capped.state_dict())
    tokens = torch.randint(0, 50, (2, 10))
    with torch.no_grad():
        raw = plain(tokens)
        assert raw.abs().max() > 4  # the cap matters
        torch.testing.assert_close(capped(tokens), 2.0 * torch.tanh(raw / 2.0))
        assert capped(tokens).abs().max() < 2.0


# ---------------------------------------------------------------- positions


def test_sinusoid_equals_the_formula():
    pe = sinusoid(torch.tensor([0, 1, 2, 1000]), dim=4)  # any position: no table to run past
    expected = [
        [0.0, 1.0, 0.0, 1.0],
        [0.841, 0.540, 0.010, 1.000],  # sin 1, cos 1, sin(1/100), cos(1/100)
        [0.909, -0.416, 0.020, 1.000],
        [0.827, 0.562, -0.544, -0.839],  # sin 1000, cos 1000, sin 10, cos 10
    ]
    torch.testing.assert_close(pe, torch.tensor(expected), atol=1e-3, rtol=0)


def test_alibi_slopes_and_bias():
    slopes = -alibi_bias(8, torch.arange(2), torch.arange(2))[:, 1, 0]
    torch.testing.assert_close(slopes, torch.tensor([2.0**-i for i in range(1, 9)]))
    # 6 heads, as Press et al.'s get_slopes(6): those of 4 heads, then every other one of 8 heads'
    six = -alibi_bias(6, torch.arange(2), torch.arange(2))[:, 1, 0]
    torch.testing.assert_close(six, torch.tensor([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]))
    # queries at 3..5 over keys 0..5 (a cached chunk)
    bias = alibi_bias(4, torch.arange(3, 6), torch.arange(6))
    assert bias.shape == (4, 3, 6)
    torch.testing.assert_close(bias[0, 0, :4], torch.tensor([-0.75, -0.5, -0.25, 0.0]))  # slope 1/4
    assert torch.isinf(bias[:, 0, 4:]).all() and not torch.isinf(bias[:, 2]).any()


def test_nope_every_k_th_layer():
    model = make_model(n_layers=6, nope_every=3)
    rotary = [layer.attention.rotary for layer in model.layers]
    # layers i with (i+1) % 3 == 0 have no positions
    assert rotary == [True, True, False, True, True, False]


def test_partial_rotary_leaves_the_last_dimensions_alone():
    model = make_model(rope_fraction=0.25)
    freqs_cis = rotations(model, 5)
    assert freqs_cis.shape == (5, 1)  # 8-dim heads: one pair of dimensions rotates
    x = torch.randn(1, 5, 4, 8)
    rotated = apply_rotary(x, freqs_cis)
    assert torch.equal(rotated[..., 2:], x[..., 2:]) and not torch.allclose(
        rotated[..., :2], x[..., :2]
    )
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))


def test_logn_scales_queries_past_the_training_context(monkeypatch):
    queries, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(
        "model.SDPA_KERNEL", lambda q, *a, **k: queries.append(q) or sdpa(q, *a, **k)
    )
    logn, plain = make_model(logn_attention=True, rope_original_max_seq_len=8), make_model()
    plain.load_state_dict(logn.state_dict())
    tokens = torch.randint(0, 50, (1, 20))
    with torch.no_grad():
        logn(tokens)
        plain(tokens)
    # layer 0 of each model, per position
    ratio = (queries[0] / queries[len(queries) // 2])[0, 0, :, 0]
    n = torch.arange(1, 21, dtype=torch.float32)  # 1-based position
    torch.testing.assert_close(ratio, (n.log() / math.log(8)).clamp(min=1))
    # n = 8 = L_train is the last unscaled one
    assert ratio[:8].sub(1).abs().max() < 1e-6 and ratio[8] > 1.05


# ---------------------------------------------------------------- every switch against itself


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_decode_equals_full_forward(name):
    model = make_model(**VARIANTS[name])
    tokens = torch.randint(0, 50, (2, 30))
    model.setup_cache(max_batch_size=2, max_seq_len=32)
    with torch.no_grad():
        full = model(tokens)
        # prefill, chunked prefill
        chunks = [model(tokens[:, :9], start_pos=0), model(tokens[:, 9:20], start_pos=9)]
        chunks += [model(tokens[:, p : p + 1], start_pos=p) for p in range(20, 30)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_causality(name):
    model = make_model(**VARIANTS[name])
    tokens = torch.randint(0, 50, (1, 20))
    changed = tokens.clone()
    changed[0, 12] = (changed[0, 12] + 1) % 50
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_trains_under_bf16_autocast(name):
    model = make_model(**VARIANTS[name], std=0.02).train()
    tokens = torch.randint(0, 50, (2, 17))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens[:, :-1], targets=tokens[:, 1:])
    loss.backward()
    assert math.isfinite(loss.item()) and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "name", ["llama", "alibi", "nope", "rope_fraction", "nope_every", "yarn-partial"]
)
def test_shifted_positions_change_nothing_for_relative_encodings(name):
    model = make_model(**VARIANTS[name])
    tokens = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens, positions=torch.arange(5, 17)), model(tokens), atol=1e-4, rtol=0
        )


def test_given_positions_are_the_rotary_positions():
    # linear RoPE scaling divides every angle by its factor, so positions 0, 2, 4, ... under factor
    # 2 are the default positions 0, 1, 2, ... unscaled
    plain, stretched = make_model(), make_model(rope_scaling="linear", rope_factor=2.0)
    tokens = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(
            stretched(tokens, positions=2 * torch.arange(20)), plain(tokens), atol=1e-5, rtol=0
        )
        assert not torch.allclose(stretched(tokens), plain(tokens), atol=1e-3)


@pytest.mark.parametrize("name", POSITIONS)
def test_positions_per_row_equal_each_row_alone(name):
    model = make_model(**VARIANTS[name])
    tokens = torch.randint(0, 50, (2, 10))
    generator = torch.Generator().manual_seed(0)
    positions = torch.stack(
        [torch.randperm(32, generator=generator)[:10].sort().values for _ in range(2)]
    )
    with torch.no_grad():
        both = model(tokens, positions=positions)
        for row in range(2):
            torch.testing.assert_close(
                both[row], model(tokens[row : row + 1], positions=positions[row])[0]
            )
        assert not torch.allclose(both, model(tokens), atol=1e-3)  # the positions matter


@pytest.mark.parametrize("name", ["sinusoidal", "learned"])
def test_absolute_positions_are_added_to_the_embeddings(name, monkeypatch):
    model = make_model(**VARIANTS[name])
    tokens, positions = torch.randint(0, 50, (1, 4)), torch.tensor([3, 9, 10, 30])
    seen = []
    model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        model(tokens, positions=positions)
        table = (
            sinusoid(positions, 32)
            if name == "sinusoidal"
            else model.pos_embeddings.weight[positions]
        )
        # the Transformer's √dim on tokens beside a sinusoid
        scale = math.sqrt(32) if name == "sinusoidal" else 1.0
        torch.testing.assert_close(seen[0], model.tok_embeddings(tokens) * scale + table)


def test_learned_positions_end_at_max_seq_len():
    model = make_model(position="learned")
    model(torch.zeros(1, 32, dtype=torch.long))
    with pytest.raises(ValueError, match="position 32 is past the learned positions"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="position 40 is past"):
        model(torch.zeros(1, 2, dtype=torch.long), positions=torch.tensor([3, 40]))
    model.setup_cache(max_batch_size=1, max_seq_len=40)
    with pytest.raises(ValueError, match="past the learned positions"):
        model(torch.zeros(1, 1, dtype=torch.long), start_pos=32)


def test_positions_and_the_kv_cache_do_not_mix():
    model = make_model()
    model.setup_cache(max_batch_size=1, max_seq_len=32)
    with pytest.raises(ValueError, match="without the KV cache"):
        model(torch.zeros(1, 2, dtype=torch.long), start_pos=0, positions=torch.arange(2))


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(norm="batchnorm"), "norm must be one of rmsnorm, layernorm, not 'batchnorm'"),
        (dict(norm_placement="middle"), "norm_placement must be one of pre, post, sandwich"),
        (
            dict(activation="tanh"),
            "activation must be one of swiglu, geglu, reglu, gelu, relu, relu2",
        ),
        (dict(position="t5"), "position must be one of rope, alibi, nope, sinusoidal, learned"),
        (dict(parallel_block="yes"), "parallel_block must be one of False, True"),
        (dict(qk_norm=2), "qk_norm must be one of False, True"),
        (dict(logn_attention="no"), "logn_attention must be one of False, True"),
        (dict(logit_softcap=-1.0), "logit_softcap must be a finite number >= 0"),
        (dict(logit_softcap=math.inf), "logit_softcap must be a finite number >= 0"),
        (dict(rope_fraction=0.0), r"rope_fraction must be in \(0, 1\]"),
        (dict(rope_fraction=1.5), r"rope_fraction must be in \(0, 1\]"),
        (
            dict(rope_fraction=0.3),
            r"head_dim \(8\) and head_dim·rope_fraction \(2.4\) must be even",
        ),
        (dict(rope_fraction=0.125), r"head_dim·rope_fraction \(1\) must be even"),
        (dict(nope_every=-1), "nope_every must be >= 0"),
        (
            dict(position="alibi", rope_scaling="yarn", rope_factor=2.0),
            "rope_scaling applies to position = 'rope'",
        ),
        (
            dict(position="learned", rope_fraction=0.5),
            r"rope_fraction applies to position = 'rope' only \(or 'prope'\), not to",
        ),
        (
            dict(position="nope", nope_every=2),
            r"nope_every applies to position = 'rope' only \(or 'prope'\), "
            "not to position = 'nope'",
        ),
    ],
)
def test_bad_switches_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        checked_model_args(**{**TINY, **kwargs})


def test_a_non_rope_model_needs_no_even_head_size():
    assert checked_model_args(dim=15, n_heads=5, position="alibi").head_dim == 3
    make_model(dim=12, n_heads=4, n_kv_heads=4, position="sinusoidal")(
        torch.zeros(1, 3, dtype=torch.long)
    )


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "llama"])
def test_hf_export_refuses_what_llama_cannot_express(name):
    model = make_model(**VARIANTS[name])
    key = next(k for k in switches() if k in VARIANTS[name])
    with pytest.raises(ValueError, match=f"no model.{key} = "):
        hf_format.hf_config(model.args)
    with pytest.raises(ValueError, match=f"no model.{key} = "):
        hf_format.to_hf_state_dict(model)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_switch_says_what_it_gives_up_and_llama_nothing(name):
    line = given_up(make_model(**VARIANTS[name]).args)
    if name == "llama":
        assert line is None
        return
    key = next(k for k in switches() if k in VARIANTS[name])
    assert f"model.{key}" in line and "to-hf" in line and "to-gguf" in line and "\n" not in line


@pytest.mark.parametrize("command", ["to-hf", "to-gguf"])
@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "llama"])
def test_every_exporter_refuses_every_non_llama_switch_in_one_line(name, command, tmp_path, capsys):
    run = save_model(make_model(**VARIANTS[name]), tmp_path / "run", {})
    out = tmp_path / ("hf" if command == "to-hf" else "m.gguf")
    assert run_command(convert.main, [command, "--run", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    key = next(k for k in switches() if k in VARIANTS[name])
    assert err.startswith("error: ") and f"has no model.{key} = " in err and err.count("\n") == 1
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_hf_export_command_names_the_switch(tmp_path, capsys):
    run = save_model(make_model(qk_norm=True), tmp_path / "run", {})
    assert (
        run_command(convert.main, ["to-hf", "--run", str(run), "--out", str(tmp_path / "hf")]) == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model.qk_norm = True" in err and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()
