"""The RULER track (picollama/lab/context/ruler.py, ruler_tasks.py, ruler_report.py): its haystacks
hold what they ask, one prefill answers as fresh forwards do, scoring is RULER's string_match_all,
cells are kept, and the effective lengths follow from saved cells."""

import copy
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from data.tokenizer import HFTokenizer
from model import ModelArgs, Transformer, rope_frequencies
from picollama.cli import UserError
from picollama.cli.command import run_command
from picollama.components.length import stretched
from picollama.components.registry import ROPE_SCALINGS
from picollama.lab.context import ruler, ruler_report
from picollama.lab.context.cells import Cells
from picollama.lab.context.ruler_tasks import NOISE, TASKS, haystack, match_all
from picollama.run_files import save_model

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONTEXT = 256  # the tiny model's


@pytest.fixture(scope="module")
def tokenizer() -> HFTokenizer:
    """A byte-level BPE tokenizer.json with ChatML's specials, trained here on RULER's kind of
    text, so that a haystack of a few hundred tokens holds a few needles."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [spec.instruction + spec.question + spec.answer for spec in TASKS.values()]
    texts += [NOISE, "One of the special magic numbers for able-anchor is: 1234567.", "VAR A = 1"]
    backend.train_from_iterator(texts * 50, trainer)
    config = {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "add_bos_token": False}
    return HFTokenizer(spec=backend.to_str(), config=config | {"chat_template": CHATML})


@pytest.fixture(scope="module")
def model(tokenizer) -> Transformer:
    """A random float64 model, so that greedy choices never tie by rounding. Its weights are
    drawn 8 times wider than at init, so that its answers follow what it reads."""
    torch.manual_seed(0)
    args = ModelArgs(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=600, max_seq_len=CONTEXT
    )
    model = Transformer(args).double().eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            weight.mul_(1 if "norm" in name else 8)
    return model


def needles_of(text: str) -> dict[str, list[str]]:
    """Every key -> number needle in a text, by key, as RULER writes them."""
    found = {}
    for key, value in re.findall(r"One of the special magic numbers for (\S+) is: (\d+)\.", text):
        found.setdefault(key, []).append(value)
    return found


def holders(text: str, value: str) -> set[str]:
    """The variables a text's VAR lines assign `value`, following each chain to its number."""
    direct = dict(re.findall(r"VAR (\w+) = (\d+)", text))
    links = dict(re.findall(r"VAR (\w+) = VAR (\w+)", text))

    def resolve(name):
        return direct[name] if name in direct else resolve(links[name])

    return {name for name in direct.keys() | links.keys() if resolve(name) == value}


@pytest.mark.parametrize("task", list(TASKS))
def test_haystacks_are_seeded_and_hold_each_answer(tokenizer, task):
    made = haystack(task, tokenizer, CHATML, 1200, 4, seed=1)
    again = haystack(task, tokenizer, CHATML, 1200, 4, seed=1)
    other = haystack(task, tokenizer, CHATML, 1200, 4, seed=2)
    assert made.tokens == again.tokens and made.questions == again.questions
    assert made.tokens != other.tokens
    text = tokenizer.decode(made.tokens)
    assert text.count(NOISE) > 0 or task == "niah_multikey"
    for question in made.questions:
        asked = tokenizer.decode(question.tokens)
        assert question.key in asked and asked.endswith(TASKS[task].answer.format(key=question.key))
        assert len(made.tokens) + len(question.tokens) + TASKS[task].tokens <= 1200
        assert 0 <= question.depth <= 1
        if task == "vt":
            assert holders(text, question.key) == set(question.answers)
        else:  # Exactly its needles carry its key; other keys are the distractors.
            assert needles_of(text)[question.key] == question.answers
    if task == "niah_multikey":  # The filler is needles of other keys.
        assert len(needles_of(text)) > 3 * len(made.questions)
    longer = haystack(task, tokenizer, CHATML, 2400, 4, seed=1)
    assert [q.answers for q in longer.questions] == [q.answers for q in made.questions]
    room = 2400 - max(len(q.tokens) for q in longer.questions) - TASKS[task].tokens
    assert room - 40 < len(longer.tokens) <= room  # Within a filler line of filling the length.


def test_a_length_too_short_for_the_needles_is_refused(tokenizer):
    with pytest.raises(UserError, match="too few for 20 questions"):
        haystack("niah_multivalue", tokenizer, CHATML, 300, 20, seed=0)


def fresh_greedy(model, tokens: list[int], steps: int, stops: set[int]) -> list[int]:
    """Greedy decoding by a full forward of the whole row at each step, no cache."""
    made = []
    for _ in range(steps):
        choice = int(model(torch.tensor([tokens + made]))[0, -1].argmax())
        if choice in stops:
            break
        made.append(choice)
    return made


@pytest.mark.parametrize("method", ROPE_SCALINGS)
def test_kept_cache_answers_equal_fresh_forwards(model, tokenizer, monkeypatch, method):
    """Past the context: the haystack runs in chunks, each question follows it in turn over the
    last one's leftovers, and its greedy tokens are those of a fresh forward of the whole row.
    Its first logits are too, and they differ between questions: the model reads them."""
    monkeypatch.setattr(ruler, "CHUNK", 96)
    length = 2 * CONTEXT
    hay = haystack("niah_single", tokenizer, CHATML, length, 2, seed=0)
    start, base = len(hay.tokens), model.args
    model.args = ruler.method_args(base, method, length)
    assert model.args.rope_factor > 1 or method in ("none", "dynamic")
    with torch.inference_mode():
        try:
            ruler.prefill(model, hay.tokens, length)
            kept, first = [], []
            for q in hay.questions:
                kept.append(ruler.greedy(model, q.tokens, start, 6, set()))
                first.append(model(torch.tensor([q.tokens]), start_pos=start)[0, -1])
            model.reset_cache()
            fresh = [fresh_greedy(model, hay.tokens + q.tokens, 6, set()) for q in hay.questions]
            whole = [model(torch.tensor([hay.tokens + q.tokens]))[0, -1] for q in hay.questions]
        finally:
            model.args = base
            model.reset_cache()
    assert kept == fresh and all(len(k) == 6 for k in kept)
    for mine, theirs in zip(first, whole):
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-9)
    assert (first[0] - first[1]).abs().max() > 1e-3


def test_scores_are_rulers_string_match_all():
    answers = [["1234567"], ["ABCDE", "FGHIJ", "KLMNO"], ["7654321", "1111111"]]
    generated = [" 1234567.", "abcde, KLMNO and more", " none here"]
    # RULER's string_match_all, written out: references found, case-insensitive, per question.
    expected = sum(
        sum(r.lower() in g.lower() for r in refs) / len(refs) for refs, g in zip(answers, generated)
    )
    expected = round(expected / len(answers) * 100, 2)
    rows = [{"score": match_all(refs, g), "depth": 0.5} for refs, g in zip(answers, generated)]
    hay = SimpleNamespace(task="vt", tokens=[0] * 10)
    cell = ruler.cell_result("none", 4096, hay, rows, (2.0, 1.0))
    assert cell["score"] == expected and cell["correct"] == 1 and cell["questions"] == 3
    assert match_all(["1234567"], "The number is 12345678") == 1  # a substring, as RULER's


def study_options(**changes) -> SimpleNamespace:
    options = dict(run="tiny", seed=0, questions=3, lengths=[200, 400], tasks=["niah_single"])
    options["command"] = ["python", "-m", "picollama.lab.context.ruler", "--run", "tiny"]
    return SimpleNamespace(**options | {"methods": ["none", "yarn"]} | changes)


def test_cells_are_saved_shared_and_skipped_on_rerun(model, tokenizer, tmp_path, monkeypatch):
    cells = Cells(tmp_path)
    calls = []
    answer_all = ruler.answer_all

    def counted(model, tokenizer, hay, room, stops):
        calls.append(hay.length)
        return answer_all(model, tokenizer, hay, room, stops)

    monkeypatch.setattr(ruler, "answer_all", counted)
    methods = ["none", "yarn", "rerope"]
    ruler.run_study(model, tokenizer, CHATML, study_options(methods=methods), cells)
    saved = cells.results("ruler.")
    keys = [f"ruler.{m}.{n}.niah_single" for m in methods for n in (200, 400)]
    assert sorted(saved) == sorted(keys)
    # At 200 tokens, within the context, YaRN and ReRoPE are plain RoPE: none's cell, not rerun.
    assert calls == [200, 400, 400, 400]
    for method in methods[1:]:
        assert (
            saved[f"ruler.{method}.200.niah_single"]["copied_from"] == "ruler.none.200.niah_single"
        )
    for cell in saved.values():
        assert {"method", "length", "task", "questions", "correct", "score", "seconds"} <= set(cell)
        assert cell["questions"] == 3 and 0 <= cell["score"] <= 100
    calls.clear()
    ruler.run_study(model, tokenizer, CHATML, study_options(), cells)
    assert calls == [] and cells.results("ruler.") == saved
    cells.path("ruler.yarn.400.niah_single").unlink()
    ruler.run_study(model, tokenizer, CHATML, study_options(), cells)
    assert calls == [400] and cells.results("ruler.") == saved | {
        "ruler.yarn.400.niah_single": cells.done("ruler.yarn.400.niah_single")
    }
    calls.clear()  # another seed adds its own cells beside seed 0's, and shares its own
    ruler.run_study(model, tokenizer, CHATML, study_options(seed=1), cells)
    assert calls == [200, 400, 400]
    seeded = cells.done("ruler.yarn.200.niah_single.seed=1")
    assert seeded["copied_from"] == "ruler.none.200.niah_single.seed=1"
    assert seeded["setup"]["seed"] == 1 and len(cells.results("ruler.")) == 10
    with pytest.raises(UserError, match="another setup"):
        ruler.run_study(model, tokenizer, CHATML, study_options(questions=4), cells)


def cell(method: str, length: int, task: str, score: float, scores=None) -> dict:
    scores = [score / 100] if scores is None else scores
    return {"method": method, "length": length, "task": task, "score": score, "scores": scores}


def test_effective_lengths_from_cells_by_hand():
    scores = {  # method: (task a, task b) at 4k, 8k, 16k, 32k
        "none": ([90, 88, 60, 10], [95, 86, 70, 0]),  # means 92.5, 87, 65, 5
        "yarn": ([90, 90, 90, 80], [95, 85, 84, 70]),  # means 92.5, 87.5, 87, 75
        "linear": ([80, 80, 80, 80], [80, 80, 80, 80]),  # below 85.6 from the start
        "ntk": ([99, 99, 99, 99], [99, 99, None, 99]),  # 16k's task b not measured yet
    }
    results = {}
    for method, tasks in scores.items():
        for task, row in zip("ab", tasks):
            for length, score in zip((4096, 8192, 16384, 32768), row):
                if score is not None:
                    results[f"ruler.{method}.{length}.{task}"] = cell(method, length, task, score)
    found = ruler_report.effective_lengths(results)
    # Above 85.6 up to it; within 5 points of the 4k mean (92.5 - 5 = 87.5, reached by yarn).
    assert found["none"] == {"effective": 8192, "holds": 4096, "shortest": 92.5}
    assert found["yarn"] == {"effective": 16384, "holds": 8192, "shortest": 92.5}
    assert found["linear"] == {"effective": None, "holds": 32768, "shortest": 80.0}
    assert found["ntk"]["effective"] == 8192 and found["ntk"]["holds"] == 8192  # stops at a gap
    for key in results:
        results[key] |= {"correct": 1, "questions": 2}
    text = ruler_report.markdown(results)
    assert "| none | 92.5 | 87.0 | 65.0 | 5.0 | 8192 | 4096 |" in text
    assert "| linear | 80.0 | 80.0 | 80.0 | 80.0 | - | 32768 |" in text
    assert "| ntk | 99.0 | 99.0 | - | 99.0 | 8192 | 8192 |" in text


def test_changes_pair_each_question_with_its_own():
    """Two tasks of two questions: changes of +100 and 0 (a), 0 and -50 (b), so a mean of +12.5
    with the t-interval of four values (t at 97.5% with 3 degrees of freedom: 3.1824, the
    published table's)."""
    results = {}
    rows = {  # (method, length): (task a's scores, task b's)
        ("none", 4096): ([0, 1], [1, 1]),
        ("none", 8192): ([1, 1], [1, 0.5]),
        ("yarn", 4096): ([0, 1], [1, 1]),
        ("yarn", 8192): ([1, 1], None),  # task b not measured yet
        ("none", 16384): ([1, 0], [1, 1]),  # from 8192: 0, -100, 0, +50
    }
    for (method, length), tasks in rows.items():
        for task, scores in zip("ab", tasks):
            if scores is not None:
                score = 100 * float(np.mean(scores))
                results[f"{method}.{length}.{task}"] = cell(method, length, task, score, scores)
    found = ruler_report.changes(results, 4096)
    half = 3.1824 * np.std([100, 0, 0, -50], ddof=1) / 2
    assert found["none"][8192] == pytest.approx((12.5, 12.5 - half, 12.5 + half), abs=1e-2)
    assert found["yarn"] == {8192: None, 16384: None}
    assert ruler_report.changes(results, 8192)["none"][16384][0] == -12.5
    # Seed 1's questions at 4096 alone join 4096's mean but pair with none at 8192.
    for task, score in zip("ab", (0, 50)):
        seeded = cell("none", 4096, task, score, [score / 100] * 2) | {"setup": {"seed": 1}}
        results[f"none.4096.{task}.seed=1"] = seeded
    assert ruler_report.changes(results, 4096)["none"] == found["none"]
    assert ruler_report.mean_scores(results)["none"][4096] == pytest.approx((50 + 100 + 0 + 50) / 4)
    for key in results:
        results[key] |= {"correct": 1, "questions": 2}
    assert "Change from 8192" not in ruler_report.markdown(results)
    text = ruler_report.markdown(results, context=8192)  # from the model's context too
    assert "### Change from 8192" in text and "| none | -12.5 [" in text
    assert "| none | 25.0 (2/4) | 100.0 (1/2) |" in text  # task a: seeds 0 and 1, then 0
    assert f"| none | +12.5 [{12.5 - half:+.1f}, {12.5 + half:+.1f}] |" in text
    assert "| yarn | - |" in text


def test_the_command_writes_cells_and_a_table(model, tokenizer, tmp_path, capsys):
    source = tmp_path / "tokenizer.json"
    source.write_text(tokenizer.backend.to_str())
    run = save_model(copy.deepcopy(model).float(), tmp_path / "run", tokenizer=source)
    (run / "tokenizer_config.json").write_text(json.dumps(tokenizer.config))
    out = tmp_path / "cells"
    argv = ["--run", str(run), "--lengths", "1000", "--questions", "2", "--out", str(out)]
    chat = ["--tasks", "vt", "--template", "chat", "--dtype", "float32"]
    assert run_command(ruler.main, argv + chat) == 0
    printed = capsys.readouterr().out
    assert "| none | " in printed and f"in {out}" in printed
    assert (out / "ruler.none.1000.vt.json").is_file() and (out / "ruler.md").is_file()
    assert json.loads((out / "ruler.none.1000.vt.json").read_text())["setup"]["template"] == "chat"
    assert run_command(ruler.main, argv + ["--methods", "bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "bogus" in err
    # the report alone, from the cells: the same table, and the figure
    (out / "ruler.md").unlink()
    (out / "ruler.png").unlink()
    assert run_command(ruler_report.main, ["--out", str(out), "--context", "500"]) == 0
    text = (out / "ruler.md").read_text()
    assert "| none | " in text and (out / "ruler.png").stat().st_size
    assert f"python -m picollama.lab.context.ruler --run {run} --lengths 1000" in text
    assert "Setup: run run, seed 0, questions 2, template chat, dtype float32" in text
    assert run_command(ruler_report.main, ["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "no RULER cells" in err
    assert run_command(ruler_report.main, ["--out", str(out), "--context", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "--context" in err


def test_shared_cells_copy_only_equal_forwards(model):
    """Static scalings at factor 1 compute plain RoPE; past the context they differ."""

    def marks(length: int) -> set[str]:
        methods = ("none", "yarn", "linear")
        return {
            ruler.fingerprint(ruler.method_args(model.args, m, length), length, {}) for m in methods
        }

    assert len(marks(CONTEXT)) == 1 and len(marks(2 * CONTEXT)) == 3


def test_dynamic_ntk_is_held_at_its_frequencies_for_the_length(model):
    """Dynamic NTK (Hugging Face's _compute_dynamic_ntk_parameters) at seq_len L turns by base'
    = base·(s·L/original - (s - 1))^(d/(d-2)); the held form keeps them for every chunk."""
    length, args = 4 * CONTEXT, model.args
    held = ruler.method_args(args, "dynamic", length)
    s, d = stretched(args, "dynamic", length).rope_factor, args.head_dim
    base = args.rope_theta * (s * length / CONTEXT - (s - 1)) ** (d / (d - 2))
    expected = 1.0 / base ** (np.arange(0, d, 2) / d)
    for end in (CONTEXT, length // 2, length):  # Whatever a chunk's end, the same frequencies.
        got = rope_frequencies(held, end)[0].double().numpy()
        assert np.allclose(got, expected, rtol=1e-6)
