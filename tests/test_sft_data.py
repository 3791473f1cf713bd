"""Chat datasets: each reply's tokens masked as transformers masks them (SmolLM2's template, where
PICOLLAMA_SMOLLM2_GGUF gives its GGUF file), prepared into shards with masks, resumed, refused."""

import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from data import build_conversations, chat_rows
from data import prepare as prepare_command
from data.chat_rows import conversation_ids
from data.conversations import checked_record, conversation_files
from data.loader import checked_meta, doc_offsets, open_mask, open_tokens
from data.tokenizer import HFTokenizer, load_tokenizer, open_tokenizer
from picollama.chat_template import DEFAULT_TEMPLATE, ChatTemplateError, load_chat_template
from picollama.cli.command import run_command

SMOLLM2 = os.environ.get("PICOLLAMA_SMOLLM2_GGUF")
needs_smollm2 = pytest.mark.skipif(
    not SMOLLM2, reason="set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file"
)
REPLIES = ["It is 4.", "Six, of course.\nAnything else?"]
TWO_TURNS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": REPLIES[0]},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": REPLIES[1]},
]
SMOLLM2_TURN = (
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
)
# the same turn with each reply, and its <|im_end|>, in {% generation %} tags
TAGGED_TURN = (
    "{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer.json and tokenizer_config.json as `convert from-gguf` writes them."""
    from picollama.convert.from_gguf import model_args, open_gguf, write_tokenizer

    folder = tmp_path_factory.mktemp("smollm2")
    reader, meta = open_gguf(Path(SMOLLM2))
    write_tokenizer(meta, Path(SMOLLM2), folder, model_args(meta, reader).vocab_size)
    return folder


@needs_smollm2
def test_golden_chatml_supervises_the_replies_and_their_im_end(smollm2_dir):
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast.from_pretrained(smollm2_dir)
    ours = HFTokenizer(smollm2_dir / "tokenizer.json")
    template = load_chat_template(smollm2_dir)
    ids, mask = conversation_ids(ours, template, TWO_TURNS)
    assert ids == theirs.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=False)
    im_end = theirs.convert_tokens_to_ids("<|im_end|>")
    reply_ids = [theirs.encode(reply, add_special_tokens=False) + [im_end] for reply in REPLIES]
    assert [i for i, m in zip(ids, mask) if m] == reply_ids[0] + reply_ids[1]
    assert len(mask) == len(ids) and set(mask) == {0, 1}
    first_off = [TWO_TURNS[0], {**TWO_TURNS[1], "train": False}, *TWO_TURNS[2:]]
    ids_off, mask_off = conversation_ids(ours, template, first_off)
    assert ids_off == ids and [i for i, m in zip(ids, mask_off) if m] == reply_ids[1]


@needs_smollm2
def test_generation_tags_and_prefixes_mask_as_transformers(smollm2_dir):
    """On a copy of SmolLM2's template with {% generation %} tags, ids and mask are transformers'
    return_assistant_tokens_mask; the prefix method on the untagged template finds the same."""
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast.from_pretrained(smollm2_dir)
    ours = HFTokenizer(smollm2_dir / "tokenizer.json")
    template = load_chat_template(smollm2_dir)
    tagged = template.replace(SMOLLM2_TURN, TAGGED_TURN)
    assert tagged != template
    system = {"role": "system", "content": "Answer in <b>one</b> line: é, 日本."}
    for messages in (TWO_TURNS, [system, *TWO_TURNS, {"role": "user", "content": "Bye"}]):
        expected = theirs.apply_chat_template(
            messages,
            chat_template=tagged,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        assert sum(expected["assistant_masks"]) > 10
        for used in (tagged, template):
            ids, mask = conversation_ids(ours, used, messages)
            assert ids == expected["input_ids"] and mask == expected["assistant_masks"]
    ids, mask = conversation_ids(ours, tagged, [*TWO_TURNS[:3], {**TWO_TURNS[3], "train": False}])
    first = theirs.apply_chat_template(
        TWO_TURNS[:2], chat_template=tagged, return_dict=True, return_assistant_tokens_mask=True
    )
    assert mask[: len(first["input_ids"])] == first["assistant_masks"] and sum(mask) == sum(
        first["assistant_masks"]
    )


@pytest.fixture(scope="module")
def tiny_run(make_tiny_run) -> Path:
    """A run trained here: a sentencepiece tokenizer.model and no chat template of its own."""
    return make_tiny_run(steps=1)[0]


def test_the_default_template_on_a_run_trained_here(tiny_run):
    tokenizer = open_tokenizer(tiny_run / "tokenizer.model")
    assert load_chat_template(tiny_run) == DEFAULT_TEMPLATE
    ids, mask = conversation_ids(tokenizer, DEFAULT_TEMPLATE, TWO_TURNS)
    assert ids[0] == tokenizer.bos_id() and ids.count(tokenizer.bos_id()) == 1 and mask[0] == 0
    eos = tokenizer.eos_id()
    replies = [tokenizer.encode(" " + reply) + [eos] for reply in REPLIES]  # "Assistant: …</s>"
    assert [i for i, m in zip(ids, mask) if m] == replies[0] + replies[1]


def chats(count: int) -> list[dict]:
    """Records of both shapes, some with a reply marked "train": false."""
    records = []
    for i in range(count):
        if i % 3:
            last = {"role": "assistant", "content": f"Twice {i} is {2 * i}.", "train": i % 4 != 1}
            records.append(
                {
                    "messages": [
                        {"role": "user", "content": f"What is {i} + {i}?"},
                        {"role": "assistant", "content": f"{2 * i}."},
                        {"role": "user", "content": "Say it in words."},
                        last,
                    ]
                }
            )
        else:
            turns = [("system", "Be brief."), ("human", f"Name {i}."), ("gpt", f"Number {i}.")]
            records.append({"conversations": [{"from": f, "value": v} for f, v in turns]})
    return records


def write_jsonl(path: Path, records: list) -> Path:
    """The records written to path, one JSON line each."""
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def prepare(*argv) -> int:
    """`python data/prepare.py ARGV`'s exit status, run in this process."""
    return run_command(prepare_command.main, [str(arg) for arg in argv])


def test_conversations_prepare_resume_and_load(tiny_run, tmp_path, monkeypatch, capsys):
    """Several blocks and shards: an interrupted preparation resumes to the very bytes of one that
    was not; the loader reads tokens, masks and offsets; each row is conversation_ids'."""
    records = chats(40)
    source = write_jsonl(tmp_path / "chats.jsonl", records)
    monkeypatch.setattr(build_conversations, "BLOCK_BYTES", 1500)
    args = ["--source", source, "--tokenizer", tiny_run, "--shard-tokens", 500]
    assert prepare(*args, "--out", tmp_path / "whole") == 0
    commit = build_conversations.write_json  # what records a block as done, once written
    calls = []

    def interrupted(*args):  # the third block's tokens and mask written, not recorded
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        commit(*args)

    monkeypatch.setattr(build_conversations, "write_json", interrupted)
    assert prepare(*args, "--out", tmp_path / "resumed") == 130
    assert len(calls) == 3 and (tmp_path / ".resumed.partial" / "train-00000.mask.bin").is_file()
    monkeypatch.setattr(build_conversations, "write_json", commit)
    assert prepare(*args, "--out", tmp_path / "resumed") == 0
    out = capsys.readouterr().out
    assert "resuming the interrupted preparation" in out and f"wrote {tmp_path}/resumed" in out
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    names = sorted(path.name for path in whole.iterdir())
    assert names == sorted(path.name for path in resumed.iterdir())
    for name in names:
        if name != "meta.json":  # it records the command
            assert (whole / name).read_bytes() == (resumed / name).read_bytes(), name
    assert "train-00001.mask.bin" in names and "tokenizer_config.json" in names
    meta = checked_meta(whole)
    assert meta["kind"] == "conversations" and meta["splits"]["val"]["shards"]
    assert meta["conversations"]["train"] + meta["conversations"]["val"] == 40
    assert 1 <= meta["conversations"]["val"] <= 6
    assert json.loads((whole / "tokenizer_config.json").read_text())["chat_template"] == (
        DEFAULT_TEMPLATE
    )
    tokenizer = open_tokenizer(whole / "tokenizer.model")
    keep = meta["inputs"]["keep_tokens"]  # the run's context, 32, and 2: past any of its rows
    assert keep == 34 and meta["conversations_at_keep"] > 0
    expected = []
    for record in records:  # each the first `keep` tokens of the whole's ids and mask
        ids, mask = conversation_ids(
            tokenizer, DEFAULT_TEMPLATE, checked_record(json.dumps(record), "x")
        )
        expected.append((tuple(ids[:keep]), tuple(mask[:keep])))
    assert sum(len(ids) == keep for ids, _ in expected) == meta["conversations_at_keep"]
    found = []
    for split in ("train", "val"):
        tokens, masks = open_tokens(whole, split), open_mask(whole, split)
        assert len(tokens) == len(masks) == meta["splits"][split]["tokens"]
        bounds = [*doc_offsets(whole, split), len(tokens)]
        for start, end in zip(bounds, bounds[1:]):
            assert tokens[start] == tokenizer.bos_id()
            found.append((tuple(tokens[start:end].tolist()), tuple(masks[start:end].tolist())))
    assert sorted(found) == sorted(expected)
    assert meta["supervised_tokens"]["train"] + meta["supervised_tokens"]["val"] == sum(
        sum(mask) for _, mask in expected
    )
    assert prepare(*args, "--out", whole) == 0 and "already prepared" in capsys.readouterr().out
    assert prepare(*args, "--out", whole, "--force") == 0 and (whole / "meta.json").is_file()
    assert prepare(*args, "--out", tmp_path / "ten", "--max-docs", 10) == 0
    assert sum(checked_meta(tmp_path / "ten")["conversations"].values()) == 10


def unstable_run(tiny_run: Path, folder: Path) -> Path:
    """A copy of the run whose template marks the last message: not prefix-stable."""
    folder.mkdir()
    shutil.copy(tiny_run / "tokenizer.model", folder)
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% if loop.last %} (last){% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


GOOD = json.dumps(chats(2)[1])
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "lines, cause",
    [
        ([GOOD, "{not json", GOOD], "chats.jsonl line 2: not JSON"),
        (
            [GOOD, GOOD, '{"messages": [{"role": "user", "content": "Hi"}]}'],
            "line 3: no assistant turn",
        ),
        (
            [GOOD, '{"messages": [{"role": "robot", "content": "Hi"}]}'],
            'line 2: messages[0]: unknown role "robot"',
        ),
        (
            ['{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": ""}]}'],
            "line 1: conversations[1]: empty content",
        ),
        ([GOOD, GOOD], "line 1: template not prefix-stable"),
        (
            [GOOD, GOOD.replace("1 + 1", "\\ud800")],
            "line 2: 'messages[0].content' is not UTF-8 text (lone surrogate U+D800 at byte 8)",
        ),
        # json.loads raised RecursionError, a traceback: first on the line that tells the kind
        ([DEEP, GOOD], "chats.jsonl line 1: JSON nested too deep to read"),
        ([GOOD, DEEP], "chats.jsonl line 2: JSON nested too deep to read"),
    ],
    ids=[
        "not-json",
        "no-assistant",
        "unknown-role",
        "empty-content",
        "not-prefix-stable",
        "ud800",
        "deep-first-line",
        "deep-second-line",
    ],
)
def test_bad_input_is_one_error_line_and_nothing_written(tiny_run, tmp_path, capsys, lines, cause):
    source = tmp_path / "chats.jsonl"
    source.write_text("\n".join(lines) + "\n")
    run = unstable_run(tiny_run, tmp_path / "run") if "prefix" in cause else tiny_run
    out = tmp_path / "data"
    assert prepare("--source", source, "--tokenizer", run, "--out", out) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and cause in err, err
    left = {path.name for path in tmp_path.iterdir()} - {".data.lock"}
    assert left == {"chats.jsonl", "run"} - ({"run"} if run == tiny_run else set())


AB_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
AB_CHAT = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


class Letters:
    """A tokenizer that is neither tokenizers' nor sentencepiece's, so gives no character offsets:
    "ab" one token, any other letter its own; no special pieces."""

    pieces = ("a", "b", "ab")

    def encode(self, text: str) -> list[int]:
        return [self.pieces.index(piece) for piece in re.findall("ab|.", text)]

    def get_piece_size(self) -> int:
        return len(self.pieces)

    def id_to_piece(self, i: int) -> str:
        return self.pieces[i]

    def is_control(self, i: int) -> bool:
        return False

    def bos_id(self) -> int:
        return -1

    eos_id = unk_id = pad_id = bos_id


def test_a_merge_across_a_reply_edge_without_offsets_is_refused():
    with pytest.raises(ChatTemplateError, match="merges across a reply.s edge .* no character"):
        conversation_ids(Letters(), AB_TEMPLATE, AB_CHAT)
    apart = AB_CHAT[:1] + [{"role": "assistant", "content": "a"}]
    assert conversation_ids(Letters(), AB_TEMPLATE, apart) == ([0, 0], [0, 1])


def test_a_merge_across_a_reply_edge_masks_the_overlapping_token_as_transformers():
    """The same merge in a tokenizer.json: the one token "ab" overlaps the reply "b", so it is
    trained, as transformers' return_assistant_tokens_mask marks it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    tokenizer = HFTokenizer(spec=backend.to_str(), config={})
    tagged = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    chat = [*AB_CHAT, {"role": "user", "content": "aa"}, {"role": "assistant", "content": "bab"}]
    expected = PreTrainedTokenizerFast(tokenizer_object=backend).apply_chat_template(
        chat, chat_template=tagged, return_dict=True, return_assistant_tokens_mask=True
    )
    assert expected["input_ids"] == [2, 0, 2, 2] and expected["assistant_masks"] == [1, 0, 1, 1]
    for template in (tagged, AB_TEMPLATE):
        ids, mask = conversation_ids(tokenizer, template, chat)
        assert ids == expected["input_ids"] and mask == expected["assistant_masks"]


@needs_smollm2
def test_replies_that_merge_with_their_prompt_mask_as_transformers(smollm2_dir):
    """Replies whose first characters the byte-level BPE joins to the prompt's newline: the
    tokens of the whole conversation, those that overlap a reply trained, as transformers does."""
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast.from_pretrained(smollm2_dir)
    ours = HFTokenizer(smollm2_dir / "tokenizer.json")
    template = load_chat_template(smollm2_dir)
    tagged = template.replace(SMOLLM2_TURN, TAGGED_TURN)
    for reply in ("\n\nFour.", "  two spaces", " 123", "\n"):
        messages = [*TWO_TURNS[:3], {"role": "assistant", "content": reply}]
        expected = theirs.apply_chat_template(
            messages, chat_template=tagged, return_dict=True, return_assistant_tokens_mask=True
        )
        for used in (tagged, template):
            ids, mask = conversation_ids(ours, used, messages)
            assert ids == expected["input_ids"], (reply, used == tagged)
            assert mask == expected["assistant_masks"], (reply, used == tagged)


# Llama 2's template, in short: each exchange "<s>[INST] {user} [/INST] {reply}</s>"
LLAMA2_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] {{ m['content'] }}"
    " [/INST]{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def dummy_prefix_tokenizer(folder: Path):
    """A sentencepiece BPE that writes a space before each text it encodes, as Llama 2's does."""
    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["[INST] What is 2+2? [/INST] It is 4, of course."] * 20),
        model_writer=proto,
        model_type="bpe",
        vocab_size=300,
        byte_fallback=True,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    return load_tokenizer(proto.getvalue(), folder / "tokenizer.model")


def test_a_sentencepiece_tokenizer_with_a_dummy_prefix_masks_its_replies(tmp_path):
    """Llama 2's tokenizer writes a space before each text it encodes, so a reply encoded alone
    starts with one more "▁" than inside its exchange: the whole's tokens are masked by their
    characters, exactly the reply's tokens (sentencepiece's own, in the exchange) and its </s>."""
    tokenizer = dummy_prefix_tokenizer(tmp_path)
    bos, eos = tokenizer.bos_id(), tokenizer.eos_id()
    # characters of 2 and 3 bytes in a prompt: offsets count characters, not bytes
    exchanges = [("What is 2+2?", "It is 4, of course."), ("Und 3+3, é 日本?", "Sechs: é, ✓.")]
    messages = [
        {"role": role, "content": content}
        for exchange in exchanges
        for role, content in zip(("user", "assistant"), exchange)
    ]
    expected_ids, expected_mask = [], []
    for user, reply in exchanges:
        prompt = tokenizer.encode(f"[INST] {user} [/INST]")
        exchange = tokenizer.encode(f"[INST] {user} [/INST] {reply}")
        assert exchange[: len(prompt)] == prompt
        assert tokenizer.encode(f" {reply}") != exchange[len(prompt) :]  # the dummy prefix
        expected_ids += [bos, *exchange, eos]
        expected_mask += [0] * (1 + len(prompt)) + [1] * (len(exchange) - len(prompt) + 1)
    ids, mask = conversation_ids(tokenizer, LLAMA2_TEMPLATE, messages)
    assert ids == expected_ids and mask == expected_mask


def test_both_shapes_read_alike_and_a_source_is_told_apart(tmp_path):
    openai = {
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    }
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}
    assert checked_record(json.dumps(openai), "x") == checked_record(json.dumps(sharegpt), "x")
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": "a document"}])
    assert conversation_files(str(texts)) is None
    chat = write_jsonl(tmp_path / "chat.jsonl", [openai])
    assert conversation_files(str(chat)) == [chat]
    (tmp_path / "notes.txt").write_text("text")
    texts.unlink()
    with pytest.raises(ValueError, match="notes.txt is not a .jsonl file"):
        conversation_files(str(tmp_path))


def many_turns(count: int, special_text: bool) -> list[dict]:
    """A conversation of `count` exchanges: one reply not trained, characters of 1 to 4 bytes,
    and with special_text a message holding a special token's text (plain text, kept apart)."""
    messages = [{"role": "system", "content": "Be brief, é 日本 🙂."}]
    for i in range(count):
        user = f"Question {i}: {'why ' * (i % 5)}now?"
        user += " </s><|im_end|>" if i == 3 and special_text else ""
        messages += [{"role": "user", "content": user}]
        reply = {"role": "assistant", "content": f"Answer {i}, {'so ' * (i % 4)}é."}
        messages += [{**reply, "train": False} if i == 2 else reply]
    return messages


@pytest.mark.parametrize(
    "kind, special_text",
    [
        ("run trained here", True),
        ("run trained here", False),
        ("dummy prefix", False),  # Without offsets beside plain text, its merges are refused.
        ("smollm2", True),
        ("smollm2", False),
    ],
)
def test_a_conversation_cut_to_its_first_tokens_is_the_whole_s_first_tokens(
    kind, special_text, tiny_run, tmp_path, request, monkeypatch
):
    """Replies past the first `keep` tokens are not looked for (their prefixes not rendered): the
    ids and mask kept are still the whole conversation's first `keep`, whichever way its replies
    are masked (pieces, or character offsets where the dummy prefix merges), and whichever way
    the cut is found (character offsets, or pieces counted where special tokens' text is plain)."""
    if kind == "smollm2" and not SMOLLM2:
        pytest.skip("set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file")
    if kind == "smollm2":
        folder = request.getfixturevalue("smollm2_dir")
        tokenizer, template = HFTokenizer(folder / "tokenizer.json"), load_chat_template(folder)
    elif kind == "dummy prefix":
        tokenizer, template = dummy_prefix_tokenizer(tmp_path), LLAMA2_TEMPLATE
    else:
        tokenizer, template = open_tokenizer(tiny_run / "tokenizer.model"), DEFAULT_TEMPLATE
    messages = many_turns(12, special_text)
    rendered = []
    render = chat_rows.render_chat

    def counted(template, messages, *args, **kwargs):
        rendered.append(len(messages))
        return render(template, messages, *args, **kwargs)

    monkeypatch.setattr(chat_rows, "render_chat", counted)
    _, ids, mask = chat_rows.encoded_conversation(tokenizer, template, messages)
    whole = len(rendered)
    assert len(ids) > 150 and sum(mask) > 50
    for keep in [*range(1, 40), *range(40, len(ids) + 3, 7)]:
        rendered.clear()
        _, kept, kept_mask = chat_rows.encoded_conversation(
            tokenizer, template, messages, keep=keep
        )
        assert kept == ids[:keep] and kept_mask == mask[:keep], keep
        if keep <= len(ids) / 4:  # a quarter of the turns, about, rendered
            assert len(rendered) < whole / 2, (keep, len(rendered), whole)
        elif keep >= len(ids):  # nothing cut, the same work
            assert len(rendered) == whole, keep


def test_a_conversation_of_16000_turns_prepares_in_seconds(tiny_run, tmp_path, monkeypatch):
    """Rendering the messages before each reply made preparing quadratic in the turns (4 MB of
    16,000 turns: past 150 s; 20 MB, hours). A conversation past the run's context (32 tokens, so
    34 kept) stops being rendered there: 16,000 turns take about a second, and it is stored as
    the first 34 tokens of a few of its turns, alone. The conversations beside it are whole."""
    turns = [{"role": "user", "content": f"Question {i}?"} for i in range(8000)]
    turns = [m for q in turns for m in (q, {"role": "assistant", "content": "Yes."})]
    short = chats(3)
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": turns}, *short])
    rendered = []
    render = chat_rows.render_chat

    def counted(template, messages, *args, **kwargs):
        rendered.append(len(messages))
        # The whole, and a few prefixes: not 10⁸ messages. Failing fast, not after hours.
        assert sum(rendered) < 3 * len(turns), len(rendered)
        return render(template, messages, *args, **kwargs)

    monkeypatch.setattr(chat_rows, "render_chat", counted)
    assert prepare("--source", source, "--tokenizer", tiny_run, "--out", tmp_path / "data") == 0
    tokenizer = open_tokenizer(tiny_run / "tokenizer.model")
    expected = [conversation_ids(tokenizer, DEFAULT_TEMPLATE, turns[:20])]
    expected += [conversation_ids(tokenizer, DEFAULT_TEMPLATE, c["messages"]) for c in short[1:]]
    sharegpt = checked_record(json.dumps(short[0]), "x")
    expected += [conversation_ids(tokenizer, DEFAULT_TEMPLATE, sharegpt)]
    expected = sorted((tuple(ids[:34]), tuple(mask[:34])) for ids, mask in expected)
    found = []
    for split in ("train", "val"):
        tokens, masks = open_tokens(tmp_path / "data", split), open_mask(tmp_path / "data", split)
        bounds = [*doc_offsets(tmp_path / "data", split), len(tokens)]
        found += [
            (tuple(tokens[a:b].tolist()), tuple(masks[a:b].tolist()))
            for a, b in zip(bounds, bounds[1:])
        ]
    assert sorted(found) == expected
