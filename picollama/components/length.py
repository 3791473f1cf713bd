"""The length policy: how far a model runs as it is, and what running past its context takes —
RoPE scaling stretched to a length, the windows of the two-branch methods.

It reads model.py's ROPE_INIT and ROPE_ATTENTIONS when called, not a list of their keys. So a new
scaling method needs no edit here. registry.py derives the lists (ROPE_SCALINGS, WINDOWED)."""

from dataclasses import replace

from model import ROPE_ATTENTIONS, ROPE_INIT, ModelArgs


def uses_rope(args: ModelArgs) -> bool:
    """Whether positions are RoPE's rotations (p-RoPE's too): what rope_* keys apply to."""
    return args.position in ("rope", "prope")


def length_dependent(args: ModelArgs) -> bool:
    """Whether RoPE's frequencies follow the current length (dynamic): cached keys go stale."""
    return uses_rope(args) and getattr(ROPE_INIT.get(args.rope_scaling), "length_dependent", False)


def near_window(args: ModelArgs) -> int:
    """The window w of the two-branch scalings (ROPE_ATTENTIONS). Keys nearer than w keep exact
    RoPE. By default w is a quarter of the context, or 3/4 for rerope_topk, which attends few
    far keys."""
    quarters = 3 if args.rope_scaling == "rerope_topk" else 1
    return args.rope_window or quarters * args.original_seq_len // 4


def stretched(args: ModelArgs, method: str, length: int, factor: float | None = None) -> ModelArgs:
    """args with RoPE scaling `method` for `length` tokens, stretching original_seq_len by
    `factor`, else by just enough (1 for "none" and a length-dependent one, dynamic: it follows
    the length)."""
    if not uses_rope(args) and method != "none":
        raise ValueError(
            f"rope_scaling applies to position = 'rope' only (or 'prope'), not to position = "
            f"{args.position!r}"
        )
    original = args.original_seq_len
    args = replace(args, rope_scaling=method, rope_original_max_seq_len=original)
    if factor is None and method in ROPE_ATTENTIONS:
        factor = window_factor(args, length)
    elif factor is None:
        follows = method == "none" or length_dependent(args)
        factor = 1.0 if follows else max(1.0, length / original)
    return replace(args, rope_factor=factor)


def window_factor(args: ModelArgs, length: int) -> float:
    """rerope's k (self_extend's G, an integer) just large enough that the farthest distance of
    `length` tokens, length - 1, maps to at most original_seq_len - 1, the farthest trained:
    w + (length-1-w)/k, or (length-1)//G - w//G + w; rerope_topk's length / original_seq_len (its
    far keys all sit at distance w: the factor says only how far it stretches), and so for a
    method whose attention function says stretch_only (dca, reattention)."""
    w, last = near_window(args), args.original_seq_len - 1
    if length - 1 <= last:
        return 1.0
    if w >= last:
        raise ValueError(f"rope_window ({w}) must be below original_seq_len - 1 ({last})")
    stretch_only = getattr(ROPE_ATTENTIONS[args.rope_scaling], "stretch_only", False)
    if stretch_only or args.rope_scaling == "rerope_topk":
        return length / args.original_seq_len
    if args.rope_scaling == "rerope":
        return (length - 1 - w) / (last - w)
    group = 1
    while (length - 1) // group - w // group > last - w:
        group += 1
    return float(group)


def position_limit(args: ModelArgs) -> int | None:
    """The longest sequence a model computes at all: a learned table's; else None."""
    return args.max_seq_len if args.position == "learned" else None


def needs_scaling(args: ModelArgs, length: int) -> bool:
    """Whether `length` tokens run a RoPE model past its context, unscaled."""
    return uses_rope(args) and args.rope_scaling == "none" and length > args.max_seq_len


def length_problem(args: ModelArgs, length: int) -> str | None:
    """Why a model cannot run `length` tokens as it is; None when it can."""
    limit = position_limit(args)
    if limit is not None and length > limit:
        return f"{length} tokens exceed the model's learned position table of {limit} positions"
    if needs_scaling(args, length):
        return f"{length} tokens exceed the model's context of {args.max_seq_len} tokens"
    return None
