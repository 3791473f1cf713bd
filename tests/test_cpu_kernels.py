"""The CPU trainer's faster kernels against PyTorch's own: BatchedMuon's updates against
torch.optim.Muon's, the written-out attention against F.scaled_dot_product_attention."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import model
from model import ModelArgs, Transformer
from picollama import REPO_ROOT
from picollama.training.cpu_attention import MAX_LEN, cpu_training_attention, written_out_sdpa
from picollama.training.muon import BatchedMuon

# the default model's matrices: square (wq wk wv wo), tall (w1 w3) and wide (w2), several of each
SHAPES = [(16, 16)] * 4 + [(48, 16)] * 2 + [(16, 48)] + [(8, 24)]


def parameters(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(0.1 * torch.randn(shape, generator=generator)) for shape in SHAPES]


@pytest.mark.parametrize("nesterov", [True, False])
def test_batched_muon_updates_are_torch_muons(nesterov):
    ours, theirs = parameters(0), parameters(0)
    options = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": nesterov}
    batched, reference = BatchedMuon(ours, **options), torch.optim.Muon(theirs, **options)
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            # a parameter without a gradient is skipped by both (the last one, on step 2)
            grad = (
                None
                if (step == 2 and i == len(ours) - 1)
                else torch.randn(a.shape, generator=generator)
            )
            a.grad, b.grad = grad, None if grad is None else grad.clone()
        batched.step()
        reference.step()
    # Newton–Schulz runs in bf16: a batched product may round an entry of an update one bf16 step
    # apart (~4e-5 of a step's ~0.02), where most agree to the bit
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=5e-4, rtol=0)
    assert all((a - b).abs().max() > 0.02 for a, b in zip(ours, parameters(0)))  # they moved
    # the same state: a checkpoint of one loads into the other
    reference.load_state_dict(batched.state_dict())
    assert all(
        torch.equal(batched.state[a]["momentum_buffer"], reference.state[b]["momentum_buffer"])
        for a, b in zip(ours, theirs)
    )


def qkv(heads=2, kv_heads=2, length=24, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(3, heads, length, 8), (3, kv_heads, length, 8), (3, kv_heads, length, 8)]
    return [torch.randn(s, generator=generator).to(dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("length", [24, 7, 1])  # halves of 12, of 3 and 4, none
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_written_out_attention_equals_pytorchs_causal_attention_and_its_gradients(
    dtype, tolerance, length
):
    ours, theirs = qkv(length=length, dtype=dtype), qkv(length=length, dtype=dtype)
    out = written_out_sdpa(*ours, is_causal=True)
    expected = F.scaled_dot_product_attention(*theirs, is_causal=True)
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    out.float().square().sum().backward()
    expected.float().square().sum().backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, atol=tolerance * 5, rtol=tolerance * 5)


@pytest.mark.parametrize(
    "case", ["mask", "not causal", "grouped queries", "cached keys", "past MAX_LEN"]
)
def test_written_out_attention_leaves_every_other_call_to_pytorch(case):
    q, k, v = qkv(kv_heads=1 if case == "grouped queries" else 2)
    if case == "past MAX_LEN":
        q, k, v = qkv(length=MAX_LEN + 1)
    kwargs = {"is_causal": case != "not causal", "enable_gqa": case == "grouped queries"}
    if case == "mask":
        kwargs = {"attn_mask": torch.rand(24, 24) > 0.5}
    if case == "cached keys":  # one query after 23 cached keys
        q = q[:, :, -1:]
        kwargs = {}
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert torch.equal(written_out_sdpa(q, k, v, **kwargs), expected)


def test_cpu_training_attention_is_the_models_for_a_while_on_a_cpu_only():
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32)
    net, tokens = Transformer(args), torch.randint(0, 64, (2, 32))
    expected = net(tokens)
    with cpu_training_attention(torch.device("cuda")):
        assert model.SDPA_KERNEL is F.scaled_dot_product_attention
    with cpu_training_attention(torch.device("cpu")):
        assert model.SDPA_KERNEL is written_out_sdpa
        torch.testing.assert_close(net(tokens), expected, atol=1e-5, rtol=1e-5)
    assert model.SDPA_KERNEL is F.scaled_dot_product_attention
    with pytest.raises(RuntimeError), cpu_training_attention(torch.device("cpu")):
        raise RuntimeError("a failed step")
    assert model.SDPA_KERNEL is F.scaled_dot_product_attention


def test_inductors_cache_is_the_projects_from_the_first_use():
    """torch fixes Inductor's cache directory at its first use, which building a model on the meta
    device is (train.py's memory check): importing picollama must have put it in the project's
    .cache/inductor by then."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    code = (
        "import picollama, torch\n"
        "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
        "with torch.device('meta'):\n"
        "    torch.nn.Linear(2, 2)\n"
        "print(cache_dir())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == str(REPO_ROOT / ".cache" / "inductor"), out.stderr
