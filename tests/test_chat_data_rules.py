"""Chat data that stays honest: the split by tokens, mixed and unsupported records refused with
their row, and nothing left behind by a failure."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from data import prepare as prepare_command
from data.conversations import checked_record, conversation_files, read_conversations
from data.loader import checked_meta
from data.packing import Documents
from data.splitting import ChatSplitter
from picollama.cli import UserError
from picollama.cli.command import run_command

CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}


def chat(i: int, words: int = 3) -> dict:
    reply = " ".join(f"word{i}" for _ in range(words))
    return {
        "messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": reply}]
    }


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def prepare(*argv) -> int:
    return run_command(prepare_command.main, [str(arg) for arg in argv])


@pytest.fixture(scope="module")
def tiny_run(make_tiny_run) -> Path:
    return make_tiny_run(steps=1)[0]


def test_a_long_conversation_never_takes_the_held_out_split():
    lengths = [50] * 100 + [5_000_000]
    flags = ChatSplitter()(0, lengths, last=True)
    held = [n for n, flag in zip(lengths, flags) if flag]
    assert 1 <= len(held) <= 5 and 5_000_000 not in held
    assert ChatSplitter()(0, lengths, last=True) == flags  # seeded


def test_the_split_by_tokens_resumes_alike_and_keeps_its_share():
    rng = np.random.default_rng(1)
    blocks = [rng.integers(10, 400, size=30).tolist() for _ in range(4)]
    whole = ChatSplitter()
    flags = [whole(i, block, i == 3) for i, block in enumerate(blocks)]
    resumed = ChatSplitter()
    resumed(0, blocks[0], False)
    again = ChatSplitter(resumed.tokens, resumed.val_tokens, resumed.count, resumed.val_count)
    assert [again(i, blocks[i], i == 3) for i in (1, 2, 3)] == flags[1:]
    assert 0 < whole.val_tokens <= 0.05 * whole.tokens and whole.val_count <= 0.05 * 120
    assert ChatSplitter()(0, [9, 3], last=True) == [False, True]  # at least one, the shortest


def test_the_long_conversation_goes_to_train(tiny_run, tmp_path, capsys):
    records = [chat(i) for i in range(60)] + [chat(99, words=3000)]
    source = write_lines(tmp_path / "chats.jsonl", records)
    # Past the run's context, 32: the long one is kept whole, so the split sees its length.
    args = ["--source", source, "--tokenizer", tiny_run, "--context", 100_000]
    assert prepare(*args, "--out", tmp_path / "d") == 0
    meta = checked_meta(tmp_path / "d")
    assert meta["conversations"] == {"train": 58, "val": 3}, meta["conversations"]
    assert meta["splits"]["val"]["tokens"] <= 0.05 * meta["splits"]["train"]["tokens"]
    with pytest.raises(
        UserError, match=r"holds 58 conversation\(s\), 58 of them longer than a row"
    ):
        Documents(tmp_path / "d", "train", 1, conversations=True)  # no target in a 1-token row


def test_text_and_chat_records_in_one_file_are_refused_with_counts(tiny_run, tmp_path, capsys):
    texts = [{"text": f"document {i}"} for i in range(20)]
    for lines, first, flags in [
        (texts + [CHAT] * 5, "line 21", []),
        ([CHAT] * 5 + texts[:2], "line 6", ["--tokenizer", tiny_run]),
    ]:
        source = write_lines(tmp_path / "mixed.jsonl", lines)
        assert prepare("--source", source, *flags, "--out", tmp_path / "out") == 2
        err = capsys.readouterr().err.strip()
        counts = f"{len(lines) - 5 if first == 'line 21' else 2} text records and 5 conversation"
        assert err.startswith("error: ") and "\n" not in err, err
        assert counts in err and f"record is {source} {first}" in err, err
        assert {p.name for p in tmp_path.iterdir()} <= {"mixed.jsonl", ".out.lock"}


@pytest.mark.parametrize(
    "message, cause",
    [
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, "tool calls are"),
        ({"role": "tool", "content": "42"}, "messages[1]: tool calls are not supported"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            "messages[1]: image parts are not supported",
        ),
        ({"role": "user", "content": [{"type": "input_audio"}]}, "audio parts are not supported"),
    ],
    ids=["tool-calls", "tool-role", "image", "audio"],
)
def test_tool_calls_and_media_parts_are_named_unsupported(message, cause):
    record = {"messages": [{"role": "user", "content": "Hi"}, message, CHAT["messages"][1]]}
    with pytest.raises(UserError, match=re.escape(cause)):
        checked_record(json.dumps(record), "f line 3")
    parts = [{"type": "text", "text": "a"}, {"text": "b"}]  # lists of text parts are read
    record = {"messages": [{"role": "user", "content": parts}, CHAT["messages"][1]]}
    assert checked_record(json.dumps(record), "x")[0]["content"] == "ab"


def test_an_empty_file_and_a_long_number_name_their_cause(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError, match=f"{empty}: an empty file, with no record"):
        conversation_files(str(empty))
    line = json.dumps(CHAT)[:-1] + ', "n": ' + "9" * 5000 + "}"
    source = write_lines(tmp_path / "n.jsonl", [CHAT, line])
    with pytest.raises(UserError, match="n.jsonl line 2: a number too long to read"):
        list(read_conversations([source]))
    first = write_lines(tmp_path / "first.jsonl", [line, CHAT])  # was read as text records
    with pytest.raises(UserError, match="first.jsonl line 1: a number too long to read"):
        conversation_files(str(first))


def test_a_conversation_in_a_json_file_says_chat_data_is_jsonl(tmp_path, capsys):
    """It said only "a conversation among texts"."""
    source = tmp_path / "one.json"
    source.write_text(json.dumps(CHAT))
    out = tmp_path / "out"
    code = run_command(prepare_command.main, ["--source", str(source), "--out", str(out)])
    assert code != 0 and not out.exists()
    assert "a chat dataset is .jsonl files of conversations alone" in capsys.readouterr().err
