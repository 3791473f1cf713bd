"""Batch-1 greedy decoding: ours with and without the KV cache vs HF's generate; decode step time by position."""

import dataclasses
import sys

import common
import torch
import torch.nn.functional as F
from tqdm import tqdm

from cli import UserError, run_command
from generate import generate
from model import ModelArgs

SMOKE = dict(dim=64, n_layers=2, n_heads=4, max_seq_len=32, vocab_size=128)


@torch.inference_mode()
def greedy_without_cache(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """The explicit baseline: re-run the whole sequence through the model for every new token."""
    tokens = prompt
    for _ in range(max_new_tokens):
        next_token = model(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat((tokens, next_token), dim=1)
    return tokens[0, prompt.shape[1] :].tolist()


def hf_greedy(hf, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    import transformers

    config = transformers.GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    return hf.generate(prompt, generation_config=config)[0, prompt.shape[1] :].tolist()


@torch.inference_mode()
def step_seconds(model, positions: list[int], device, calls: int, repeats: int, progress) -> dict[int, float]:
    """Median seconds of one model(token, start_pos=p) decode step with positions 0..p-1 already cached."""
    model.setup_cache(1, max(positions) + 1)
    try:
        generator = torch.Generator().manual_seed(1)
        model(torch.randint(0, model.args.vocab_size, (1, max(positions)), generator=generator).to(device), start_pos=0)
        token = torch.zeros(1, 1, dtype=torch.long, device=device)

        def steps_at(pos):
            def run():
                for _ in range(calls):
                    model(token, start_pos=pos)

            return run

        medians = common.interleaved_medians({p: steps_at(p) for p in positions}, device, 1, repeats, progress)
    finally:
        model.reset_cache()
    return {p: s / calls for p, s in medians.items()}


@torch.inference_mode()
def decode_bounds(model, device, repeats: int, progress) -> dict:
    """What bounds a batch-1 decode step: the bare matrix-vector products over every weight matrix (each Linear
    once), and a plain streaming read (a sum over 512 MB) for the bandwidth the memory itself gives."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    inputs = {w.shape[1]: torch.ones(1, w.shape[1], device=device, dtype=w.dtype) for w in weights}
    big = torch.ones(128 << 20, device=device)

    def matvecs():
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    seconds = common.interleaved_medians({"matvecs": matvecs, "read": big.sum}, device, 1, repeats, progress)
    read_bytes_per_s = big.numel() * big.element_size() / seconds["read"]
    return {
        "weight_bytes": nbytes,
        "matvec_seconds": seconds["matvecs"],
        "matvec_bytes_per_s": nbytes / seconds["matvecs"],
        "stream_read_bytes_per_s": read_bytes_per_s,
        "stream_read_bound_seconds": nbytes / read_bytes_per_s,
    }


def main(argv: list[str]) -> int:
    p = common.parser(__doc__, "decode")
    p.add_argument("--compile", action="store_true", help="our decode step via torch.compile (generate(compile=True))")
    p.add_argument("--config", default="small", help="small, base or a configs/NAME.toml name (default small)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
    p.add_argument("--new-tokens", type=int, default=512, help="tokens to generate (default 512)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of each method (default 3)")
    p.add_argument("--positions", default="16,1024", help="positions to time the one-token step at (default 16,1024)")
    cli = common.parse(p, argv)
    device, dtype = common.setup(cli)
    try:
        positions = [int(x) for x in cli.positions.split(",")]
    except ValueError:
        raise UserError(f"--positions must be comma-separated integers, not {cli.positions!r}") from None
    if cli.smoke:
        margs, cli.new_tokens, cli.repeats, positions = ModelArgs(**SMOKE), 8, 1, [4, 64]
    else:
        margs = common.model_args(cli.config)
    if min(cli.prompt_len, cli.new_tokens, cli.repeats, *positions) < 1:
        raise UserError("--prompt-len, --new-tokens, --repeats and --positions must be positive")
    # RoPE is computed for any position: raise the context so the prompt, the new tokens and the positions all fit
    context = max(margs.max_seq_len, cli.prompt_len + cli.new_tokens, max(positions) + 1)
    margs = dataclasses.replace(margs, max_seq_len=context)
    ours = common.build_ours(margs, device, dtype).eval()
    hf = common.build_hf(ours).eval()
    prompt = torch.randint(0, margs.vocab_size, (1, cli.prompt_len), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)
    outputs = {}
    methods = {
        "ours_cached": lambda n: generate(ours, prompt.tolist(), n, temperature=0, compile=cli.compile)[0],
        "ours_no_cache": lambda n: greedy_without_cache(ours, prompt, n),
        "hf_generate": lambda n: hf_greedy(hf, prompt, n),
    }
    for run in methods.values():  # warm-up on a few tokens
        run(min(cli.new_tokens, 8))

    def record(name):
        def run():
            outputs[name] = methods[name](cli.new_tokens)

        return run

    with tqdm(total=cli.repeats + 4 * cli.repeats + 2, desc="decode runs", disable=None) as progress:
        seconds = common.interleaved_medians({name: record(name) for name in methods}, device, 0, cli.repeats, progress)
        calls = 4 if cli.smoke else 32
        step = step_seconds(ours, positions, device, calls, 2 * cli.repeats, progress)
        bounds = decode_bounds(ours, device, 2 * cli.repeats, progress)
    n = cli.new_tokens
    agree = {
        other: sum(a == b for a, b in zip(outputs["ours_cached"], tokens, strict=False))
        for other, tokens in outputs.items()
    }
    if dtype == torch.float32 and agree["ours_no_cache"] != n:  # bf16 kernels may legitimately flip a near-tie
        raise UserError(f"cached and uncached greedy decoding disagree ({agree['ours_no_cache']}/{n} tokens)")
    rows = [[name, n / s, s, seconds["hf_generate"] / s] for name, s in seconds.items()]
    print(
        f"batch 1, {cli.prompt_len}-token prompt, {n} greedy new tokens, "
        f"{margs.dim}-dim {margs.n_layers}-layer model, context raised to {context}"
    )
    common.print_table(["method", "tok/s", "seconds", "vs HF"], rows)
    common.print_table(
        ["decode step", "ms"],
        [[f"position {p}", s * 1e3] for p, s in step.items()]
        + [
            ["bare matrix-vector products", bounds["matvec_seconds"] * 1e3],
            ["weights at the streaming-read rate", bounds["stream_read_bound_seconds"] * 1e3],
        ],
    )
    print(
        f"{bounds['weight_bytes'] / 1e6:.1f} MB of weights per token: read at "
        f"{bounds['matvec_bytes_per_s'] / 1e9:.1f} GB/s by the matrix-vector products, "
        f"{bounds['stream_read_bytes_per_s'] / 1e9:.1f} GB/s by a plain streaming read"
    )
    first, last = positions[0], positions[-1]
    ratios = {
        "cached_over_hf": seconds["hf_generate"] / seconds["ours_cached"],
        "cached_over_no_cache": seconds["ours_no_cache"] / seconds["ours_cached"],
        f"step_{last}_over_step_{first}": step[last] / step[first],
        "matvec_share_of_step": bounds["matvec_seconds"] / step[first],
        "bandwidth_bound_share_of_step": bounds["stream_read_bound_seconds"] / step[first],
    }
    print("  ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    common.write_results(
        cli,
        {
            "config": "smoke" if cli.smoke else cli.config,
            "model_args": margs.to_dict(),
            "prompt_len": cli.prompt_len,
            "new_tokens": n,
            "dtype": str(dtype).removeprefix("torch."),
            "methods": {name: {"seconds": s, "tokens_per_second": n / s} for name, s in seconds.items()},
            "greedy_tokens_agreeing_with_ours_cached": agree,
            "step_seconds_by_position": {str(p): s for p, s in step.items()},
            "bounds": bounds,
            "ratios": ratios,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
