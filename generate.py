"""Sample from a picollama run directory (batched, KV-cached, streaming), and measure RoPE length extrapolation."""
import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from model import ROPE_SCALINGS, Transformer


def original_context(args) -> int:
    """The context RoPE scaling stretches from: rope_original_max_seq_len, else max_seq_len."""
    return args.rope_original_max_seq_len or args.max_seq_len


def decode_steps(model: Transformer, tokens: torch.Tensor, first_pos: int, decode=None):
    """Yield (pos, logits (B, vocab) predicting tokens[:, pos]) for pos = first_pos .. tokens.shape[1]-1.

    The caller writes tokens[:, pos] before asking for the next step. The first step prefills tokens[:, :first_pos]
    into the KV cache (set up by the caller), later ones feed one token through `decode` (default: the model).
    Dynamic NTK past its original context changes every position's rotation at each new length, so there the
    whole prefix is re-run: the logits are exactly those of model(tokens[:, :pos]) at every step.
    """
    decode = model if decode is None else decode
    recompute_after = original_context(model.args) if model.args.rope_scaling == "dynamic" else tokens.shape[1]
    cached = 0  # positions 0..cached-1 hold valid keys and values
    for pos in range(first_pos, tokens.shape[1]):
        if pos > recompute_after:
            cached = 0
        step = decode if pos - cached == 1 else model
        logits = step(tokens[:, cached:pos], start_pos=cached)[:, -1]
        cached = pos
        yield pos, logits


def sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, generator=None):
    """One token id per row of logits (B, vocab), on their device: greedy at temperature 0, else top-k/top-p sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def check_sampling(max_new_tokens, temperature, top_k, top_p):
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, not {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, not {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, not {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], not {top_p}")


def check_length(args, total: int):
    """ValueError when total tokens exceed the model's context and no RoPE scaling method stretches it."""
    if total > args.max_seq_len and args.rope_scaling == "none":
        raise ValueError(
            f"prompt + new tokens = {total} exceeds the model's context of {args.max_seq_len} tokens; "
            "generate fewer tokens or choose a RoPE scaling method (--rope-scaling linear|ntk|dynamic|yarn|llama3)"
        )


@torch.inference_mode()
def generate(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int | None = None,
    on_token=None,
    compile: bool = False,
) -> list[list[int]]:
    """New tokens for each prompt (at most max_new_tokens; stops after EOS, which is not included).

    Prompts of different lengths share one batch: all rows advance one position per step from the shortest
    prompt's end, a row feeding its own prompt token while still inside its prompt, so greedy output per row is
    the same as alone. on_token(row, token_id) is called as each new token is chosen (for streaming).
    compile=True runs the one-token decode step through torch.compile.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. BOS)")
    if any(not 0 <= t < model.args.vocab_size for p in prompts for t in p):
        raise ValueError(f"prompt token ids must lie in 0..{model.args.vocab_size - 1}")
    lengths = [len(p) for p in prompts]
    total = max(lengths) + max_new_tokens
    check_length(model.args, total)
    if max_new_tokens == 0:
        return [[] for _ in prompts]
    device = model.output.weight.device
    tokens = torch.zeros(len(prompts), total, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    prompt_len = torch.tensor(lengths, device=device)
    end = prompt_len + max_new_tokens  # each row's own stop position (exclusive)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    decode = torch.compile(model, dynamic=True) if compile else None
    model.setup_cache(len(prompts), total)
    try:
        for pos, logits in decode_steps(model, tokens, min(lengths), decode):
            chosen = sample(logits, temperature, top_k, top_p, generator)
            new = (pos >= prompt_len) & (pos < end) & ~done  # rows choosing a new token at this position
            tokens[:, pos] = torch.where(new, chosen, tokens[:, pos])
            emit = new
            if eos_id is not None:
                done |= new & (chosen == eos_id)
                emit = new & (chosen != eos_id)
            if on_token is None and eos_id is None:
                continue  # nothing to look at on the host: no sync
            finished = (done | (pos + 1 >= end)).all()
            host = torch.cat([chosen, emit.long(), finished.long()[None]]).tolist()  # the step's one sync
            if on_token is not None:
                for row, token in enumerate(host[: len(prompts)]):
                    if host[len(prompts) + row]:
                        on_token(row, token)
            if host[-1]:
                break
    finally:
        model.reset_cache()
    out = []
    for row, length in enumerate(lengths):
        new_tokens = tokens[row, length : length + max_new_tokens].tolist()
        if eos_id is not None and eos_id in new_tokens:
            new_tokens = new_tokens[: new_tokens.index(eos_id)]
        out.append(new_tokens)
    return out


# ---------------------------------------------------------------- loading a run directory


class UsageError(ValueError):
    """Bad command-line input: printed as one `error:` line, exit status 2."""


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name}: not a device (examples: cpu, cuda, cuda:1, mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine")
    return device


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """float32 on CPU, bfloat16 on a GPU that supports it (else float16), unless named."""
    if name is None:
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
              "float16": torch.float16, "fp16": torch.float16}
    if name not in dtypes:
        raise UsageError(f"--dtype {name}: choose float32, bfloat16 or float16")
    return dtypes[name]


def load_run(checkpoint, device: torch.device, dtype: torch.dtype):
    """(model, config, sentencepiece tokenizer) from a run directory; UsageError naming what is wrong."""
    import sentencepiece as spm

    from convert import load_model

    try:
        model, config = load_model(checkpoint, device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    tokenizer_path = Path(checkpoint) / "tokenizer.model"
    if not tokenizer_path.is_file():
        raise UsageError(f"{checkpoint} has no tokenizer.model; copy the dataset's tokenizer.model there")
    try:
        tokenizer = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    except Exception:
        raise UsageError(f"{tokenizer_path} is not a sentencepiece model") from None
    if tokenizer.get_piece_size() > model.args.vocab_size:
        raise UsageError(f"{checkpoint}: the tokenizer has {tokenizer.get_piece_size()} pieces but the model only "
                         f"{model.args.vocab_size} embeddings")
    return model.to(dtype).eval(), config, tokenizer


def set_rope(model: Transformer, method: str, factor: float, original_len: int):
    """Switch the model's RoPE to method/factor, stretching from original_len (the training context)."""
    model.args = dataclasses.replace(
        model.args, rope_scaling=method, rope_factor=factor, rope_original_max_seq_len=original_len
    )


# ---------------------------------------------------------------- sampling command


class TextStream:
    """Print a row's text as its tokens arrive: decode the whole sequence, print the new suffix, hold back an
    incomplete UTF-8 character (a trailing U+FFFD) until its next bytes come."""

    def __init__(self, tokenizer, prompt: list[int], out=None):
        self.tokenizer, self.ids, self.printed, self.out = tokenizer, list(prompt), 0, out or sys.stdout
        self.flush_new(final=False)

    def add(self, token: int):
        self.ids.append(token)
        self.flush_new(final=False)

    def flush_new(self, final: bool):
        text = self.tokenizer.decode(self.ids)
        if not final:
            text = text.rstrip("\ufffd")
        if len(text) > self.printed:
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)


def encode_prompt(tokenizer, text: str) -> list[int]:
    bos = [tokenizer.bos_id()] if tokenizer.bos_id() >= 0 else []
    return bos + tokenizer.encode(text)


def read_prompts(args) -> list[str]:
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("give --prompt or --prompt-file, not both")
    if args.prompt_file is None:
        return [args.prompt or ""]
    try:
        lines = Path(args.prompt_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--prompt-file {args.prompt_file}: {e.strerror or e}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UsageError(f"--prompt-file {args.prompt_file} has no prompts (one per line)")
    return prompts


def sample_command(args) -> int:
    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be >= 1, not {args.num_samples}")
    try:
        check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise UsageError(str(e).replace("max_new_tokens", "--max-new-tokens").replace("top_", "--top-")) from None
    texts = read_prompts(args)
    device = pick_device(args.device)
    model, _, tokenizer = load_run(args.checkpoint, device, pick_dtype(args.dtype, device))
    prompts = [encode_prompt(tokenizer, text) for text in texts for _ in range(args.num_samples)]
    total = max(map(len, prompts)) + args.max_new_tokens
    if args.rope_scaling is not None:
        # a static method stretches the context by just enough unless told; dynamic scales itself (factor 1)
        original = original_context(model.args)
        factor = args.rope_factor or (1.0 if args.rope_scaling == "dynamic" else max(1.0, total / original))
        set_rope(model, args.rope_scaling, factor, original)
    elif args.rope_factor is not None:
        raise UsageError("--rope-factor needs --rope-scaling")
    try:
        check_length(model.args, total)
    except ValueError as e:
        raise UsageError(str(e)) from None
    streams = [TextStream(tokenizer, prompts[0])] if len(prompts) == 1 else None
    eos = tokenizer.eos_id() if tokenizer.eos_id() >= 0 else None
    start = time.perf_counter()
    outputs = generate(
        model, prompts, args.max_new_tokens, args.temperature, args.top_k, args.top_p, eos, args.seed,
        on_token=(lambda row, token: streams[row].add(token)) if streams else None, compile=args.compile,
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if streams:
        streams[0].flush_new(final=True)
        print()
    else:
        for i, (prompt, new) in enumerate(zip(prompts, outputs)):
            print(f"--- sample {i + 1}/{len(prompts)} ---")
            print(tokenizer.decode(prompt + new))
    new_tokens = sum(map(len, outputs))
    print(
        f"{sum(map(len, prompts))} prompt tokens, {new_tokens} new tokens in {seconds:.2f} s: "
        f"{new_tokens / seconds:.1f} tokens/s ({len(prompts)} rows, {device.type}, {str(model.output.weight.dtype)[6:]}"
        f"{', rope ' + model.args.rope_scaling if model.args.rope_scaling != 'none' else ''})",
        file=sys.stderr,
    )
    return 0


# ---------------------------------------------------------------- extrapolation evaluation

SPAN, GIVEN = 32, 8  # retrieval: a 32-token span of real text; its repeat gives the first 8, the next 24 are scored


def token_losses(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (B, T-1) of each of tokens[:, 1:] given everything before it, in float32."""
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")


def sliding_losses(model: Transformer, tokens: torch.Tensor, context: int) -> torch.Tensor:
    """token_losses over (1, T) tokens seen through windows of `context` tokens moving by context/2: each token
    after the first window is scored with at least context/2 tokens before it."""
    length, stride = tokens.shape[1], max(context // 2, 1)
    pieces, start, scored = [], 0, 1  # scored: the next target position
    while scored < length:
        end = min(start + context, length)
        pieces.append(token_losses(model, tokens[:, start:end])[:, scored - start - 1 :])
        scored, start = end, start + stride
    return torch.cat(pieces, dim=1)


def use_rope_for(model: Transformer, method: str, length: int, train_len: int):
    """RoPE `method` for sequences of `length` tokens: static methods stretch by length/train_len (none at 1×),
    dynamic gets factor 1 and scales itself from the current length."""
    factor = 1.0 if method in ("none", "dynamic") else max(1.0, length / train_len)
    set_rope(model, method, factor, train_len)


def retrieval_distances(longest: int) -> list[int]:
    """Span-to-repeat distances: 64, 128, ... and the farthest that fits a sequence of `longest` tokens."""
    distances, d = [], 64
    while d + SPAN <= longest:
        distances.append(d)
        d *= 2
    return sorted(set(distances) | ({longest - SPAN} if longest - SPAN >= 64 else set()))


def retrieval_score(model: Transformer, filler: np.ndarray, span: np.ndarray, distance: int, device):
    """(accuracy, mean log-probability) of continuing `span` when its repeat (first GIVEN tokens) comes `distance`
    tokens after it, with real text as filler between."""
    sequence = filler[: distance + SPAN].copy()
    sequence[:SPAN] = span
    sequence[distance:] = span
    tokens = torch.from_numpy(sequence)[None].to(device)
    logits = model(tokens[:, :-1])[0, distance + GIVEN - 1 :].float()
    targets = tokens[0, distance + GIVEN :]
    accuracy = (logits.argmax(-1) == targets).float().mean().item()
    logprob = -F.cross_entropy(logits, targets).item()
    return accuracy, logprob


def spread(values) -> dict:
    values = np.asarray(values, dtype=np.float64)
    return {"mean": float(values.mean()), "std": float(values.std()), "n": len(values)}


def find_data_dir(config: dict, override: str | None) -> Path:
    if override is not None:
        candidates = [Path(override)]
    else:
        configured = (config.get("data") or {}).get("dir")
        if not configured:
            raise UsageError("config.json names no data.dir; pass --data DIR (a prepared dataset with val.bin)")
        candidates = [Path(configured), Path(__file__).resolve().parent / configured]
    for path in candidates:
        if (path / "val.bin").is_file() and (path / "meta.json").is_file():
            return path
    raise UsageError(f"{candidates[0]} is not a prepared dataset with a val split; pass --data DIR")


def check_same_tokenizer(checkpoint: Path, data_dir: Path):
    """UsageError when the dataset was tokenized by another tokenizer than the checkpoint's."""
    import hashlib

    from data.loader import load_meta

    expected = load_meta(data_dir).get("tokenizer_sha256")
    ours = hashlib.sha256((checkpoint / "tokenizer.model").read_bytes()).hexdigest()
    if expected and expected != ours:
        raise UsageError(f"{data_dir} was tokenized with another tokenizer than {checkpoint}/tokenizer.model")


def evaluate_extrapolation(model, data_dir, train_len, lengths, methods, protocol, num_windows, seed, device) -> dict:
    """All the numbers of the extrapolation report (see the `extrapolate` command)."""
    from data.loader import document_windows

    longest = max(lengths)
    score_tokens = min(64, train_len // 2)
    windows = document_windows(data_dir, "val", longest, num_windows, seed=seed)
    spans = document_windows(data_dir, "val", SPAN, num_windows, seed=seed + 1)
    if windows.max() >= model.args.vocab_size:
        raise UsageError(f"{data_dir} holds token ids beyond the model's vocabulary; it was made with another tokenizer")
    distances = retrieval_distances(longest)
    bins = np.linspace(0, longest - 1, min(32, longest - 1) + 1).round().astype(int)
    results = {"perplexity": {}, "per_position": {"bin_edges": bins.tolist()}, "retrieval": {}}
    work = len(methods) * (len(lengths) + len(distances)) * num_windows
    with tqdm(total=work, desc="extrapolation", unit="window") as bar:
        for method in methods:
            per_length, per_distance = {}, {}
            for length in lengths:
                use_rope_for(model, method, length, train_len)
                window_losses = []
                for window in windows:
                    tokens = torch.from_numpy(window)[None].to(device)
                    if protocol == "fixed-target":
                        losses = token_losses(model, tokens[:, -length:])[0]
                        targets = losses[-score_tokens:]
                    else:
                        losses = targets = sliding_losses(model, tokens, length)[0]
                    window_losses.append(targets.mean().item())
                    if length == longest:  # the whole window in one forward: its loss at every position
                        per_bin = [losses[a:b].mean().item() for a, b in zip(bins[:-1], bins[1:])]
                        results["per_position"].setdefault(method, []).append(per_bin)
                    bar.update()
                loss = spread(window_losses)
                per_length[str(length)] = {"loss": loss, "perplexity": math.exp(loss["mean"])}
            for distance in distances:
                use_rope_for(model, method, distance + SPAN, train_len)
                scores = [retrieval_score(model, w, s, distance, device) for w, s in zip(windows, spans)]
                per_distance[str(distance)] = {"accuracy": spread([a for a, _ in scores]),
                                               "logprob": spread([p for _, p in scores])}
                bar.update(num_windows)
            reference = per_length[str(train_len)]["perplexity"]
            for row in per_length.values():
                row["ratio"] = row["perplexity"] / reference
            results["perplexity"][method] = per_length
            results["retrieval"][method] = per_distance
            by_bin = np.asarray(results["per_position"][method])
            results["per_position"][method] = {"loss_mean": by_bin.mean(0).tolist(), "loss_std": by_bin.std(0).tolist()}
    results["retrieval"]["distances"] = distances
    results["score_tokens"] = score_tokens
    return results


def short_number(x: float) -> str:
    """3 significant digits; `>10^k` for blow-ups of 1000 and more."""
    if not math.isfinite(x):
        return "inf"
    return f">10^{int(math.log10(x))}" if x >= 1000 else f"{x:.3g}"


def ratio_text(x: float) -> str:
    return short_number(x) if x >= 1000 or not math.isfinite(x) else f"{x:.2f}×"


def markdown_report(report: dict) -> str:
    lengths, train_len = report["lengths"], report["train_context"]
    header = "| method | " + " | ".join(f"{n} ({n / train_len:g}×)" for n in lengths) + " |"
    rule = "|---" * (len(lengths) + 1) + "|"
    lines = [
        f"# RoPE extrapolation of {report['checkpoint']}",
        "",
        f"Training context {train_len} tokens. Protocol `{report['protocol']}`: "
        + (f"the last {report['score_tokens']} tokens of {report['num_windows']} validation windows of "
           f"{max(lengths)} tokens (each inside one document), scored with the last n tokens as context."
           if report["protocol"] == "fixed-target" else
           f"every token of {report['num_windows']} validation windows of {max(lengths)} tokens, scored through "
           "windows of n tokens moving by n/2.")
        + " Static methods use factor n/training context, `dynamic` factor 1.",
        "",
        "Perplexity (ratio to the training length):",
        "",
        header,
        rule,
    ]
    for method, row in report["perplexity"].items():
        cells = [f"{short_number(row[str(n)]['perplexity'])} ({ratio_text(row[str(n)]['ratio'])})" for n in lengths]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    distances = report["retrieval"]["distances"]
    lines += [
        "",
        f"Retrieval: accuracy of continuing a {SPAN}-token span of real text ({SPAN - GIVEN} tokens scored) when its "
        f"first {GIVEN} tokens repeat d tokens later:",
        "",
        "| method | " + " | ".join(f"d={d}" for d in distances) + " |",
        "|---" * (len(distances) + 1) + "|",
    ]
    for method in report["methods"]:
        row = report["retrieval"][method]
        lines.append(f"| {method} | " + " | ".join(f"{row[str(d)]['accuracy']['mean']:.0%}" for d in distances) + " |")
    return "\n".join(lines) + "\n"


def plot_report(report: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    train_len, methods = report["train_context"], report["methods"]
    fig, (ppl_ax, pos_ax, ret_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    styles = ["o-", "s--", "^-.", "D:", "v-", "x--"]  # distinct even where two methods' lines coincide
    lengths, distances = report["lengths"], report["retrieval"]["distances"]
    edges = np.asarray(report["per_position"]["bin_edges"])
    for method, style in zip(methods, styles):
        ppl_ax.plot(lengths, [report["perplexity"][method][str(n)]["perplexity"] for n in lengths], style, label=method)
        pos_ax.plot((edges[:-1] + edges[1:]) / 2, report["per_position"][method]["loss_mean"], style[1:], label=method)
        ret_ax.plot(distances, [report["retrieval"][method][str(d)]["accuracy"]["mean"] for d in distances], style,
                    label=method)
    ppl_ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="perplexity",
               title=f"perplexity ({report['protocol']})")
    ppl_ax.set_xscale("log", base=2)
    pos_ax.set(xlabel="position in the window", ylabel="loss (nats)", title=f"loss by position, {max(report['lengths'])} tokens")
    ret_ax.set(xscale="log", xlabel="distance to the repeat (tokens)", ylabel="accuracy", ylim=(-0.02, 1.02),
               title=f"retrieval: continue a {SPAN}-token span")
    ret_ax.set_xscale("log", base=2)
    # ticks at 1, 1.5, 2, 3, 5, 7 per decade, labelled 90, 100, 150 rather than 9×10^1
    ppl_ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
    ppl_ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    ppl_ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in (ppl_ax, pos_ax, ret_ax):
        ax.axvline(train_len, color="gray", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
    ppl_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_atomically(path: Path, write):
    """Call write(temp_path) next to path, then rename it into place."""
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def parse_list(text: str, convert, what: str) -> list:
    try:
        values = [convert(item.strip()) for item in text.split(",") if item.strip()]
    except ValueError:
        raise UsageError(f"--{what} {text!r}: expected a comma-separated list") from None
    if not values:
        raise UsageError(f"--{what} is empty")
    return values


def extrapolate_command(args) -> int:
    methods = parse_list(args.methods, str, "methods")
    unknown = [m for m in methods if m not in ROPE_SCALINGS]
    if unknown:
        raise UsageError(f"--methods: unknown {', '.join(unknown)} (choose from {', '.join(ROPE_SCALINGS)})")
    if args.num_windows < 1:
        raise UsageError(f"--num-windows must be >= 1, not {args.num_windows}")
    device = pick_device(args.device)
    model, config, _ = load_run(args.checkpoint, device, pick_dtype(args.dtype, device))
    train_len = int((config.get("train") or {}).get("seq_len") or original_context(model.args))
    lengths = parse_list(args.lengths, int, "lengths") if args.lengths else [train_len * k for k in (1, 2, 4, 8)]
    lengths = sorted(set(lengths) | {train_len})
    if min(lengths) <= min(64, train_len // 2):
        raise UsageError(f"--lengths must all exceed {min(64, train_len // 2)} (the scored tokens)")
    data_dir = find_data_dir(config, args.data)
    check_same_tokenizer(Path(args.checkpoint), data_dir)
    model_args = model.args.to_dict()
    out_dir = Path(args.out) if args.out else Path(args.checkpoint) / "extrapolation"
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            results = evaluate_extrapolation(model, data_dir, train_len, lengths, methods, args.protocol,
                                             args.num_windows, args.seed, device)
    except ValueError as e:  # data.DataError: e.g. no validation document is long enough
        raise UsageError(str(e)) from None
    report = {
        "checkpoint": str(args.checkpoint), "command": ["python", "generate.py", *args.argv],
        "model": model_args, "data": str(data_dir),
        "train_context": train_len, "lengths": lengths, "methods": methods, "protocol": args.protocol,
        "num_windows": args.num_windows, "seed": args.seed, "device": device.type,
        "seconds": round(time.perf_counter() - start, 1), **results,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = markdown_report(report)
    write_atomically(out_dir / "extrapolation.json", lambda p: p.write_text(json.dumps(report, indent=1) + "\n"))
    write_atomically(out_dir / "extrapolation.md", lambda p: p.write_text(markdown))
    write_atomically(out_dir / "extrapolation.png", lambda p: plot_report(report, p))
    print(markdown)
    print(f"wrote {out_dir}/extrapolation.json, .md and .png ({report['seconds']} s)")
    return 0


# ---------------------------------------------------------------- command line


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see --help)")


def add_common(parser):
    parser.add_argument("--checkpoint", required=True, help="run directory (model.safetensors, config.json, tokenizer.model)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on a GPU, float32 on CPU)")


def sample_parser() -> Parser:
    parser = Parser(prog="python generate.py", description="Sample from a run directory (see also: python "
                    "generate.py extrapolate --help).")
    add_common(parser)
    parser.add_argument("--prompt", help="the text to continue (default: empty, i.e. only BOS)")
    parser.add_argument("--prompt-file", help="a UTF-8 file with one prompt per line (blank lines skipped)")
    parser.add_argument("--num-samples", type=int, default=1, help="samples per prompt (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="default 200")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, help="sample from the k most likely tokens only")
    parser.add_argument("--top-p", type=float, help="nucleus sampling: the smallest set holding this probability")
    parser.add_argument("--seed", type=int, help="for reproducible samples")
    parser.add_argument("--rope-scaling", choices=ROPE_SCALINGS, help="RoPE scaling for going past the training "
                        "context: " + ", ".join(ROPE_SCALINGS))
    parser.add_argument("--rope-factor", type=float, help="its factor (default: just enough for prompt + new tokens; "
                        "1 for dynamic)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the one-token decode step")
    return parser


def extrapolate_parser() -> Parser:
    parser = Parser(prog="python generate.py extrapolate", description="How perplexity and retrieval hold up past "
                    "the training context, for each RoPE scaling method.")
    add_common(parser)
    parser.add_argument("--lengths", help="comma-separated context lengths (default: 1,2,4,8 × the training context)")
    parser.add_argument("--methods", default="none,linear,ntk,dynamic,yarn", help="default none,linear,ntk,dynamic,yarn")
    parser.add_argument("--protocol", choices=("fixed-target", "sliding"), default="fixed-target",
                        help="fixed-target (default): the same last tokens scored with each context length; "
                        "sliding: every token, through windows moving by half their length")
    parser.add_argument("--num-windows", type=int, default=8, help="validation windows (default 8)")
    parser.add_argument("--data", help="prepared dataset (default: config.json's data.dir)")
    parser.add_argument("--seed", type=int, default=0, help="which windows (default 0)")
    parser.add_argument("--out", help="output directory (default CHECKPOINT/extrapolation)")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["extrapolate"]:
            args = extrapolate_parser().parse_args(argv[1:])
            args.argv = argv
            return extrapolate_command(args)
        return sample_command(sample_parser().parse_args(argv))
    except UsageError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
