"""The held-out figures of a trained run: the headline is train.py's validation (non-overlapping
windows), the sliding window scores the same tokens, each with its promised context."""

import json
import math

import pytest
import torch
from conftest import TRAIN_LEN

from data.loader import eval_batches, load_meta
from picollama.cli.command import run_command
from picollama.lab.interruptible import interruptible
from picollama.lab.measure.heldout import main
from picollama.lab.measure.quantize import mean_loss
from picollama.lab.scoring import sliding_losses, token_losses
from picollama.run_files import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_run(make_tiny_run):
    return make_tiny_run(20)


def test_the_headline_is_train_py_s_validation_and_the_window_scores_the_same_tokens(
    tiny_run, tmp_path, capsys
):
    run_dir, data_dir = tiny_run
    out = tmp_path / "heldout.json"
    assert (
        run_command(
            main, ["--run", str(run_dir), "--stride", "4", "--dtype", "float32", "--out", str(out)]
        )
        == 0
    )
    said = capsys.readouterr().out
    assert "figure (windows: the headline)" in said and "results written to" in said
    result = json.loads(out.read_text())
    windows, sliding = result["results"]["windows"], result["results"]["sliding"]
    # train.py's validation: every whole window of the split, its mean loss over bytes per token
    model, _ = load_model(run_dir)
    batches = list(eval_batches(data_dir, "val", 16, TRAIN_LEN))
    loss = mean_loss(model.eval(), batches)
    assert windows["stride"] == TRAIN_LEN and windows["loss"] == pytest.approx(loss, abs=1e-5)
    bpb = loss / math.log(2) / load_meta(data_dir)["bytes_per_token"]
    assert windows["bits_per_byte"] == pytest.approx(bpb, abs=1e-5)
    assert result["target_tokens"] == sum(y.numel() for _, y in batches)
    assert sliding["stride"] == 4  # its targets and their contexts: the next test


def test_each_sliding_target_is_scored_after_context_minus_stride_tokens(tiny_run):
    run_dir, _ = tiny_run
    model, _ = load_model(run_dir)
    tokens = torch.arange(120)[None] * 7 % 300
    context, stride = TRAIN_LEN + 1, 8
    with torch.inference_mode():
        losses = sliding_losses(model.eval(), tokens, context, stride)
        assert losses.shape == (1, 119)  # every target once
        for target in (1, 32, 33, 40, 41, 100, 119):
            # the window that scores it: the first, else the one whose last `stride` targets hold it
            start = max(0, -(-(target - context + 1) // stride) * stride)
            assert target - start >= min(target, context - stride)
            alone = token_losses(model, tokens[:, start : target + 1])[0, -1]
            assert losses[0, target - 1] == pytest.approx(alone.item(), abs=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "--run RUN_DIR is required"),
        (["--stride", "9"], "--stride 9 is over a quarter of the context (32)"),
    ],
)
def test_bad_input_is_one_error_line(tiny_run, tmp_path, capsys, args, message):
    run_dir, _ = tiny_run
    run = [] if not args else ["--run", str(run_dir)]
    out = tmp_path / "out.json"
    assert run_command(main, [*run, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not out.exists()


def test_the_forward_thread_computes_under_the_caller_s_autocast():
    # the sliding window's forwards run in interruptible's worker: bf16 as train.py validates
    a = torch.randn(4, 4)
    with torch.autocast("cpu", torch.bfloat16):
        assert interruptible(torch.mm, a, a).dtype == torch.bfloat16
    assert interruptible(torch.mm, a, a).dtype == torch.float32
