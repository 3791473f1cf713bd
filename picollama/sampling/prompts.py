"""Prompts in, text out.

This module reads and encodes --prompt or --prompt-file. One sample streams as it comes.
Several are printed at the end."""

import sys

from data.tokenizer import prompt_start
from picollama.cli import UserError
from picollama.cli.flags import utf8_argument
from picollama.cli.user_files import regular_file_size
from picollama.sampling.decode import DecodeOptions, generate
from picollama.sampling.sampler import Sampling


class TextStream:
    """Print a row's text as its tokens arrive.

    It decodes the sequence and prints the new suffix. An incomplete UTF-8 character (a trailing
    U+FFFD) waits for its next bytes. Once their text is printed, only the last ids are kept
    (forget). So a long stream costs the same memory and time per token however long it runs."""

    KEPT = 64  # Ids kept as context for the next ones' text. Forget runs at 4 × as many.

    def __init__(self, tokenizer, prompt: list[int], out=None):
        self.tokenizer = tokenizer
        self.ids = list(prompt)
        self.printed = 0  # Characters of self.ids' decoded text written so far.
        self.added = 0  # The row's new tokens, counted.
        self.out = out or sys.stdout
        self.flush_new()

    def add(self, token: int):
        self.ids.append(token)
        self.added += 1
        self.flush_new()

    def on_token(self, row: int, token: int):
        """generate()'s on_token for a batch of this one row."""
        self.add(token)

    def flush_new(self):
        # A trailing U+FFFD is a character whose bytes have not all come. At the end it is a
        # character that max_new_tokens cut, so the text ends before it.
        full = self.tokenizer.decode(self.ids)
        text = full.rstrip("\ufffd")
        if len(text) > self.printed:
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)
        if len(self.ids) > 4 * self.KEPT and text == full:
            self.forget(full)

    def forget(self, full: str):
        """Keep only the last KEPT ids, once all their text (`full`) is printed.

        Only where their own text ends `full`. If they begin inside a character, a later token
        tries again."""
        kept = self.ids[-self.KEPT :]
        tail = self.tokenizer.decode(kept)
        if full.endswith(tail):
            self.ids, self.printed = kept, len(tail)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """BOS where the tokenizer adds one, then the text's ids. An empty prompt is just BOS."""
    ids = prompt_start(tokenizer) + tokenizer.encode(text)
    return ids or ([tokenizer.bos_id()] if tokenizer.bos_id() >= 0 else [])


def check_prompt_flags(args):
    """UserError for --prompt with --prompt-file, or a --prompt-file that is not a regular file."""
    if args.prompt is not None and args.prompt_file is not None:
        raise UserError("give --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        prompt_file_size(args.prompt_file)


def prompt_file_size(path) -> int:
    """The size of --prompt-file. UserError unless it is a regular file (see user_files)."""
    return regular_file_size(path, "--prompt-file")


def read_prompts(args, max_bytes: int | None) -> list[str]:
    """[--prompt], or --prompt-file's non-blank lines.

    UserError for text that is not UTF-8. A file over max_bytes is refused before it is read.
    None means no limit."""
    if args.prompt_file is None:
        return [utf8_argument(args.prompt or "", "--prompt")]
    path = args.prompt_file
    size = prompt_file_size(path)
    data = b""
    if max_bytes is None or size <= max_bytes:  # Skip a file its size already refuses.
        try:
            with open(path, "rb") as file:  # Stop at the limit. The file may be growing.
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
    """Generate and print. Return each row's count of new tokens.

    One row streams its text as it comes and keeps nothing, so with sinks its memory is bounded.
    Several rows are printed at the end."""
    stream = TextStream(tokenizer, prompts[0]) if len(prompts) == 1 else None
    eos = tokenizer.eos_id() if tokenizer.eos_id() >= 0 else None
    pieces = tokenizer.get_piece_size()
    vocab_limit = pieces if pieces < model.args.vocab_size else None
    options = DecodeOptions(step, vocab_limit, sinks, keep=stream is None)
    on_token = None if stream is None else stream.on_token
    outputs = generate(model, prompts, sampling, eos, on_token, options)
    if stream:
        stream.flush_new()
        print()
        return [stream.added]
    else:
        for i, (prompt, new) in enumerate(zip(prompts, outputs, strict=True)):
            print(f"--- sample {i + 1}/{len(prompts)} ---")
            print(tokenizer.decode(prompt + new).rstrip("\ufffd"))
    return list(map(len, outputs))
