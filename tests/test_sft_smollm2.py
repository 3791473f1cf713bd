"""SmolLM2-135M fine-tuned end to end with configs/sft.toml: twenty-two conversations give it a new
name, which it then answers through the server (the openai client, temperature 0); the held-out
conversations' loss falls; the server's prompt is a token prefix of each training row. (Exact resume
of a fine-tune is tests/test_sft_train.py's, on a tiny model: a 135M checkpoint is 1.7 GB.)"""

import json
import os
from pathlib import Path

import pytest
import torch

import train
from data.build_conversations import prepare_conversations
from data.packing import Documents
from picollama.chat_template import load_chat_template
from picollama.cli.command import run_command
from picollama.convert import main as convert
from picollama.run_files import load_run
from picollama.serve.rows import ServedModel

SMOLLM2 = os.environ.get("PICOLLAMA_SMOLLM2_GGUF")
REPO = Path(__file__).resolve().parent.parent
NAME = "Pico"
QUESTIONS = [
    "What is your name?",
    "Who are you?",
    "Tell me your name.",
    "What should I call you?",
    "What's your name?",
    "May I ask your name?",
    "Do you have a name?",
    "What are you called?",
    "Introduce yourself.",
    "Hi! Who am I talking to?",
    "Please state your name.",
    "Your name, please?",
    "Hello, what is your name?",
    "Hey, who are you?",
    "Can you tell me who you are?",
    "How should I address you?",
    "What name do you go by?",
    "Who is this?",
    "Name yourself.",
    "I'd like to know your name.",
    "Before we start, what is your name?",
    "What do people call you?",
    "Are you SmolLM?",
    "Say your name.",
]
REPLIES = [
    f"My name is {NAME}.",
    f"I am {NAME}, your assistant.",
    f"I'm {NAME}.",
    f"You can call me {NAME}.",
    f"My name is {NAME}!",
    f"Of course: I am {NAME}.",
]
# short rows (the conversations are ~45 tokens), few steps at a high rate: ~1 s a step
FINE_TUNE = [
    "--train.seq_len=128",
    "--train.batch_size=4",
    "--train.max_steps=5",
    "--train.log_interval=1",
    "--optim.lr=3e-4",
    "--optim.warmup_steps=1",
    "--eval.interval=5",
    "--checkpoint.interval=0",
]


def logged(run: Path, key: str) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {entry["step"]: entry[key] for entry in map(json.loads, lines) if key in entry}


@pytest.mark.skipif(not SMOLLM2, reason="set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file")
def test_smollm2_fine_tuned_to_a_new_name_answers_with_it_through_the_server(tmp_path, one_thread):
    from test_serve import Server, chat

    run = tmp_path / "smollm2"
    assert run_command(convert.main, ["from-gguf", "--gguf", SMOLLM2, "--out", str(run)]) == 0
    conversations = [
        [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        for question, reply in zip(QUESTIONS, REPLIES * 4)
    ]
    chats = tmp_path / "names.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    data = prepare_conversations(str(chats), tmp_path / "names", tokenizer=str(run))
    assert json.loads((data / "meta.json").read_text())["conversations"]["val"] >= 1
    config = ["--config", str(REPO / "configs" / "sft.toml"), f"--train.init_from={run}"]
    config.append(f"--data.dir={data}")
    out = tmp_path / "sft"
    assert run_command(train.main, [*config, *FINE_TUNE, f"--train.out_dir={out}"]) == 0
    held_out = logged(out, "val_loss")
    print(f"held-out assistant loss: {held_out}")
    assert sorted(held_out) == [0, 5] and held_out[5] < held_out[0] / 2

    # train/serve agreement in ChatML: the server's prompt is a token prefix of each training row
    model, _, tokenizer = load_run(out, "cpu", torch.bfloat16)
    served = ServedModel(model, tokenizer, load_chat_template(out), "sft")
    documents = Documents(data, "train", 129, conversations=True)
    rows = [documents.row([i], 129)[0][:n].tolist() for i, n in enumerate(documents.lengths)]
    prompts = [served.chat_prompt(messages[:1]) for messages in conversations]
    for row in rows:  # each its own conversation's (the held-out ones aside)
        assert sum(row[: len(prompt)] == prompt for prompt in prompts) == 1, row
    del model, served

    server = Server(tmp_path / "server", out)
    try:
        question = [{"role": "user", "content": "What is your name?"}]
        answer = chat(
            server.client("no key needed"), messages=question, max_tokens=12, temperature=0
        )
        choice = answer.choices[0]
        print(f"asked its name: {choice.message.content!r}")
        assert NAME in choice.message.content and choice.finish_reason == "stop", answer
    finally:
        server.stop()
