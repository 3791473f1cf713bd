"""sampling/prefixes.py: a prompt that starts with kept tokens prefills only the rest, and chooses
the tokens a cold prefill chooses; the store stays under its cap and forgets the oldest first."""

import os

import pytest
import torch
from test_slots import Recorder, alone
from test_variants import make_model

from model import ModelArgs, Transformer
from picollama.components.length import stretched
from picollama.kernels.caches import Sinks
from picollama.kernels.fused_step import DecodeStep
from picollama.sampling import slots as slots_module
from picollama.sampling.decode import DecodeOptions, decode_rows
from picollama.sampling.prefixes import PrefixStore, reusable
from picollama.sampling.rows import Row
from picollama.sampling.sampler import Sampling
from picollama.sampling.slots import Slots

SMOLLM2 = os.environ.get("PICOLLAMA_SMOLLM2_GGUF")
SYSTEM = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45]  # a system prompt clients share
SAMPLINGS = [Sampling(10, 0.0), Sampling(10, 1.0, top_k=20, seed=3)]  # greedy and seeded


@pytest.fixture(scope="module")
def model(one_thread):
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=512)
    return Transformer(ModelArgs(**{**args.to_dict(), "multiple_of": 16})).eval()


def decoded(model, prompt: list[int], sampling: Sampling, options=None) -> list[int]:
    """One row's tokens through decode_rows, watched as the server watches them."""
    options = options or DecodeOptions()
    return decode_rows(model, [Row(prompt, sampling)], lambda r, t: False, options=options)[0]


def big_store() -> PrefixStore:
    return PrefixStore(1 << 30)


@pytest.mark.parametrize("kv", [None, torch.int8], ids=["same", "int8"])
@pytest.mark.parametrize("fused", [False, True], ids=["forward", "fused"])
def test_a_conversations_next_turn_reuses_its_prefix_and_chooses_as_cold(model, fused, kv):
    """decode_rows (the chat's and static batches' loop): turn 2 starts with turn 1's prompt and
    answer, so it prefills only the new message, and chooses what a cold prefill chooses."""
    step = DecodeStep(model, kv_dtype=kv) if fused else None
    for sampling in SAMPLINGS:
        store = big_store()
        options = DecodeOptions(step, prefixes=store)
        turn = SYSTEM + [2, 3, 4]
        answer = decoded(model, turn, sampling, options)
        assert store.count == 1 and store.tokens == len(turn) + len(answer) - 1  # the last unfed
        turn += answer + [6, 7, 8]
        warm = decoded(model, turn, sampling, options)
        assert store.reused == len(SYSTEM) + 3 + len(answer) - 1
        assert warm == decoded(model, turn, sampling, DecodeOptions(step))
        assert store.count == 1  # the conversation replaced its first turn


@pytest.mark.parametrize(
    "switch",
    [dict(position=p) for p in ("fox", "alibi", "nope", "learned", "prope")]
    + [dict(logn_attention=True, rope_original_max_seq_len=16)],
    ids=["fox", "alibi", "nope", "learned", "prope", "logn"],
)
def test_models_off_llamas_format_reuse_as_cold_in_static_batches(switch, one_thread):
    """Their own forward decodes them: FoX's forget-gate sums are kept with the keys."""
    model = make_model(**{"max_seq_len": 64, **switch})
    store = big_store()
    options = DecodeOptions(prefixes=store)
    answer = decoded(model, SYSTEM, SAMPLINGS[0], options)
    turn = SYSTEM + answer + [6, 7]
    for sampling in SAMPLINGS:
        assert decoded(model, turn, sampling, options) == decoded(model, turn, sampling)
    assert store.reused == len(SYSTEM) + len(answer) - 1 + len(turn) - 1


def test_a_changed_earlier_turn_reuses_only_what_comes_before_it(model):
    changed = SYSTEM + [2, 9, 4, 5, 6, 7]  # its second message token differs
    for sampling in SAMPLINGS:
        store = big_store()
        options = DecodeOptions(prefixes=store)
        decoded(model, SYSTEM + [2, 3, 4, 5, 6], sampling, options)
        assert decoded(model, changed, sampling, options) == decoded(model, changed, sampling)
        assert store.reused == len(SYSTEM) + 1 and store.count == 2


@pytest.mark.parametrize("kv", [None, torch.int8], ids=["same", "int8"])
def test_rows_joining_the_slots_reuse_kept_and_decoding_rows_and_choose_as_alone(model, kv):
    """Continuous batching: a client's next turn reuses what its last left in the store; another
    client's prompt with the same system prompt reuses it from a row still decoding."""
    store = big_store()
    step = DecodeStep(model, kv_dtype=kv)
    slots = Slots(model, step, prefixes=store)
    first = Row(SYSTEM + [2, 3], SAMPLINGS[1])
    record = Recorder()
    slots.join(first, record.on_token, record.on_done)
    while slots.slots:
        slots.advance()
    rows = [
        Row(SYSTEM + [2, 3] + record.tokens + [4, 5], SAMPLINGS[1]),  # the next turn
        Row(SYSTEM + [7, 8, 9], Sampling(30, 0.0)),  # a new client's, long
        Row(SYSTEM + [7, 8, 10, 11], SAMPLINGS[0]),  # while the last decodes
    ]
    records = [Recorder() for _ in rows]
    reused = []
    for row, recorded in zip(rows, records):
        before = store.reused
        slots.join(row, recorded.on_token, recorded.on_done)
        reused.append(store.reused - before)
        slots.advance()
    while slots.slots:
        slots.advance()
    # the first turn's prompt and answer but its last token (never fed); the system prompt; and
    # the prompt of the row decoding, to where they differ
    assert reused == [len(SYSTEM) + 2 + 9, len(SYSTEM), len(SYSTEM) + 2]
    cold = [cold_slot(model, step, row) for row in rows] if kv else [alone(model, r) for r in rows]
    assert [(r.tokens, r.reason) for r in records] == cold


def test_a_conversations_next_turn_finds_its_prefix_in_the_row_it_joins(model, monkeypatch):
    """The row a turn leaves holds its keys until another writes there: the next turn, joining it,
    reuses them without a copy and chooses as alone. A cache outgrown grows to twice its length
    at least, so the turns outgrowing it do not each copy the conversation anew."""
    store, copied = big_store(), []
    slots = Slots(model, DecodeStep(model), prefixes=store)
    load = slots_module.load

    def counted_load(layers, length, caches):
        copied.append(turn)
        load(layers, length, caches)

    monkeypatch.setattr(slots_module, "load", counted_load)
    conversation, capacities = SYSTEM + [2, 3], []
    for turn in range(4):
        row, record = Row(conversation, Sampling(60, 0.0)), Recorder()
        before = store.reused
        slots.join(row, record.on_token, record.on_done)
        while slots.slots:
            slots.advance()
        assert (record.tokens, record.reason) == alone(model, row)
        assert store.reused - before == (len(conversation) - 4 if turn else 0)
        capacities.append(slots.caches[0][0].shape[2])
        conversation = conversation + record.tokens + [4, 5, 6]
    # turn 1 outgrew the first cache (74: its row's end) and copied the kept turn into 148
    assert copied == [1] and capacities == [74, 148, 256, 512]


def test_a_free_row_that_a_step_wrote_is_not_reused_in_place(model):
    """Rows with no slot are fed at position 0 in a step: a row that left is reused from the
    store once a step ran, and chooses as alone."""
    store = big_store()
    slots = Slots(model, DecodeStep(model), prefixes=store)
    rows = [Row(SYSTEM + [2], Sampling(20, 0.0)), Row([3, 4], Sampling(20, 0.0))]
    rows.append(Row([3, 5], Sampling(20, 0.0)))
    rows.append(Row(SYSTEM + [5, 6, 7], Sampling(2, 0.0)))  # the last of a batch of 4: it leaves
    records = [Recorder() for _ in rows]
    for row, record in zip(rows, records):
        slots.join(row, record.on_token, record.on_done)
    while len(slots.slots) == 4:
        slots.advance()
    slots.advance()  # three rows in a batch of 4: writes position 0 of row 3
    again = Row(SYSTEM + [5, 6, 7] + records[3].tokens + [8], Sampling(10, 0.0))
    record = Recorder()
    slots.join(again, record.on_token, record.on_done)
    while slots.slots:
        slots.advance()
    assert (record.tokens, record.reason) == alone(model, again)


def cold_slot(model, step, row: Row) -> tuple[list[int], str]:
    """The row's tokens and end reason, decoded alone in slots that keep nothing."""
    slots, record = Slots(model, step), Recorder()
    slots.join(row, record.on_token, record.on_done)
    while slots.slots:
        slots.advance()
    return record.tokens, record.reason


def test_the_compiled_step_decodes_reused_prefixes_as_eager(model):
    """A row joining beside another (batch 2, the cache's length past the prompts)."""
    rows = [Row(SYSTEM + [2], SAMPLINGS[0]), Row(SYSTEM, SAMPLINGS[1])]
    got = []
    for compiled in (False, True):
        store = big_store()
        slots = Slots(model, DecodeStep(model, compiled=compiled), prefixes=store)
        records = [Recorder(), Recorder()]
        for row, record in zip(rows, records):
            slots.join(row, record.on_token, record.on_done)
        while slots.slots:
            slots.advance()
        got.append([r.tokens for r in records])
        assert store.reused == len(SYSTEM) - 1  # from the first, decoding: all but its last
    assert got[0] == got[1] == [alone(model, row)[0] for row in rows]


def test_the_store_stays_under_its_cap_and_forgets_the_least_recently_used(model):
    per_token = 2 * 2 * 2 * 8 * 4  # layers, keys and values, kv heads, head dim, float32
    store = PrefixStore(50 * per_token)
    options = DecodeOptions(prefixes=store)
    a, b, c = ([start] + list(range(20, 32)) for start in (1, 2, 3))  # 13 tokens, 22 kept each
    for prompt in (a, b):
        decoded(model, prompt, SAMPLINGS[0], options)
    store.longest(torch.tensor(a))  # a used again: b is now the least recently used
    decoded(model, c, SAMPLINGS[0], options)  # no room for three: b goes
    assert [int(kept.ids[0]) for kept in store.kept] == [1, 3]
    assert (store.count, store.tokens, store.bytes) == (2, 44, 44 * per_token)
    assert store.bytes <= store.capacity
    small = PrefixStore(25 * per_token)
    decoded(model, c, Sampling(30, 0.0), DecodeOptions(prefixes=small))
    assert small.tokens == 25 and small.bytes == small.capacity  # a long one keeps its start


def test_a_store_of_at_most_two_entries_drops_the_least_recently_used(model):
    store = big_store()
    store.most = 2
    options = DecodeOptions(prefixes=store)
    for first in (1, 2, 3):
        decoded(model, [first, 10, 11], SAMPLINGS[0], options)
    assert [int(k.ids[0]) for k in store.kept] == [2, 3]
    store.longest(torch.tensor([2, 10]))  # 2 used: 3 is now the oldest
    decoded(model, [4, 10], SAMPLINGS[0], options)
    assert [int(k.ids[0]) for k in store.kept] == [2, 4]


def test_no_reuse_where_cached_keys_follow_the_length_or_move(model):
    dynamic = stretched(model.args, "dynamic", 1024)
    assert not reusable(dynamic) and not reusable(model.args, Sinks(4, 64))
    assert reusable(model.args)
    store = big_store()
    sinks = DecodeOptions(sinks=Sinks(4, 64), prefixes=store)
    decoded(model, SYSTEM, SAMPLINGS[0], sinks)
    assert store.count == 0


def test_the_flag_sets_the_servers_cap_and_takes_it_from_the_memory_requests_may_use(model):
    from types import SimpleNamespace

    from picollama.serve.main import PREFIX_CACHE_MIB, parser, prefix_store

    def store(flags: list[str], free: int | None):
        served = SimpleNamespace(model=model, free=free)
        mib = parser().parse_args(["--run", "r", *flags]).prefix_cache_mib
        return prefix_store(served, mib), served.free

    default, left = store([], None)
    assert default.capacity == PREFIX_CACHE_MIB << 20 and left is None
    quarter, left = store([], 400 << 20)  # a quarter of what is free, where less
    assert quarter.capacity == 100 << 20 and left == 300 << 20
    given, left = store(["--prefix-cache-mib", "8"], 400 << 20)
    assert given.capacity == 8 << 20 and left == 392 << 20
    assert store(["--prefix-cache-mib", "0"], None) == (None, None)


@pytest.mark.skipif(not SMOLLM2, reason="set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file")
def test_smollm2s_template_renders_earlier_turns_as_decoded_so_a_chat_turn_reuses_them(one_thread):
    """generate.py --chat's Chat: turn 2 prefills only what follows turn 1's prompt and answer,
    and answers as a chat that keeps nothing. In float: the file's own Q4_1 rounds activations to
    int8, so a prefill in two pieces may round apart from one."""
    import io

    import generate
    from picollama.chat_template import load_chat_template
    from picollama.convert.main import imported_run
    from picollama.kernels.load import load_to_sample
    from picollama.sampling.chat import Chat

    args = generate.parser().parse_args(["--run", SMOLLM2, "--chat", "--quantize", "none"])
    model, tokenizer, _ = load_to_sample(args, torch.device("cpu"))
    template = load_chat_template(imported_run(SMOLLM2))
    chats = [Chat(model, tokenizer, template, Sampling(24, 0.0), None) for _ in range(2)]
    warm, cold = chats
    cold.prefixes = None
    for chat in chats:
        chat.step = DecodeStep(model)
    first = warm.answer("What is the capital of France?", io.StringIO())
    kept = warm.prefixes.kept[0].ids.tolist()
    second = warm.prompt({"role": "user", "content": "And of Italy?"})
    assert second[: len(kept)] == kept  # the first turn's tokens, its answer's as decoded
    assert warm.answer("And of Italy?", io.StringIO()) == cold_answer(cold, first)
    assert warm.prefixes.reused == len(kept) and warm.prefixes.count == 1


def cold_answer(chat, first: str) -> str:
    """The chat's answer to the second question after the first, with nothing kept."""
    import io

    question = {"role": "user", "content": "What is the capital of France?"}
    chat.history = [question, {"role": "assistant", "content": first}]
    return chat.answer("And of Italy?", io.StringIO())


@pytest.mark.skipif(not SMOLLM2, reason="set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file")
def test_smollm2_through_the_server_reuses_a_conversation_and_answers_as_without(tmp_path):
    """The real openai client: a server that keeps prefixes answers a conversation's turns, greedy
    and seeded, as one that keeps none, and /health counts what it keeps and reuses. In float: the
    file's own Q4_1 rounds activations to int8, so a prefill in two pieces may round apart."""
    from test_serve import Server

    asked = [{"role": "user", "content": "What is the capital of France?"}]
    answers = {}
    for name, flags in (("with", []), ("without", ["--prefix-cache-mib", "0"])):
        server = Server(tmp_path / name, SMOLLM2, "--threads", "1", "--quantize", "none", *flags)
        try:
            answers[name] = conversations(server, asked), server.health()["engine"]
        finally:
            server.stop()
    (turns, engine), (cold, nothing) = answers["with"], answers["without"]
    assert [turn[:2] for turn in turns] == [turn[:2] for turn in cold]
    assert nothing["kept_prefixes"] == nothing["reused_prefix_tokens"] == 0
    # a second turn reuses the first's prompt and answer as decoded (but the last token chosen,
    # never fed); the seeded conversation's first turn, the greedy one's prompt but its last
    greedy, seeded = turns[:2], turns[2:]
    assert [turn[3] for turn in turns] == [
        0,
        greedy[0][1] + greedy[0][2] - 1,
        greedy[0][1] - 1,
        seeded[0][1] + seeded[0][2] - 1,
    ]
    assert engine["kept_prefixes"] == 2 and engine["kept_prefix_tokens"] > turns[-1][1]


def conversations(server, asked: list[dict]) -> list[tuple]:
    """Two turns after `asked`, greedy then seeded: (reply, prompt tokens, completion tokens,
    tokens reused) of each."""
    client = server.client("no key needed")
    turns = []
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}):
        messages = list(asked)
        for question in ("And of Italy?", None):
            before = server.health()["engine"]["reused_prefix_tokens"]
            said = client.chat.completions.create(
                model="run", messages=messages, max_tokens=16, **sampling
            )
            reused = server.health()["engine"]["reused_prefix_tokens"] - before
            reply, usage = said.choices[0].message.content, said.usage
            turns.append((reply, usage.prompt_tokens, usage.completion_tokens, reused))
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": question},
            ]
    return turns


def test_the_serving_benchmarks_turns_hold_one_conversation(tmp_path, bench_main, capsys):
    import json

    from picollama.cli.command import run_command
    from picollama.lab.bench import common
    from picollama.lab.bench.serve import parse_args

    (tmp_path / "m.gguf").write_bytes(b"")
    given = ["--gguf", str(tmp_path / "m.gguf"), "--servers", "ours", "--turns", "10"]
    assert parse_args(given).out == common.RESULTS_DIR / "serve_turns.json"  # not serve.json's
    if not SMOLLM2:
        pytest.skip("set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file")
    out = tmp_path / "turns.json"
    argv = ["--smoke", "--gguf", SMOLLM2, "--servers", "ours", "--turns", "3", "--out", str(out)]
    assert run_command(bench_main("serve"), argv) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    ours = result["results"]["ours"]
    assert result["turns"] == len(ours["ttft_seconds"]) == 3 and result["message_tokens"] > 0
    first, second, third = ours["prompt_tokens"]
    assert first < second < third  # each turn after the turns before and their answers
    assert ours["last_over_first"] == ours["ttft_seconds"][2] / ours["ttft_seconds"][0]
    assert "| last / first |" in out.with_suffix(".md").read_text()
