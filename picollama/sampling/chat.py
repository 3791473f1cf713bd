"""`generate.py --chat`: a terminal chat in the run's chat template, its answers streamed.

The conversation's keys and values are kept between turns (prefixes.py), so a turn prefills
only what the template rendered after the tokens of the turns before.
"""

import signal
import sys
from contextlib import contextmanager
from dataclasses import replace

import torch

from picollama.cli import UserError
from picollama.cli.flags import ArgumentParser, utf8_argument
from picollama.cli.text import checked_text
from picollama.device import CoreShare, check_compiler, memory_bytes, pick_device
from picollama.kernels.caches import KV_CACHES
from picollama.kernels.load import fast_step, load_to_sample
from picollama.sampling.decode import DecodeOptions, generate
from picollama.sampling.memory import check_memory, free_bytes
from picollama.sampling.prefixes import PrefixStore, reusable
from picollama.sampling.prompts import TextStream
from picollama.sampling.sampler import Sampling

COMMANDS = {
    "/clear": "forget the conversation (a --system message stays)",
    "/exit": "end the session (so do Ctrl-D and Ctrl-C at an empty prompt)",
    "/help": "this list",
}
# what --chat does not take: it is one conversation, in the model's own context. (Chat templates,
# picollama.chat_template and Jinja, are imported when a chat starts: sampling never loads them.)
NOT_WITH_CHAT = ("prompt_file", "rope_scaling", "rope_factor", "sink_tokens", "window")


def add_chat_flags(parser: ArgumentParser):
    """--chat and the flags that shape a chat."""
    parser.add_argument(
        "--chat",
        action="store_true",
        help="a terminal chat in the run's chat template: the conversation kept, answers streamed, "
        "Ctrl-C stops an answer, /clear forgets; with --prompt: one answer, printed",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        help="with --chat: a Jinja chat template to use instead of the run's own",
    )
    parser.add_argument("--system", metavar="TEXT", help="with --chat: a system message")
    parser.add_argument(
        "--verbose-prompt",
        action="store_true",
        help="with --chat: print each turn's rendered prompt (what the model reads) to stderr",
    )
    parser.add_argument(
        "--special-in-content",
        action="store_true",
        help="with --chat, for trusted inputs only: special tokens' text in a message (such as "
        "<|im_end|>) becomes those tokens (default: plain text, so no one can forge a turn)",
    )


def check_chat_flags(args):
    """UserError for a chat flag without --chat, or for --chat with a flag it cannot take."""
    if not args.chat:
        for flag in ("chat_template", "system", "verbose_prompt", "special_in_content"):
            if getattr(args, flag) not in (None, False):
                raise UserError(f"--{flag.replace('_', '-')} needs --chat")
        return
    if args.run is None:
        raise UserError("the following arguments are required: --run (see --help)")
    taken = [flag for flag in NOT_WITH_CHAT if getattr(args, flag) is not None]
    taken += ["num_samples"] if args.num_samples != 1 else []
    if taken:
        raise UserError(f"--chat takes no --{taken[0].replace('_', '-')}: it is one conversation")
    if args.max_new_tokens == 0:  # Each answer was empty, and the session went on.
        raise UserError("--chat --max-new-tokens 0 leaves no room for an answer; give 1 or more")


def chat_command(args) -> int:
    """`python generate.py --run DIR --chat [--prompt TEXT]`: the model loaded and its decode step
    chosen as the sampling command does (load.py)."""
    try:
        from picollama.chat_template import check_renders, load_chat_template
    except ModuleNotFoundError as e:  # Jinja is not among the core dependencies
        raise UserError(f"--chat needs {e.name}: pip install 'jinja2>=3.1.6'") from None
    check_chat_flags(args)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    system = None if args.system is None else utf8_argument(args.system, "--system")
    one_shot = None if args.prompt is None else utf8_argument(args.prompt, "--prompt")
    template = None
    if args.chat_template is not None:  # a file that is not there: said before the model loads
        template = load_chat_template(None, args.chat_template)
    device = pick_device(args.device)
    if args.compile:
        check_compiler()
    # The model loads (casts and copies) and a one-shot answer runs on the cores the load leaves
    # free, untimed: one answer is too short to pay for timing thread counts (tune_threads).
    threads = CoreShare(device).threads(samples=3)
    with thread_count(threads):
        model, tokenizer, _ = load_to_sample(args, device)
        if template is None:
            from picollama.convert.main import imported_run  # the run directory load_to_sample read

            template = load_chat_template(imported_run(args.run))
        mine = f"--chat-template {args.chat_template}" if args.chat_template else None
        check_renders(template, mine or f"the chat template of {args.run}", tokenizer)
        chat = Chat(model, tokenizer, template, sampling, system, args.verbose_prompt)
        chat.special_in_content = args.special_in_content
        chat.free = free_bytes(model, memory_bytes(device))
        if one_shot is not None:
            chat.step = fast_step(model, args.compile, 1, KV_CACHES[args.kv_cache], threads)
            chat.answer(one_shot, sys.stdout)
            return 0
    chat.step = fast_step(model, args.compile, 1, KV_CACHES[args.kv_cache])
    return session(chat, f"chat with {args.run}")


class Chat:
    """A conversation with a model: its history (user messages and their answers, the system
    message apart), rendered with the chat template for each answer, the oldest turns dropped when
    it outgrows the model's context. `prefixes` keeps the last answer's keys and values: one
    sequence, at most the context (None for a model whose cached keys follow the length)."""

    def __init__(self, model, tokenizer, template: str, sampling: Sampling, system, verbose=False):
        from picollama.chat_template import stop_ids

        self.model = model
        self.tokenizer = tokenizer
        self.template = template
        self.sampling = sampling
        self.system = [] if system is None else [{"role": "system", "content": system}]
        self.verbose = verbose
        self.special_in_content = False  # special tokens' text in messages is plain text
        self.history = []
        self.context = model.args.max_seq_len
        self.stops = stop_ids(tokenizer, template)
        pieces = tokenizer.get_piece_size()
        self.vocab_limit = pieces if pieces < model.args.vocab_size else None
        self.step = None  # the one-token decode step (fast_step's); None: the model's forward
        self.free = None  # bytes of memory beside the weights; None: not known
        self.ctrl_c = None  # an interactive session's CtrlC
        self.dropped = False  # whether this conversation lost its oldest turns (said once)
        self.prefixes = PrefixStore(sys.maxsize, entries=1) if reusable(model.args) else None
        # said now, before the first message: a template that fails on one, no room to answer
        self.prompt({"role": "user", "content": "Hello"}, verbose=False)
        if sampling.max_new_tokens >= self.context:
            raise UserError(
                f"--max-new-tokens {sampling.max_new_tokens} leaves no room for a conversation in "
                f"the model's context of {self.context} tokens"
            )

    def clear(self):
        self.history.clear()
        self.dropped = False

    def prompt(self, message: dict, verbose: bool | None = None) -> list[int]:
        """The token ids of the conversation and the user's `message`, rendered for an answer: its
        oldest turns dropped (for good, said once) until the answer has room in the context."""
        from picollama.chat_content import chat_ids

        while True:
            messages = [*self.system, *self.history, message]
            trusted = self.special_in_content
            text, ids = chat_ids(self.tokenizer, self.template, messages, trusted)
            if len(ids) + self.sampling.max_new_tokens <= self.context or not self.history:
                break
            del self.history[:2]  # a user message and its answer
            if not self.dropped:
                print(
                    f"note: the conversation outgrew the model's context of {self.context} "
                    "tokens: dropping its oldest turns",
                    file=sys.stderr,
                )
                self.dropped = True
        if len(ids) >= self.context:
            raise UserError(
                f"the message does not fit: {len(ids)} tokens rendered with the template, the "
                f"model's context is {self.context}"
            )
        if self.verbose if verbose is None else verbose:
            print(f"prompt ({len(ids)} tokens): {text!r}", file=sys.stderr)
        return ids

    def answer(self, text: str, out) -> str:
        """The model's answer to the user's `text`, streamed to `out` and a newline, and kept in the
        history after the message. An answer that Ctrl-C stops is kept as far as it came (a
        message whose answer had not begun is dropped with it)."""
        message = {"role": "user", "content": text}
        ids = self.prompt(message)
        # the asked length, or what the context has left after a long first message
        new = min(self.sampling.max_new_tokens, self.context - len(ids))
        sampling = replace(self.sampling, max_new_tokens=new)
        self.check_memory(len(ids), sampling)
        taken = Answer(self.tokenizer, self.stops, out, self.ctrl_c)
        threads = getattr(self.step, "threads", None)  # the prefill's too
        try:
            with answering(self.ctrl_c), thread_count(threads):
                options = DecodeOptions(self.step, self.vocab_limit, prefixes=self.prefixes)
                generate(self.model, [ids], sampling, on_token=taken, options=options)
        except (Stop, CtrlCPressed):  # CtrlCPressed: a second Ctrl-C, which stops it at once
            pass
        reply = taken.finish()
        if reply:
            self.history += [message, {"role": "assistant", "content": reply}]
        return reply

    def check_memory(self, prompt: int, sampling: Sampling):
        """UserError when an answer cannot fit in memory beside the conversation kept. Where it
        could without it, the kept one is dropped (its prompt is then prefilled whole)."""
        kept = 0 if self.prefixes is None else self.prefixes.bytes
        lengths = (prompt, prompt + sampling.max_new_tokens)
        sampled = sampling.temperature > 0
        try:
            check_memory(
                self.model, 1, lengths, sampled, None if self.free is None else self.free - kept
            )
        except UserError:
            if not kept:
                raise
            self.prefixes.clear()
            check_memory(self.model, 1, lengths, sampled, self.free)


class Stop(Exception):
    """What Answer raises out of generate() to end an answer: a stop id came, or Ctrl-C."""


class Answer:
    """generate()'s on_token for one answer: its tokens, streamed as text (without the spaces it
    may begin with), until a stop id (not kept) or a Ctrl-C."""

    def __init__(self, tokenizer, stops: set[int], out, ctrl_c=None):
        self.tokenizer = tokenizer
        self.stops = stops
        self.out = out
        self.ctrl_c = ctrl_c
        self.tokens = []
        self.stream = TextStream(tokenizer, [], LeftStripped(out))

    def __call__(self, row: int, token: int):
        if token in self.stops or (self.ctrl_c is not None and self.ctrl_c.pending):
            raise Stop
        self.tokens.append(token)
        self.stream.add(token)

    def finish(self) -> str:
        """The answer's text, its stream ended with a newline."""
        self.stream.flush_new()
        self.out.write("\n")
        self.out.flush()
        return self.tokenizer.decode(self.tokens).strip()


class LeftStripped:
    """A text stream that drops the whitespace its text begins with."""

    def __init__(self, out):
        self.out = out
        self.begun = False

    def write(self, text: str):
        if not self.begun:
            text = text.lstrip()
            self.begun = bool(text)
        if text:
            self.out.write(text)

    def flush(self):
        self.out.flush()


@contextmanager
def thread_count(threads: int | None):
    """torch's thread count `threads` in the block (None: as it is)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- the interactive session


class CtrlCPressed(KeyboardInterrupt):
    """Ctrl-C in a session (CtrlC's), told apart from SIGTERM's KeyboardInterrupt, which ends it."""


class CtrlC:
    """SIGINT in an interactive session, in place of run_command's handler (which ends the
    command): while an answer is made, a request (`pending`) that stops it at its next token, a
    second one at once (CtrlCPressed); at the prompt CtrlCPressed, with `typed` the line that was
    being typed (readline's), which the session drops."""

    def __init__(self):
        self.answering = False
        self.pending = False
        self.typed = ""

    def __call__(self, signum, frame):
        if self.answering and not self.pending:
            self.pending = True
            return
        self.typed = "" if self.answering else line_buffer()
        raise CtrlCPressed


def line_buffer() -> str:
    """The line readline holds (typed, not entered), or "" where input() does not use readline."""
    readline = sys.modules.get("readline")
    return readline.get_line_buffer() if readline is not None else ""


@contextmanager
def ctrl_c_handler():
    """A CtrlC handling SIGINT in the block; the handler before it restored after."""
    handler = CtrlC()
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield handler
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def answering(ctrl_c: CtrlC | None):
    """An answer being made: Ctrl-C stops it rather than the session."""
    if ctrl_c is None:
        yield
        return
    ctrl_c.pending, ctrl_c.answering = False, True
    try:
        yield
    finally:
        ctrl_c.answering = False


def session(chat: Chat, title: str) -> int:
    """Read a message, answer it, until /exit, Ctrl-D, or Ctrl-C at an empty prompt (status 0). A
    mistake in a turn (a message too long, a template that refuses it) is an `error:` line, and
    the session goes on."""
    terminal = sys.stdin.isatty()
    if terminal:
        import readline  # noqa: F401  (input() then edits lines and recalls earlier ones)
    if hasattr(sys.stdin, "reconfigure"):  # Bytes not UTF-8 then reach checked_text.
        sys.stdin.reconfigure(errors="surrogateescape")
    print(
        f"{title}: Ctrl-C stops an answer, /clear forgets the conversation, /exit or Ctrl-D "
        "ends it (/help)",
        file=sys.stderr,
    )
    with ctrl_c_handler() as chat.ctrl_c:
        while True:
            try:
                line = input("> " if terminal else "").strip()
            except (EOFError, CtrlCPressed) as e:
                if terminal:
                    print()
                if isinstance(e, CtrlCPressed) and chat.ctrl_c.typed:
                    continue  # Ctrl-C on a line being typed: the line is dropped
                return 0
            try:
                line = checked_text(line, "the line", "; set the terminal to UTF-8")
                if line.startswith("/") and not command(chat, line):
                    return 0
                if line and not line.startswith("/"):
                    chat.answer(line, sys.stdout)
            except UserError as e:
                print(f"error: {e}", file=sys.stderr)


def command(chat: Chat, line: str) -> bool:
    """Do a /command; whether the session goes on."""
    name = line.split()[0]
    if name == "/exit":
        return False
    if name == "/clear":
        chat.clear()
        print("(the conversation is forgotten)", file=sys.stderr)
    elif name == "/help":
        for command, what in COMMANDS.items():
            print(f"{command:8} {what}", file=sys.stderr)
    else:
        print(f"unknown command {name}: {', '.join(COMMANDS)}", file=sys.stderr)
    return True
