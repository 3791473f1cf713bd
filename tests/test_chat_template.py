"""Chat templates: rendered and encoded as transformers' apply_chat_template does (SmolLM2's own
template, where PICOLLAMA_SMOLLM2_GGUF gives its GGUF file), errors, the default template on a tiny
run, where a template comes from, and the tokens that stop a reply."""

import json
import os
from pathlib import Path

import pytest

from data.tokenizer import HFTokenizer, open_tokenizer
from picollama.chat_template import (
    DEFAULT_TEMPLATE,
    ChatTemplateError,
    encode_chat,
    load_chat_template,
    render_chat,
    run_chat_template,
    stop_ids,
    write_default_template,
)
from picollama.cli import UserError

SMOLLM2 = os.environ.get("PICOLLAMA_SMOLLM2_GGUF")
needs_smollm2 = pytest.mark.skipif(
    not SMOLLM2, reason="set PICOLLAMA_SMOLLM2_GGUF to SmolLM2-135M's GGUF file"
)
SYSTEM = {"role": "system", "content": "You answer in one line."}
CONVERSATION = [
    {"role": "user", "content": "Héllo, what is 2+2?"},
    {"role": "assistant", "content": "4.", "tool_calls": None},
    {"role": "user", "content": 'And <b>3+3</b> & "quoted"?'},
]
# what transformers' environment offers templates: tojson's options, loop controls, namespaces,
# {% generation %}, strftime_now, trim_blocks and lstrip_blocks, the special tokens, a dropped None
FEATURES = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {{ message | tojson }}|{{ message | tojson(indent=2, sort_keys=True) }}
    {{ message['content'] | tojson(ensure_ascii=True, separators=(',', ':')) }}
    {% generation %}{{ message.tool_calls is defined }}{% endgeneration %}
{% endfor %}
{{ strftime_now('%%') }}{{ ns.n }}{{ tools is none }}{{ documents is none }}
{{- add_generation_prompt }}{{ eos_token }}
"""


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer.json and tokenizer_config.json (its chat template kept) as `convert
    from-gguf` writes them into the run directory (write_tokenizer; the weights, which the import
    takes half a minute to dequantize, play no part here)."""
    from picollama.convert.from_gguf import model_args, open_gguf, write_tokenizer

    folder = tmp_path_factory.mktemp("smollm2")
    reader, meta = open_gguf(Path(SMOLLM2))
    write_tokenizer(meta, Path(SMOLLM2), folder, model_args(meta, reader).vocab_size)
    return folder


@needs_smollm2
@pytest.mark.parametrize("system", [True, False], ids=["system", "no-system"])
def test_smollm2_template_renders_and_encodes_as_transformers(smollm2_dir, system):
    from transformers import PreTrainedTokenizerFast

    theirs = PreTrainedTokenizerFast.from_pretrained(smollm2_dir)
    messages = ([SYSTEM] if system else []) + CONVERSATION
    template = load_chat_template(smollm2_dir)
    assert "<|im_start|>" in template
    ours = HFTokenizer(smollm2_dir / "tokenizer.json")
    text = render_chat(template, messages, ours)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ("You answer in one line." in text) == system != ("named SmolLM" in text)
    ids = encode_chat(ours, text)
    assert ids == theirs.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    im_end = theirs.convert_tokens_to_ids("<|im_end|>")
    assert stop_ids(ours, template) == {im_end}
    assert ids.count(im_end) == 4  # the system message, given or SmolLM2's, and three turns


@needs_smollm2
def test_chatml_stops_at_im_end_and_eos_and_never_doubles_bos(smollm2_dir):
    """With EOS another token than ChatML's <|im_end|>, both stop a reply; with BOS added by the
    tokenizer, a text that starts with BOS gets none more."""
    spec = (smollm2_dir / "tokenizer.json").read_text()
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    config |= {"eos_token": "<|endoftext|>", "add_bos_token": True}
    tokenizer = HFTokenizer(spec=spec, config=config)
    template = config["chat_template"]
    assert stop_ids(tokenizer, template) == {tokenizer.token_id("<|endoftext|>"), 2}
    ids = encode_chat(tokenizer, render_chat(template, CONVERSATION, tokenizer))
    assert ids[:2] == [tokenizer.bos_id(), tokenizer.token_id("system")]  # <|im_start|>system
    plain = encode_chat(tokenizer, "Hello")
    assert plain[0] == tokenizer.bos_id() and plain[1:] == tokenizer.encode("Hello")


def test_the_environment_is_transformers():
    """tojson (its options, non-ASCII and HTML characters as they are), loop controls, namespaces,
    {% generation %}, whitespace control, None dropped: as transformers' apply_chat_template has
    them (on a tokenizer of three words)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "?": 2}, unk_token="?"))
    theirs = PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<s>", eos_token="</s>")
    messages = [*CONVERSATION, SYSTEM]  # the system message after the break
    for prompt in (True, False):
        ours = render_chat(
            FEATURES, messages, bos_token="<s>", eos_token="</s>", add_generation_prompt=prompt
        )
        assert ours == theirs.apply_chat_template(
            messages, chat_template=FEATURES, tokenize=False, add_generation_prompt=prompt
        )
    assert '"Héllo, what is 2+2?"' in ours and '<b>3+3</b> & \\"quoted\\"' in ours
    assert '"H\\u00e9llo, what is 2+2?"' in ours and "one line" not in ours
    assert ours.endswith("False%3TrueTrueFalse</s>")  # no tool_calls: None is dropped


def test_a_refusing_or_broken_template_is_one_error_naming_the_cause():
    refuses = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    assert render_chat(refuses, CONVERSATION) == 'Héllo, what is 2+2?4.And <b>3+3</b> & "quoted"?'
    with pytest.raises(ChatTemplateError, match="refuses this conversation: Conversation roles"):
        render_chat(refuses, [SYSTEM, *CONVERSATION])
    assert issubclass(ChatTemplateError, ValueError) and issubclass(ChatTemplateError, UserError)
    with pytest.raises(ChatTemplateError, match="not valid Jinja: line 2"):
        render_chat("fine\n{% for %}", CONVERSATION)
    with pytest.raises(ChatTemplateError, match="TypeError: can only concatenate"):
        render_chat("{{ messages[0]['content'] + 1 }}", CONVERSATION)
    with pytest.raises(ChatTemplateError, match="SecurityError"):  # the sandbox, immutable
        render_chat("{{ messages.append(1) }}", CONVERSATION)
    for bad in ([], [{"content": "no role"}], "hi"):
        with pytest.raises(ChatTemplateError, match="message"):
            render_chat(DEFAULT_TEMPLATE, bad)
    with pytest.raises(ChatTemplateError, match="no role 'tool'"):
        render_chat(DEFAULT_TEMPLATE, [{"role": "tool", "content": "{}"}])


@pytest.fixture(scope="module")
def tiny_run(make_tiny_run) -> Path:
    return make_tiny_run(steps=1)[0]


def test_the_default_template_on_a_run_trained_here(tiny_run):
    tokenizer = open_tokenizer(tiny_run / "tokenizer.model")
    bos, eos = tokenizer.bos_id(), tokenizer.eos_id()
    assert run_chat_template(tiny_run) is None and load_chat_template(tiny_run) == DEFAULT_TEMPLATE
    text = render_chat(DEFAULT_TEMPLATE, [SYSTEM, *CONVERSATION], tokenizer)
    assert text == (
        "System: You answer in one line.\nUser: Héllo, what is 2+2?\nAssistant: 4.</s>"
        'User: And <b>3+3</b> & "quoted"?\nAssistant:'
    )
    ids = encode_chat(tokenizer, text)
    assert ids[0] == bos and ids.count(bos) == 1 and ids.count(eos) == 1
    assert tokenizer.decode(ids) == text.replace("</s>", "")  # its UTF-8, byte fallback and all
    assert stop_ids(tokenizer, DEFAULT_TEMPLATE) == {eos}
    with_bos = "{{ bos_token }}" + DEFAULT_TEMPLATE  # a template that writes BOS itself
    assert encode_chat(tokenizer, render_chat(with_bos, CONVERSATION, tokenizer)).count(bos) == 1


def test_default_template_written_once_atomically_and_the_override_wins(tiny_run, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("tokenizer.model", "config.json"):
        (run / name).write_bytes((tiny_run / name).read_bytes())
    assert write_default_template(run) and not write_default_template(run)
    assert run_chat_template(run) == DEFAULT_TEMPLATE and not list(run.glob(".*tmp*"))
    assert open_tokenizer(run / "tokenizer.model").add_bos  # the config changes no BOS
    config = run / "tokenizer_config.json"
    config.write_text(json.dumps({"add_bos_token": False, "chat_template": "{{ 'mine' }}"}))
    assert not write_default_template(run)
    assert render_chat(load_chat_template(run), CONVERSATION) == "mine"
    override = tmp_path / "chat.jinja"
    override.write_text("{{ 'the override' if messages }}")
    assert render_chat(load_chat_template(run, override), CONVERSATION) == "the override"
    with pytest.raises(ChatTemplateError, match=f"--chat-template {tmp_path}/absent"):
        load_chat_template(run, tmp_path / "absent")
    named = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    config.write_text(json.dumps({"chat_template": named}))
    assert load_chat_template(run) == "d"
    config.write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(ChatTemplateError, match="no template named 'default'.*tool_use"):
        load_chat_template(run)
    config.write_text("{not json")
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json: unreadable"):
        write_default_template(run)
    assert config.read_text() == "{not json"
