"""The serving benchmark's --smoke: our server, llama.cpp's llama-server (where its binary is
built) and llama-cpp-python's on the SmolLM2 file, one client, four tokens each; bad input is one
error line before any server starts."""

import json
import os
import tempfile
from pathlib import Path

import pytest

from picollama.cli.command import run_command
from picollama.lab.bench import common, serve_load
from picollama.lab.bench.serve import PROMPTS, parse_args
from picollama.lab.bench.serve_load import Sample, TurnText, conversation

SMOLLM2 = os.environ.get("PICOLLAMA_SMOLLM2_GGUF")


@pytest.mark.skipif(not SMOLLM2, reason="set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file")
def test_smoke_run_measures_the_servers_on_the_same_file(tmp_path, bench_main, capsys, llama_cpp):
    out = tmp_path / "serve.json"
    code = run_command(bench_main("serve"), ["--smoke", "--gguf", SMOLLM2, "--out", str(out)])
    said = capsys.readouterr()
    assert code == 0, said.err
    assert f"results written to {out}" in said.out and str(out.with_suffix(".md")) in said.out
    result = json.loads(out.read_text())
    assert result["benchmark"] == "serve" and result["max_tokens"] == 4
    peers = ["llama_server"] * parse_args(["--gguf", SMOLLM2]).llama_server.is_file()
    assert sorted(result["results"]) == sorted(["ours", "llama_cpp", *peers])
    ours, theirs = (result["results"][name]["levels"] for name in ("ours", "llama_cpp"))
    for (level,) in (ours, theirs, *(result["results"][p]["levels"] for p in peers)):
        assert level["clients"] == 1 and level["completion_tokens"] == 4
        assert 0 < level["ttft_p50_seconds"] <= level["seconds"]
        assert level["tokens_per_second"] == pytest.approx(4 / level["seconds"])
    # greedy on the same weights: the same words from both servers
    assert ours[0]["first_answer"] == theirs[0]["first_answer"] != ""
    (ratio,) = result["ours_over_llama_cpp"]
    speeds = ours[0]["tokens_per_second"], theirs[0]["tokens_per_second"]
    assert ratio["tokens_per_second"] == pytest.approx(speeds[0] / speeds[1])
    table = out.with_suffix(".md").read_text()
    assert "| 1 |" in table and "llama_cpp.server tokens/s" in table
    if peers:  # the anchor's ratio columns, and its command
        (ratio,) = result["ours_over_llama_server"]
        assert ratio["clients"] == 1 and "ours / llama-server: tokens/s" in table
        assert " -np 4 -c 8192 " in table


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gguf", "/no/such/model.gguf"], "--gguf /no/such/model.gguf: not a .gguf file"),
        (["--servers", "ours,vllm"], "unknown 'vllm' (choose from ours, llama_server, llama_cpp)"),
        (["--servers", "llama_server", "--llama-server", "/no/llama-server"], "no such file"),
        (["--clients", "1,0"], "'0' is not a positive int"),
    ],
)
def test_bad_input_is_one_error_line(args, message, tmp_path, capsys, bench_main):
    out = tmp_path / "serve.json"
    assert run_command(bench_main("serve"), [*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not out.exists()


def test_smoke_output_defaults_to_a_temporary_file(tmp_path, monkeypatch):
    # --smoke's figures (one request of 4 tokens) must never replace docs/results/serve.json
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"")
    given = ["--gguf", str(tmp_path / "m.gguf"), "--servers", "ours"]
    assert parse_args(given).out == common.RESULTS_DIR / "serve.json"
    smoke = parse_args(["--smoke", *given])
    assert smoke.temporary_out and smoke.out.parent.parent == tmp_path
    assert (smoke.clients, smoke.requests, smoke.max_tokens) == ([1], 1, 4)


@pytest.mark.skipif(not SMOLLM2, reason="set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file")
def test_a_conversation_grows_by_the_same_tokens_however_its_answers_end(monkeypatch):
    """--turns: each message is about the tokens asked, ends asking for a long answer, and is
    longer by what the answer before fell short of max_tokens."""
    texts = TurnText(Path(SMOLLM2), " ".join(PROMPTS), 30)
    sent, answers = [], iter([(64, "length"), (4, "stop"), (64, "length")])

    def answer(server, bodies):
        (body,) = bodies[0]
        sent.append(body["messages"][-1]["content"])
        tokens, finish = next(answers)
        return [Sample(0.0, 0.1, 0.2, "Fine.", finish, tokens)], 0.2

    monkeypatch.setattr(serve_load, "run_clients", answer)
    conversation(None, texts, 3, {"max_tokens": 64})
    lengths = [len(texts.tokenizer.encode(text)) for text in sent]
    assert all(text.endswith(TurnText.ASK_LONG) for text in sent)
    assert abs(lengths[0] - 30) <= 2 and abs(lengths[1] - 30) <= 2
    assert abs(lengths[2] - (30 + 60)) <= 2
    assert texts.restart().next(30) == sent[0]
