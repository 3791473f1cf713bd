"""generate.py --chat: a session in a pseudo-terminal, one-shot answers, overflow, errors."""

import ast
import fcntl
import io
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import generate
from data.tokenizer import open_tokenizer
from model import Transformer
from picollama.cli.command import run_command
from picollama.run_files import load_model, save_model
from picollama.sampling import chat as terminal_chat

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = os.environ.get("PICOLLAMA_SMOLLM2_GGUF")
# each message after a space: a message that is one word of the vocabulary ends with its piece
SPACED = "{% for m in messages %} {{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def scripted(make_tiny_run, tmp_path_factory) -> dict:
    """Runs of a tiny run's tokenizer whose model is a table of what follows each token (greedy):
    the word `loop` is followed by itself, `answer` by EOS, every other token by `answer`. So each
    message is answered `answer`, but one ending in `loop`, whose answer runs on until stopped.
    "long": an 8192-token context; "short": 80 tokens; "bos_ends": 80, `answer` followed by BOS
    instead of EOS."""
    tiny = make_tiny_run(steps=1)[0]
    tokenizer = open_tokenizer(tiny / "tokenizer.model")
    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.get_piece_size())]
    answer, loop = [i for i, p in enumerate(pieces) if p[:1] == "▁" and len(p) >= 5][:2]
    model, _ = load_model(tiny)
    found = dict(answer=pieces[answer][1:], loop=pieces[loop][1:], tokenizer=tokenizer)
    eos, bos = tokenizer.eos_id(), tokenizer.bos_id()
    for name, context, end in (("long", 8192, eos), ("short", 80, eos), ("bos_ends", 80, bos)):
        table = Transformer(replace(model.args, max_seq_len=context)).eval()
        with torch.no_grad():
            for block in table.layers:  # each block passes its input on as it is
                block.attention.wo.weight.zero_()
                block.feed_forward.w2.weight.zero_()
            embedding, output = table.tok_embeddings.weight, table.output.weight
            embedding.zero_()
            output.zero_()
            embedding[:, 0] = 1  # row 0 of the table: what most tokens are followed by
            embedding[loop, 0], embedding[loop, 1] = 0, 1
            embedding[answer, 0], embedding[answer, 2] = 0, 1
            output[answer, 0] = output[loop, 1] = output[end, 2] = 1
        found[name] = save_model(
            table, tmp_path_factory.mktemp(name), None, tiny / "tokenizer.model"
        )
    return found


def prompts(err: str, lengths: list | None = None) -> list[str]:
    """The rendered prompts that --verbose-prompt printed (their token counts added to
    `lengths`)."""
    lines = [line for line in err.splitlines() if line.startswith("prompt (")]
    if lengths is not None:
        lengths += [int(line.split()[1][1:]) for line in lines]
    return [ast.literal_eval(line.split(": ", 1)[1]) for line in lines]


class Terminal:
    """generate.py in a pseudo-terminal that is its controlling terminal (Ctrl-C there sends
    SIGINT, Ctrl-D ends input), its stderr to a file."""

    def __init__(self, argv: list[str], err: Path):
        self.master, slave = pty.openpty()
        env = os.environ | {"OMP_NUM_THREADS": "1", "TERM": "dumb"}  # tiny models: one thread
        with open(err, "wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "generate.py", *argv],
                stdin=slave,
                stdout=slave,
                stderr=stderr,
                cwd=REPO,
                env=env,
                start_new_session=True,
                preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
            )
        os.close(slave)
        self.output = b""
        self.read = 0  # how much of output expect has passed

    def expect(self, text: str, timeout: float = 60) -> str:
        """The output up to the next `text`, waiting for it (then passed)."""
        end = time.monotonic() + timeout
        while text.encode() not in self.output[self.read :]:
            ready, _, _ = select.select([self.master], [], [], max(0, end - time.monotonic()))
            assert ready, f"no {text!r} after {timeout} s: {self.output[self.read :]!r}"
            try:
                self.output += os.read(self.master, 4096)
            except OSError:  # the program ended
                raise AssertionError(f"ended before {text!r}: {self.output!r}") from None
        start, found = self.read, self.output.index(text.encode(), self.read)
        self.read = found + len(text)
        return self.output[start:found].decode(errors="replace")

    def send(self, text: str):
        os.write(self.master, text.encode())


def test_a_session_in_a_terminal_ctrl_c_clear_and_ctrl_d(scripted, tmp_path):
    (tmp_path / "spaced.jinja").write_text(SPACED)
    argv = [
        "--run",
        str(scripted["long"]),
        "--chat",
        "--chat-template",
        str(tmp_path / "spaced.jinja"),
    ]
    argv += ["--temperature", "0", "--max-new-tokens", "4000", "--verbose-prompt"]
    answer, loop = scripted["answer"], scripted["loop"]
    terminal = Terminal(argv, tmp_path / "err")
    try:
        terminal.expect("> ")
        for message in ("hi", "hello there"):  # two turns
            terminal.send(message + "\r")
            assert terminal.expect("> ").split(message, 1)[1].strip() == answer
        terminal.send(loop + "\r")  # an answer of 4000 tokens...
        terminal.expect(f"{loop} {loop} {loop}")
        terminal.send("\x03")  # ...stopped by Ctrl-C
        terminal.expect("> ")
        terminal.send("hi\r")  # the session goes on
        assert terminal.expect("> ").split("hi", 1)[1].strip() == answer
        terminal.send("/clear\r")
        terminal.expect("> ")
        terminal.send("hi\r")
        assert terminal.expect("> ").split("hi", 1)[1].strip() == answer
        terminal.send("\x04")  # Ctrl-D at an empty prompt
        assert terminal.process.wait(timeout=60) == 0
    finally:
        terminal.process.kill()
        os.close(terminal.master)
    err = (tmp_path / "err").read_text()
    seen = prompts(err)
    assert seen[:3] == [
        " hi",
        f" hi {answer} hello there",
        f" hi {answer} hello there {answer} {loop}",
    ]
    stopped = seen[3].removeprefix(seen[2] + " ").removesuffix(" hi")
    assert seen[3].endswith(" hi") and "typed" not in seen[3]
    repeats = stopped.split(" ")  # the answer that Ctrl-C stopped, kept as far as it came
    assert set(repeats) == {loop} and 3 <= len(repeats) < 4000, stopped
    assert seen[4:] == [" hi"]  # after /clear
    assert "error" not in err and "Traceback" not in err


def chat(argv: list[str], lines: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """run_command(generate.main, argv) with `lines` as its standard input: (status, out, err)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    status = run_command(generate.main, argv)
    out, err = capsys.readouterr()
    return status, out, err


def test_the_run_template_a_system_message_and_a_context_outgrown(
    scripted, monkeypatch, capsys, one_thread
):
    argv = ["--run", str(scripted["short"]), "--chat", "--temperature", "0"]
    argv += ["--max-new-tokens", "4", "--verbose-prompt", "--system", "Be brief."]
    lines = ["first question", "/help", "the second", "", "a third one", "/nope", "fourth"]
    status, out, err = chat(argv, lines, monkeypatch, capsys)
    answer = scripted["answer"]
    assert status == 0 and out == f"{answer}\n" * 4, err
    assert err.count("note: the conversation outgrew the model's context of 80 tokens") == 1
    assert "/clear" in err and "unknown command /nope" in err
    lengths = []
    seen = prompts(err, lengths)
    assert seen[0] == "System: Be brief.\nUser: first question\nAssistant:"  # the default template
    assert "first question" not in seen[-1] and seen[-1].startswith("System: Be brief.\n")
    assert max(lengths) + 4 <= 80 and len(seen) == 4


def test_ctrl_c_or_ctrl_d_at_the_prompt_ends_the_session(scripted, monkeypatch, capsys, one_thread):
    argv = [
        "--run",
        str(scripted["short"]),
        "--chat",
        "--temperature",
        "0",
        "--max-new-tokens",
        "2",
    ]

    def ctrl_c(prompt=""):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C at the prompt

    monkeypatch.setattr("builtins.input", ctrl_c)
    assert chat(argv, [], monkeypatch, capsys)[:2] == (0, "")
    monkeypatch.undo()
    assert chat(argv, [], monkeypatch, capsys)[:2] == (0, "")  # end of input
    assert chat(argv, ["hi", "/exit", "hi"], monkeypatch, capsys)[:2] == (
        0,
        scripted["answer"] + "\n",
    )


def test_an_answer_ends_at_the_templates_end_of_turn(scripted, tmp_path, monkeypatch, capsys):
    # BOS ends an assistant turn in this template: a stop id (stop_ids), like ChatML's <|im_end|>
    (tmp_path / "t.jinja").write_text(SPACED.replace("{% endfor %}", "{{ bos_token }}{% endfor %}"))
    argv = ["--run", str(scripted["bos_ends"]), "--chat", "--prompt", "hi", "--temperature", "0"]
    argv += ["--chat-template", str(tmp_path / "t.jinja"), "--max-new-tokens", "8"]
    assert chat(argv, [], monkeypatch, capsys)[:2] == (0, scripted["answer"] + "\n")
    plain = ["--run", str(scripted["bos_ends"]), "--chat", "--prompt", "hi", "--temperature", "0"]
    out = chat([*plain, "--max-new-tokens", "8"], [], monkeypatch, capsys)[1]  # EOS alone stops
    assert out.split() == [scripted["answer"]] * 4


def test_sigterm_during_an_answer_ends_the_session(scripted, monkeypatch, capsys, one_thread):
    argv = [
        "--run",
        str(scripted["short"]),
        "--chat",
        "--temperature",
        "0",
        "--max-new-tokens",
        "2",
    ]

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(terminal_chat, "generate", terminated)
    status, out, err = chat(argv, ["hi", "hi"], monkeypatch, capsys)
    assert status == 143 and err.endswith("error: interrupted\n"), err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_one_shot_prints_only_the_answer_and_never_doubles_bos(
    scripted, tmp_path, monkeypatch, capsys, one_thread
):
    argv = ["--run", str(scripted["long"]), "--chat", "--prompt", "hi", "--temperature", "0"]
    lengths = []
    for template in (SPACED, "{{ bos_token }}" + SPACED):  # BOS from the template or the tokenizer
        (tmp_path / "t.jinja").write_text(template)
        flags = ["--chat-template", str(tmp_path / "t.jinja"), "--verbose-prompt"]
        status, out, err = chat([*argv, *flags], [], monkeypatch, capsys)
        assert (status, out) == (0, scripted["answer"] + "\n") and prompts(err, lengths)
    assert lengths[0] == lengths[1]  # one BOS either way


@pytest.mark.skipif(not SMOLLM2, reason="set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file")
def test_smollm2_says_paris(monkeypatch, capsys, one_thread):
    # With float weights. In the file's own Q4_1 (the default) it answers "L'Étoile, la
    # Marseillaise", as llama.cpp does: int8-rounded inputs tip a near tie ("L" against "The").
    argv = ["--run", SMOLLM2, "--chat", "--prompt", "What is the capital of France?"]
    argv += ["--quantize", "none"]
    status, out, err = chat(
        [*argv, "--max-new-tokens", "16", "--temperature", "0"], [], monkeypatch, capsys
    )
    assert status == 0 and "Paris" in out and out.count("\n") == 1, (out, err)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--chat-template", "{absent}"], "error: --chat-template {absent}: No such file"),
        (
            ["--chat-template", "{refusing}"],
            "error: --chat-template {refusing} cannot render a conversation (system, user, "
            "assistant, user: the chat template refuses this conversation: no",
        ),
        (["--chat-template", "{broken}"], "error: the chat template is not valid Jinja: line 1"),
        (["--chat-template", "{plain}"], "error: --chat-template {plain} never reads `messages`"),
        (["--prompt-file", "{absent}"], "error: --chat takes no --prompt-file"),
        (["--max-new-tokens", "80"], "error: --max-new-tokens 80 leaves no room"),
        # an empty answer each turn, and the session went on (exit 0)
        (["--max-new-tokens", "0"], "error: --chat --max-new-tokens 0 leaves no room for an"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "error: --chat --max-new-tokens 0 leaves"),
        (["--prompt", "word " * 30, "--max-new-tokens", "4"], "error: the message does not fit"),
    ],
)
def test_bad_input_is_one_error_line(scripted, tmp_path, monkeypatch, capsys, flags, message):
    files = dict(absent=tmp_path / "absent", refusing=tmp_path / "r", broken=tmp_path / "b")
    files["plain"] = tmp_path / "passwd"  # Not a template: every prompt would be this file.
    files["plain"].write_text("root:x:0:0:root:/root:/bin/sh\n")
    files["refusing"].write_text("{{ raise_exception('no chats here') if messages }}")
    files["broken"].write_text("{% for %}")
    flags = [flag.format(**files) for flag in flags]
    argv = ["--run", str(scripted["short"]), "--chat", *flags]
    status, out, err = chat(argv, [], monkeypatch, capsys)
    assert status == 2 and out == "" and err.startswith(message.format(**files)), err
    assert err.count("\n") == 1, err


def test_chat_flags_need_chat(capsys):
    for flags in (["--system", "hi"], ["--chat-template", "t"], ["--verbose-prompt"]):
        assert run_command(generate.main, ["--run", "r", *flags]) == 2
        assert capsys.readouterr().err.startswith(f"error: {flags[0]} needs --chat")


def test_a_line_of_bytes_not_utf8_is_one_error_line(scripted, monkeypatch, capsys, one_thread):
    # `printf 'Hi \xff\xfe'` on stdin was a traceback: now one error line, and the session goes on.
    stdin = io.TextIOWrapper(io.BytesIO(b"Hi \xff\xfe\nhello\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    argv = ["--run", str(scripted["short"]), "--chat", "--temperature", "0"]
    status = run_command(generate.main, argv + ["--max-new-tokens", "4"])
    out, err = capsys.readouterr()
    assert status == 0 and out == f"{scripted['answer']}\n", err
    assert "error: the line is not UTF-8 text (byte 3); set the terminal to UTF-8\n" in err
    assert err.count("error") == 1 and "Traceback" not in err
