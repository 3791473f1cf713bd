"""Sample from a picollama run directory (batched, KV-cached, streaming), and measure RoPE length extrapolation."""
import dataclasses
import sys

import torch

from model import Transformer


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
    decode = decode or model
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
            if eos_id is not None:
                done |= new & (chosen == eos_id)
            if on_token is not None:
                emit = (new & (chosen != eos_id) if eos_id is not None else new).tolist()
                for row, token in enumerate(tokens[:, pos].tolist()):
                    if emit[row]:
                        on_token(row, token)
            if eos_id is not None and bool((done | (pos + 1 >= end)).all()):
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
