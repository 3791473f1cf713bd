"""Attention sinks (generate.py --sink-tokens/--window): exact re-positioning, bounded memory."""

import copy

import pytest
import torch

import generate
from model import ModelArgs, Transformer, apply_rotary, rope_rotations
from picollama.cli.command import run_command
from picollama.kernels.caches import SinkCache, Sinks
from picollama.kernels.fused_step import DecodeStep
from picollama.run_files import save_model
from picollama.sampling import decode as decoding
from picollama.sampling.decode import DecodeOptions
from picollama.sampling.sampler import Sampling

TINY = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=32, multiple_of=16
)
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
# each position encoding that can move (ModelArgs overrides), RoPE with each static scaling
MOVABLE = {
    "rope": {},
    "linear": dict(rope_scaling="linear", rope_factor=2.0),
    "ntk": dict(rope_scaling="ntk", rope_factor=2.0),
    "yarn": dict(rope_scaling="yarn", rope_factor=4.0),
    "llama3": dict(rope_scaling="llama3", rope_factor=4.0, rope_original_max_seq_len=8),
    "partial": dict(rope_fraction=0.5),
    "nope_every": dict(nope_every=1),  # rope, but no layer rotates
    "alibi": dict(position="alibi"),
    "nope": dict(position="nope"),
}


def make_model(std=0.3, **overrides) -> Transformer:
    """A random tiny model, its weights sharpened so that small numeric differences show."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**TINY | overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, std)
    return model


def fast(model: Transformer, fused: bool):
    return DecodeStep(model) if fused else None


@pytest.mark.parametrize("fused", [False, True])
def test_a_window_longer_than_the_generation_changes_nothing(fused, one_thread):
    model = make_model()
    step = fast(model, fused)
    plain = decoding.generate(
        model, PROMPTS, Sampling(20, temperature=0), options=DecodeOptions(step)
    )
    sunk = decoding.generate(
        model, PROMPTS, Sampling(20, temperature=0), options=DecodeOptions(step, sinks=Sinks(4))
    )
    assert sunk == plain and all(len(row) == 20 for row in sunk)


@pytest.mark.parametrize("fused", [False, True])
def test_the_cache_never_grows_past_the_window(fused, one_thread):
    """200 new tokens through a 16-token cache: the same tensors, never longer, and text past the
    model's context of 32 with no RoPE scaling."""
    model = make_model()
    seen = set()

    def watch(row, token):
        cache = model.layers[-1].attention.cache
        seen.add((tuple(cache.k.shape), tuple(cache.v.shape), cache.k.data_ptr()))

    rows = decoding.generate(
        model,
        PROMPTS,
        Sampling(200, temperature=1.0, seed=0),
        on_token=watch,
        options=DecodeOptions(fast(model, fused), sinks=Sinks(4, window=16)),
    )
    assert [len(row) for row in rows] == [200] * 3
    assert len(seen) == 1 and next(iter(seen))[:2] == ((3, 2, 16, 16),) * 2


def kept_tokens(tokens: torch.Tensor, pos: int, cache: SinkCache) -> torch.Tensor:
    """What the cache holds after the step predicting tokens[:, pos]: the sinks, then the
    fill - sinks tokens before pos."""
    recent = cache.fill - cache.sinks
    return torch.cat([tokens[:, : cache.sinks], tokens[:, pos - recent : pos]], dim=1)


def streamed(model, tokens, first_pos, sinks, step=None):
    """Yield (pos, logits, cache) of a greedy SinkCache run over tokens (written as it goes)."""
    cache = SinkCache(model, sinks)
    model.setup_cache(tokens.shape[0], cache.window)
    try:
        for pos, logits in cache.steps(tokens, first_pos, step):
            tokens[:, pos] = logits.argmax(-1)
            yield pos, logits, cache
    finally:
        model.reset_cache()


@pytest.mark.parametrize(
    "encoding, fused",
    [(name, False) for name in MOVABLE]
    + [(name, True) for name in ("rope", "linear", "ntk", "yarn", "llama3")],  # LLaMA's
)
def test_after_an_eviction_the_logits_are_a_fresh_forwards(encoding, fused, one_thread):
    """The defining property: with one layer (whose keys and values depend on the token and its
    position alone), the next-token logits equal a fresh forward over [sinks + kept window] at
    positions 0..n-1, before and after every eviction, the fused decode step's too."""
    model = make_model(n_layers=1, **MOVABLE[encoding])
    tokens = torch.zeros(1, 60, dtype=torch.long)
    tokens[0, :5] = torch.tensor([1, 5, 6, 7, 8])
    fills = []
    with torch.inference_mode():
        for pos, logits, cache in streamed(model, tokens, 5, Sinks(2, 12), fast(model, fused)):
            fresh = model(kept_tokens(tokens, pos, cache))[:, -1]
            error = (logits - fresh).abs().max() / fresh.abs().max()
            assert error < 1e-5, (pos, error)
            fills.append(cache.fill)
    assert cache.evict == 2 and fills.count(12) > 10  # many evictions (12 → 10)


@pytest.mark.parametrize(
    "overrides",
    [MOVABLE[name] for name in ("rope", "yarn", "llama3", "partial")] + [dict(nope_every=2)],
)
def test_every_layer_keeps_its_keys_and_the_first_is_a_fresh_prefills(overrides, one_thread):
    """Deeper layers' keys and values remember the evicted tokens they attended to (StreamingLLM
    does not recompute them), so with two layers only the first layer's cache equals a fresh
    prefill of [sinks + kept]; every layer's kept keys are the old ones turned back."""
    model = make_model(**overrides)
    fresh = copy.deepcopy(model)
    tokens = torch.zeros(2, 40, dtype=torch.long)
    tokens[:, :3] = torch.tensor([[1, 5, 6], [1, 8, 2]])
    before, moves = None, 0
    with torch.inference_mode():
        for pos, _, cache in streamed(model, tokens, 3, Sinks(3, 11)):
            caches = [layer.attention.cache for layer in model.layers]
            if before is not None and cache.fill < cache.window:  # evicted at this step
                check_moved(model, cache, before, caches)
                moves += 1
            before = [(c.k.clone(), c.v.clone()) for c in caches]
            before = before if cache.fill == cache.window else None
            fresh.setup_cache(2, cache.window)
            fresh(kept_tokens(tokens, pos, cache), start_pos=0)
            ours, theirs = caches[0], fresh.layers[0].attention.cache
            for a, b in ((ours.k, theirs.k), (ours.v, theirs.v)):
                assert torch.allclose(a[:, :, : cache.fill], b[:, :, : cache.fill], atol=1e-5)
    assert cache.evict == 2 and moves > 5


def check_moved(model, cache: SinkCache, before, caches):
    """Each layer's sinks stay, the kept keys are the old ones turned back by `evict` positions,
    its values the old ones moved."""
    s, e, kept = cache.sinks, cache.evict, cache.fill - 1  # the step wrote one more
    for layer, (k, v), now in zip(model.layers, before, caches, strict=True):
        old_k, old_v = k[:, :, s + e : kept + e], v[:, :, s + e : kept + e]
        if layer.attention.rotary and model.args.position == "rope":
            old_k = turn(old_k, model.args, -e)
        assert torch.equal(now.k[:, :, :s], k[:, :, :s])
        assert torch.allclose(now.k[:, :, s:kept], old_k, atol=1e-5)
        assert torch.equal(now.v[:, :, s:kept], old_v)


def turn(keys, args, by: int):
    """Keys (B, H, T, head dim) rotated by `by` positions, through the model's rope_rotations
    (divided by position 0's, whose length is YaRN's attention scale)."""
    rotation = rope_rotations(args, by, by + 1, keys.device)
    rotation = rotation / rope_rotations(args, 0, 1, keys.device)
    return apply_rotary(keys, rotation)


def test_a_batch_with_sinks_equals_one_by_one(one_thread):
    """Rows share cache slots, so evictions happen together; a prompt longer than the window
    (chunked into the cache alone, one token a step in the batch) gives the same text."""
    model = make_model()
    sunk = DecodeOptions(sinks=Sinks(2, window=8))
    batch = decoding.generate(model, PROMPTS, Sampling(40, temperature=0), options=sunk)
    alone = [
        decoding.generate(model, [p], Sampling(40, temperature=0), options=sunk)[0] for p in PROMPTS
    ]
    assert batch == alone


def test_the_flags_are_checked():
    with pytest.raises(ValueError, match="--sink-tokens must be >= 0"):
        Sinks(-1)
    with pytest.raises(ValueError, match="--window must be larger than --sink-tokens"):
        Sinks(4, window=4)
    with pytest.raises(ValueError, match="fills the model's context of 32"):
        decoding.generate(
            make_model(), PROMPTS, Sampling(4), options=DecodeOptions(sinks=Sinks(32))
        )


@pytest.fixture(scope="module")
def runs(make_tiny_run, tmp_path_factory, one_thread):
    """{position: a run directory of an untrained model}, with a tiny run's tokenizer."""
    tokenizer = make_tiny_run(0)[0] / "tokenizer.model"
    root = tmp_path_factory.mktemp("sinks")
    made = {}
    for position in ("rope", "sinusoidal", "learned"):
        torch.manual_seed(0)
        args = ModelArgs(
            dim=32, n_layers=2, n_heads=4, vocab_size=320, max_seq_len=32, position=position
        )
        made[position] = save_model(Transformer(args), root / position, tokenizer=tokenizer)
    return made


def test_the_command_samples_past_the_context_in_a_window(runs, capsys):
    """No RoPE scaling needed: the positions never pass the window."""
    argv = ["--run", str(runs["rope"]), "--prompt", "ab", "--max-new-tokens", "100"]
    assert run_command(generate.main, [*argv, "--temperature", "0", "--sink-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ab") and "100 new tokens" in err, err


@pytest.mark.parametrize(
    "position, flags, message",
    [
        ("sinusoidal", ["--sink-tokens", "4"], "sinusoidal positions are added"),
        ("learned", ["--window", "16"], "learned positions are added"),
        ("rope", ["--sink-tokens", "-1"], "--sink-tokens must be >= 0"),
        ("rope", ["--sink-tokens", "x"], "--sink-tokens: invalid int value"),
        ("rope", ["--window", "0"], "--window must be larger than --sink-tokens (4)"),
        ("rope", ["--sink-tokens", "8", "--window", "8"], "--window must be larger"),
        ("rope", ["--sink-tokens", "32"], "fills the model's context of 32"),
        ("rope", ["--window", "64"], "the KV cache (--window): 64 tokens exceed"),
        ("rope", ["--window", "16", "--rope-scaling", "dynamic"], "dynamic NTK"),
        ("rope", ["--window", "16", "--kv-cache", "int8"], "an int8 --kv-cache cannot turn"),
    ],
)
def test_the_command_refuses_in_one_line(runs, capsys, position, flags, message):
    argv = ["--run", str(runs[position]), "--max-new-tokens", "100", *flags]
    assert run_command(generate.main, argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error:") and err.count("\n") == 1, err
    assert message in err, err
