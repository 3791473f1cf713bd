"""Prompts in, text out: --prompt or --prompt-file read and encoded; samples streamed or printed."""

import sys

from data.tokenizer import prompt_start
from picollama.cli import UserError
from picollama.cli.flags import utf8_argument
from picollama.cli.user_files import regular_file_size
from picollama.sampling.decode import Sampling, generate


class TextStream:
    """Print a row's text as its tokens arrive: decode the sequence, print the new suffix, and
    hold back an incomplete UTF-8 character (a trailing U+FFFD) until its next bytes come. Only
    the last ids are kept once their text is printed (forget), so that a long stream costs the
    same memory and time per token however long it runs."""

    KEPT = 64  # ids kept as the context of the next ones' text; forget runs at 4 × as many

    def __init__(self, tokenizer, prompt: list[int], out=None):
        self.tokenizer = tokenizer
        self.ids = list(prompt)
        self.printed = 0  # characters of the decoded text (of self.ids) written so far
        self.added = 0  # tokens added: the row's new tokens
        self.out = out or sys.stdout
        self.flush_new(final=False)

    def add(self, token: int):
        self.ids.append(token)
        self.added += 1
        self.flush_new(final=False)

    def on_token(self, row: int, token: int):
        """generate()'s on_token for a batch of this one row."""
        self.add(token)

    def flush_new(self, final: bool):
        full = self.tokenizer.decode(self.ids)
        text = full if final else full.rstrip("\ufffd")
        if len(text) > self.printed:
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)
        if len(self.ids) > 4 * self.KEPT and text == full:
            self.forget(full)

    def forget(self, full: str):
        """Keep the last KEPT ids alone, all of whose text (`full`) is printed, where their own
        text is its end (not where they begin inside a character: then at a later token)."""
        kept = self.ids[-self.KEPT :]
        tail = self.tokenizer.decode(kept)
        if full.endswith(tail):
            self.ids, self.printed = kept, len(tail)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """BOS (where the tokenizer adds one) and the text's ids; an empty prompt is BOS, if any."""
    ids = prompt_start(tokenizer) + tokenizer.encode(text)
    return ids or ([tokenizer.bos_id()] if tokenizer.bos_id() >= 0 else [])


def check_prompt_flags(args):
    """UserError for --prompt with --prompt-file, or a --prompt-file that is not a regular file."""
    if args.prompt is not None and args.prompt_file is not None:
        raise UserError("give --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        prompt_file_size(args.prompt_file)


def prompt_file_size(path) -> int:
    """The size of --prompt-file; UserError unless it is a regular file (user_files)."""
    return regular_file_size(path, "--prompt-file")


def read_prompts(args, max_bytes: int | None) -> list[str]:
    """[--prompt], or --prompt-file's non-blank lines; UserError for text that is not UTF-8, and for
    a file over max_bytes (None: no limit), refused before it is read."""
    if args.prompt_file is None:
        return [utf8_argument(args.prompt or "", "--prompt")]
    path = args.prompt_file
    size = prompt_file_size(path)
    data = b""
    if max_bytes is None or size <= max_bytes:  # a file its size already refuses is never read
        try:
            with open(path, "rb") as file:  # no further than the limit: the file may be growing
                data = file.read(-1 if max_bytes is None else max_bytes + 1)
        except OSError as e:
            raise UserError(f"--prompt-file {path}: {e.strerror or e}") from None
    held = max(size, len(data))
    if max_bytes is not None and held > max_bytes:
        raise UserError(
            f"--prompt-file {path} holds {held:,} bytes: more prompt text than this model could "
            f"take in this machine's memory (at most {max_bytes:,} bytes)"
        )
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(
            f"--prompt-file {path} is not UTF-8 text (byte {e.start}); re-save it"
        ) from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UserError(f"--prompt-file {path} has no prompts (one per line)")
    return prompts


def print_samples(
    model, tokenizer, prompts: list[list[int]], sampling: Sampling, step, sinks=None
) -> list[int]:
    """Generate and print: one row streams its text as it comes (nothing kept: with sinks its
    memory is bounded), several are printed at the end. Returns each row's new tokens' count."""
    stream = TextStream(tokenizer, prompts[0]) if len(prompts) == 1 else None
    eos = tokenizer.eos_id() if tokenizer.eos_id() >= 0 else None
    pieces = tokenizer.get_piece_size()
    outputs = generate(
        model,
        prompts,
        sampling,
        eos,
        on_token=stream.on_token if stream else None,
        step=step,
        vocab_limit=pieces if pieces < model.args.vocab_size else None,
        sinks=sinks,
        keep=stream is None,
    )
    if stream:
        stream.flush_new(final=True)
        print()
        return [stream.added]
    else:
        for i, (prompt, new) in enumerate(zip(prompts, outputs, strict=True)):
            print(f"--- sample {i + 1}/{len(prompts)} ---")
            print(tokenizer.decode(prompt + new))
    return list(map(len, outputs))
