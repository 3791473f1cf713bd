"""Batch-1 greedy decoding on one model and prompt, and what bounds it.

It times HF's generate, llama.cpp (f32, bf16, q8_0) and ours. Ours runs the plain model step,
and the fused step eager and compiled, with bf16 and int8 weights. It also times the decode step
at several positions."""

import copy
import dataclasses
import functools
import operator
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from picollama.cli.command import run_command
from picollama.cli.flags import add_compile, comma_list, positive
from picollama.convert.main import imported_run
from picollama.device import cpu_has_bf16
from picollama.kernels.caches import setup_cache
from picollama.kernels.fused_step import DecodeStep
from picollama.kernels.quantize import int8_dtype, quantize
from picollama.lab.bench import common
from picollama.lab.bench.decode_report import (
    FP32_DECODERS,
    Measured,
    agreement,
    best,
    ratios_of,
    report,
    write,
)
from picollama.lab.bench.llamacpp import LlamaCpp, gguf_type, llama_cpp_decoders
from picollama.run_files import load_run, read_tokenizer
from picollama.sampling.decode import DecodeOptions, generate
from picollama.sampling.sampler import Sampling


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


def variants(model, device, compiled: bool) -> dict:
    """Our decoders, each (model, step) on its own copy of the weights: the plain model as its own
    step, the fused step eager and compiled, and with int8 weights (eager: bf16 activations where
    the CPU has bf16, for _weight_int8pack_mm; compiled: int8_dtype's), each also on one thread on
    a CPU (what generate.py's tune_threads picks on a busy one); compiled bf16 weights where the CPU
    has bf16 units (elsewhere bf16 is emulated, slower than fp32); and the compiled fp32 and int8
    steps on a bf16 KV cache, the int8 one on an int8 cache too; compiled int4 weights on a CPU."""
    found = {"ours_model_step": (model, None)}

    def fused(dtype, mode="none", compile_it=True, threads=None, kv_dtype=None):
        twin = quantize(copy.deepcopy(model), mode).to(dtype)
        return twin, DecodeStep(twin, threads, compiled=compile_it, kv_dtype=kv_dtype)

    threads = [None, 1] if device.type == "cpu" and torch.get_num_threads() > 1 else [None]
    for n in threads:
        suffix = "_1thread" if n else ""
        found["ours_fused_eager" + suffix] = fused(torch.float32, compile_it=False, threads=n)
        found["ours_int8_eager" + suffix] = fused(
            int8_dtype(device), "int8", compile_it=False, threads=n
        )
        if compiled:
            found["ours_compiled" + suffix] = fused(torch.float32, threads=n)
            found["ours_int8_compiled" + suffix] = fused(
                int8_dtype(device, compiled=True), "int8", threads=n
            )
    if compiled and (device.type == "cuda" or cpu_has_bf16()):
        found["ours_bf16_compiled"] = fused(torch.bfloat16)
    if compiled:
        found["ours_compiled_kv_bf16"] = fused(torch.float32, kv_dtype=torch.bfloat16)
        if device.type == "cpu":
            found["ours_int4_compiled"] = fused(torch.float32, "int4")
        for name, kv_dtype in (("bf16", torch.bfloat16), ("int8", torch.int8)):
            found[f"ours_int8_compiled_kv_{name}"] = fused(
                int8_dtype(device, compiled=True), "int8", kv_dtype=kv_dtype
            )
    return found


@torch.inference_mode()
def step_seconds(
    model, step, positions: list[int], device, calls: int, repeats: int, progress
) -> dict[int, float]:
    """Median seconds of one decode step (step, or the model) at each position p, 0..p-1 cached."""
    kv_dtype = getattr(step, "kv_dtype", None)
    step = model if step is None else step
    # +2 so we never use the cache's last slot, as in generate().
    setup_cache(model, 1, max(positions) + 2, kv_dtype)
    try:
        generator = torch.Generator().manual_seed(1)
        model(
            torch.randint(0, model.args.vocab_size, (1, max(positions)), generator=generator).to(
                device
            ),
            start_pos=0,
        )
        token = torch.zeros(1, 1, dtype=torch.long, device=device)

        def steps_at(pos):
            def run():
                for _ in range(calls):
                    step(token, start_pos=pos)

            return run

        medians = common.interleaved_medians(
            {p: steps_at(p) for p in positions}, device, 1, repeats, progress
        )
    finally:
        model.reset_cache()
    return {p: s / calls for p, s in medians.items()}


@torch.inference_mode()
def decode_bounds(model, device, repeats: int, progress) -> dict:
    """What bounds a batch-1 fp32 decode step: the bare matrix-vector products over every weight
    matrix (each Linear once, median), and a plain streaming read (a sum over 512 MB, fastest) for
    the bandwidth the memory itself gives."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    inputs = {w.shape[1]: torch.ones(1, w.shape[1], device=device, dtype=w.dtype) for w in weights}
    big = torch.ones(128 << 20, device=device)

    def matvecs():
        for w in weights:
            F.linear(inputs[w.shape[1]], w)

    times = common.interleaved_times(
        {"matvecs": matvecs, "read": big.sum}, device, 1, repeats, progress
    )
    # The read's fastest run, since a bound is the best the memory gave. Its median moved
    # 45-82 GB/s between runs on a 2-core Zen 5.
    seconds = {"matvecs": statistics.median(times["matvecs"]), "read": min(times["read"])}
    read_bytes_per_s = big.numel() * big.element_size() / seconds["read"]
    return {
        "weight_bytes": nbytes,
        "matvec_seconds": seconds["matvecs"],
        "matvec_bytes_per_s": nbytes / seconds["matvecs"],
        "stream_read_bytes_per_s": read_bytes_per_s,
        "stream_read_bound_seconds": nbytes / read_bytes_per_s,
    }


def warm_up(run, new_tokens: int) -> float:
    """Run a decoder on a few tokens (the compiled steps compile here); the seconds it took."""
    start = time.perf_counter()
    run(min(new_tokens, 8))
    return time.perf_counter() - start


def parse_args(argv: list[str]):
    """The flags, with --smoke's tiny model and short runs filled in."""
    p = common.parser(__doc__, "decode")
    add_compile(
        p, "our fused decode steps too (the *_compiled decoders, each ~10-40 s)", default=True
    )
    p.add_argument(
        "--config", default="small", help="small, base or a configs/NAME.toml name (default small)"
    )
    p.set_defaults(smoke_model=True)  # --smoke times its own model (see check_smoke_config).
    p.add_argument(
        "--run",
        type=Path,
        help="a trained run, a .gguf file or a Hugging Face folder to time in place of --config "
        "(llama.cpp then reads the same weights, exported with the run's tokenizer)",
    )
    p.add_argument("--prompt-len", type=positive(), default=16, help="prompt tokens (default 16)")
    p.add_argument(
        "--new-tokens", type=positive(), default=512, help="tokens to generate (default 512)"
    )
    p.add_argument(
        "--repeats", type=positive(), default=3, help="interleaved runs of each method (default 3)"
    )
    p.add_argument(
        "--positions",
        type=comma_list(positive()),
        default="16,1024",
        help="positions to time the one-token step at, comma-separated (default 16,1024)",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=common.REPO_ROOT / "data" / "shakespeare" / "tokenizer.model",
        help="the sentencepiece vocabulary of the GGUF files for llama.cpp "
        "(default: data/shakespeare's)",
    )
    cli = common.parse(p, argv)
    if cli.smoke:
        cli.config = "smoke"
        cli.new_tokens = 8
        cli.repeats = 1
        cli.positions = [4, 64]
        cli.compile = False
    return cli


def build(cli, device, dtype) -> tuple:
    """Our model (its context raised to fit the run), its tokenizer for the GGUF files, a random
    prompt, our decoders {name: (model, step)}, and every method to time {name: run(n) -> n greedy
    tokens}: HF's generate, ours without a cache, and our decoders."""
    if cli.run:
        ours, _, tokenizer = load_run(imported_run(cli.run), device, dtype)
    else:
        ours = common.build_ours(common.model_args(cli.config), device, dtype)
        tokenizer = read_tokenizer(cli.tokenizer) if cli.tokenizer.is_file() else None
    margs = ours.args
    # RoPE works at any position. Raise the context to fit prompt, new tokens and positions.
    context = max(margs.max_seq_len, cli.prompt_len + cli.new_tokens, max(cli.positions) + 2)
    ours.args = dataclasses.replace(margs, max_seq_len=context)
    ours.eval()
    hf = common.build_hf(ours).eval()
    prompt = torch.randint(
        0, margs.vocab_size, (1, cli.prompt_len), generator=torch.Generator().manual_seed(0)
    )
    prompt = prompt.to(device)
    decoders = variants(ours, device, compiled=cli.compile)

    def ours_greedy(model, step):
        options = DecodeOptions(step)
        return lambda n: generate(
            model, prompt.tolist(), Sampling(n, temperature=0), options=options
        )[0]

    methods = {
        "hf_generate": functools.partial(hf_greedy, hf, prompt),
        "ours_no_cache": functools.partial(greedy_without_cache, ours, prompt),
        **{name: ours_greedy(model, step) for name, (model, step) in decoders.items()},
    }
    return ours, tokenizer, prompt, decoders, methods


def recording(methods: dict, outputs: dict, n: int) -> dict:
    """Each method as a call keeping its n greedy tokens in outputs[name]: what gets timed."""

    def record(name):
        def run():
            outputs[name] = methods[name](n)

        return run

    return {name: record(name) for name in methods}


def time_ours(cli, ours, decoders: dict, methods: dict, device) -> Measured:
    """Compile (warm up) the compiled decoders, then time the whole greedy runs of every method
    interleaved, the one-token step of a few decoders at each position, and the bounds (before and
    after)."""
    compile_seconds = {
        name: warm_up(run, cli.new_tokens) for name, run in methods.items() if "compiled" in name
    }
    outputs = {}
    calls = 4 if cli.smoke else 32
    timed = (
        "ours_model_step",
        "ours_fused_eager",
        "ours_compiled",
        "ours_compiled_1thread",
        "ours_int8_compiled",
        "ours_compiled_kv_bf16",
        "ours_int8_compiled_kv_bf16",
        "ours_int8_compiled_kv_int8",
        "ours_int4_compiled",
    )
    timed_steps = [name for name in timed if name in decoders]
    total = cli.repeats + len(timed_steps) * (2 * cli.repeats + 1) + 4 * cli.repeats + 2
    with tqdm(total=total, desc="decode runs", disable=None) as progress:
        before = decode_bounds(ours, device, 2 * cli.repeats, progress)
        runs = recording(methods, outputs, cli.new_tokens)
        samples = common.interleaved_times(runs, device, 0, cli.repeats, progress)
        seconds = {name: statistics.median(times) for name, times in samples.items()}
        steps = {
            name: step_seconds(
                *decoders[name], cli.positions, device, calls, 2 * cli.repeats, progress
            )
            for name in timed_steps
        }
        # Memory speed drifts over minutes on a shared machine. Keep the faster of the two.
        after = decode_bounds(ours, device, 2 * cli.repeats, progress)
        bounds = max(before, after, key=operator.itemgetter("stream_read_bytes_per_s"))
        bounds["stream_read_rates"] = [b["stream_read_bytes_per_s"] for b in (before, after)]
    return Measured(seconds, samples, outputs, steps, bounds, compile_seconds)


def time_llama_cpp(cli, ours, tokenizer, prompt: torch.Tensor, device, measured: Measured):
    """Add llama.cpp's greedy runs to `measured`, or why they were skipped.

    It runs f32, bf16 and q8_0 GGUF exports of our model. They run on their own, with their
    contexts freed after. Idle llama.cpp threads keep polling for work between calls. That slowed
    torch decoders run between them by up to 40% here."""
    if cli.smoke:
        measured.why_not = "not in --smoke"
        return
    with tempfile.TemporaryDirectory() as folder:
        context = cli.prompt_len + cli.new_tokens
        llama_cpp, measured.why_not = llama_cpp_decoders(ours, tokenizer, context, Path(folder))
        if llama_cpp and cli.run and cli.run.suffix == ".gguf":  # Also the file as it is.
            llama_cpp[f"llama_cpp_{gguf_type(cli.run)}"] = LlamaCpp(
                cli.run, context, torch.get_num_threads()
            )
        try:
            theirs = {
                name: functools.partial(decoder.greedy, prompt[0].tolist())
                for name, decoder in llama_cpp.items()
            }
            for run in theirs.values():
                warm_up(run, cli.new_tokens)
            runs = recording(theirs, measured.outputs, cli.new_tokens)
            measured.seconds |= common.interleaved_medians(runs, device, 0, cli.repeats)
        finally:
            for decoder in llama_cpp.values():
                decoder.close()


def time_ours_again(cli, methods: dict, device, measured: Measured):
    """Run our fastest fp32 and int8 decoders (and bf16) again after llama.cpp (its threads gone),
    pooling these runs with their first ones: a VM's speed can drift over minutes (llama.cpp f32
    from 472 to 778 tok/s in five runs on one), so the decoders compared with llama.cpp are timed on
    both sides of its runs."""
    if measured.why_not:
        return
    again = [best(measured.seconds, FP32_DECODERS), best(measured.seconds, ("ours_int8",))]
    again += [name for name in ("ours_bf16_compiled", "ours_int4_compiled") if name in methods]
    runs = recording({name: methods[name] for name in again}, measured.outputs, cli.new_tokens)
    for name, times in common.interleaved_times(runs, device, 0, cli.repeats).items():
        measured.samples[name] += times
        measured.seconds[name] = statistics.median(measured.samples[name])


@common.one_writer
def main(argv: list[str]) -> int:
    cli = parse_args(argv)
    device, dtype = common.setup(cli)
    ours, tokenizer, prompt, decoders, methods = build(cli, device, dtype)
    measured = time_ours(cli, ours, decoders, methods, device)
    time_llama_cpp(cli, ours, tokenizer, prompt, device, measured)
    time_ours_again(cli, methods, device, measured)
    agree = agreement(measured, cli.new_tokens, dtype)
    ratios = ratios_of(measured, cli.new_tokens, cli.positions)
    report(cli, ours.args, measured, agree, ratios)
    write(cli, ours.args, dtype, measured, agree, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
