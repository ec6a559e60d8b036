"""rlcore.chat_template: a checkpoint's chat template renders as transformers renders it.

Each checkpoint here is the tiny model's tokenizer files with a template of its own, the
way transformers saves one (``chat_template.jinja``, named ``additional_chat_templates``,
or ``tokenizer_config.json``'s ``chat_template``). rlcore's tokenizer of the files and
transformers' ``AutoTokenizer`` of the same files must give the same text and ids for
every conversation and option hypothesis draws, or both refuse it with the same kind of
error.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcore import tinymodel, tokenizer
from rlcore.chat_template import ChatTemplate, read_templates
from rlcore.config import ModelConfig

# ChatML, with tools as JSON (tojson must not escape HTML) and a system turn made of them.
CHATML = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools: ' }}{{ tools | tojson }}{{ '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama-like: bos_token, alternation enforced with raise_exception, the generation block,
# loop controls, tojson's options, documents, a caller's variable and a trimmed content.
LLAMA = (
    "{{ bos_token }}\n"
    "{% if documents %}{% for d in documents %}[doc {{ loop.index }}] {{ d | tojson(indent=1, sort_keys=true) }}\n{% endfor %}{% endif %}\n"
    "{% for message in messages %}\n"
    "  {% if message['role'] == 'system' %}{% if not loop.first %}{{ raise_exception('system must come first') }}{% endif %}"
    "<<SYS>>{{ message['content'] | trim }}<</SYS>>\n"
    "  {% elif message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{{ eos_token }}{% endgeneration %}\n"
    "  {% else %}[INST] {{ message['content'] | trim }} [/INST]\n"
    "  {% endif %}\n"
    "  {% if loop.index > 6 %}{% break %}{% endif %}\n"
    "{% endfor %}\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}"
    "{% if documents %}(today: {{ strftime_now('%Y') }}){% endif %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
TOOL_USE = "{{ 'tools: ' }}{{ tools | tojson(separators=(',', ':')) }}\n" + CHATML

ROLE = st.sampled_from(["system", "user", "assistant"])
TEXT = st.text(alphabet=st.sampled_from(list("ab 1+2=<&>\"'\nüé")), max_size=12)
# Content as text, mostly, or as a list of text blocks (templates that add strings to it refuse).
CONTENT = TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), min_size=1, max_size=2)
MESSAGE = st.builds(lambda r, c: {"role": r, "content": c}, ROLE, CONTENT)
TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": TEXT, "description": TEXT})}
)
TOOLS = st.none() | st.lists(TOOL | st.just("not a schema"), max_size=2)
DOCS = st.none() | st.lists(st.fixed_dictionaries({"title": TEXT, "text": TEXT}) | st.just("not a dict"), max_size=2)
# The template to use: the checkpoint's, one named by the call, or one given as text.
PICK = st.sampled_from([None, None, "tool_use", "{{ messages | length }}{{ bos_token }}"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tinymodel.ensure_model(ModelConfig(), tmp_path_factory.mktemp("cache"))


def _checkpoint(model_dir: Path, dest: Path, *, config_template: Any = None, files: dict[str, str] | None = None) -> Path:
    """The tiny model's tokenizer with the given template(s): ``config_template`` into
    ``tokenizer_config.json``, ``files`` (relative path -> text) written beside it."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, dest / name)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if config_template is not None:
        config["chat_template"] = config_template
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    for rel, text in (files or {}).items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(text)
    return dest


CHECKPOINTS = {
    "tiny model": None,  # as tinymodel writes it (chat_template.jinja)
    "chatml in the config": {"config_template": CHATML},
    "llama as jinja file": {"files": {"chat_template.jinja": LLAMA}},
    "named, in the config": {
        "config_template": [{"name": "default", "template": LLAMA}, {"name": "tool_use", "template": TOOL_USE}]
    },
    "named files": {
        "files": {"chat_template.jinja": CHATML, "additional_chat_templates/tool_use.jinja": TOOL_USE}
    },
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def pair(request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """(rlcore's, transformers') tokenizers of one checkpoint."""
    from transformers import AutoTokenizer

    spec = CHECKPOINTS[request.param]
    path = model_dir if spec is None else _checkpoint(model_dir, tmp_path_factory.mktemp("ckpt"), **spec)
    fast = tokenizer.load(path)
    assert isinstance(fast, tokenizer.FastTokenizer)
    return fast, AutoTokenizer.from_pretrained(str(path))


def _outcome(call: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """What ``call(*args, **kwargs)`` gives: its value, or the kind of error it raises."""
    import jinja2

    try:
        return "value", call(*args, **kwargs)
    except jinja2.exceptions.TemplateError:
        return "raises", "TemplateError"
    except (ValueError, TypeError) as err:
        return "raises", type(err).__name__


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    messages=st.lists(MESSAGE, max_size=5),
    generation_prompt=st.booleans(),
    continue_final=st.sampled_from([False, True, "content"]),
    tools=TOOLS,
    documents=DOCS,
    variables=st.sampled_from([{}, {"enable_thinking": True}, {"bos_token": "[B]"}, {"padding": False}]),
    pick=PICK,
)
def test_text_matches_transformers(pair, messages, generation_prompt, continue_final, tools, documents, variables, pick) -> None:
    fast, ref = pair
    kwargs = dict(
        add_generation_prompt=generation_prompt,
        continue_final_message=continue_final,
        tools=tools,
        documents=documents,
        chat_template=pick,
        tokenize=False,
        **variables,
    )
    got = _outcome(fast.apply_chat_template, messages, **kwargs)
    want = _outcome(ref.apply_chat_template, messages, **kwargs)
    assert got == want


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversations=st.lists(st.lists(MESSAGE, min_size=1, max_size=3), min_size=1, max_size=3), generation_prompt=st.booleans())
def test_ids_match_transformers(pair, conversations, generation_prompt) -> None:
    fast, ref = pair
    for conversation in (conversations[0], conversations):  # one, and a batch
        for as_dict in (False, True):
            options = dict(add_generation_prompt=generation_prompt, return_dict=as_dict)
            got = _outcome(fast.apply_chat_template, conversation, **options)
            want = _outcome(ref.apply_chat_template, conversation, **options)
            if as_dict and got[0] == want[0] == "value":
                assert sorted(got[1]) == sorted(want[1])  # the same keys
                got = ("value", (got[1]["input_ids"], got[1]["attention_mask"]))
                want = ("value", (list(want[1]["input_ids"]), list(want[1]["attention_mask"])))
            assert got == want


def test_named_templates_pick_as_transformers_does(model_dir: Path, tmp_path: Path) -> None:
    """``tool_use`` for calls with tools, ``default`` otherwise, a name picks its template,
    and without a default a call that names none is refused."""
    path = _checkpoint(model_dir, tmp_path / "a", files={"chat_template.jinja": CHATML, "additional_chat_templates/tool_use.jinja": TOOL_USE})
    templates = read_templates(path)
    assert templates == {"default": CHATML, "tool_use": TOOL_USE}
    chat = ChatTemplate(templates, {})
    assert chat.source() == CHATML and chat.source(tools=[]) == TOOL_USE
    assert chat.source("tool_use") == TOOL_USE and chat.source("{{ 1 }}") == "{{ 1 }}"
    no_default = ChatTemplate({"a": CHATML, "b": TOOL_USE}, {})
    with pytest.raises(ValueError, match="none is named 'default'"):
        no_default.source()
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate(None, {}).render([{"role": "user", "content": "x"}])


def test_a_template_that_would_escape_html_does_not(model_dir: Path, tmp_path: Path) -> None:
    """jinja2's own tojson writes ``<`` as ``\\u003c``; chat templates get plain JSON."""
    text = ChatTemplate("{{ messages | tojson }}", {}).render([{"role": "user", "content": "<a&b>"}])
    assert text == '[{"role": "user", "content": "<a&b>"}]'


def test_the_sandbox_refuses_what_transformers_refuses() -> None:
    """The environment is sandboxed and immutable: a template cannot reach Python's
    internals or change the messages it is given."""
    import jinja2

    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{{ messages.__class__.__mro__ }}", {}).render(messages)
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{{ messages.append(1) }}", {}).render(messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_a_legacy_special_tokens_map_sends_the_tokenizer_to_transformers(model_dir: Path, tmp_path: Path) -> None:
    """Without ``added_tokens_decoder``, transformers takes special tokens from
    ``special_tokens_map.json`` (and hands them to templates): rlcore does not guess."""
    path = _checkpoint(model_dir, tmp_path / "legacy")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer.fast_path_refusal(path) is None
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert "special_tokens_map.json" in (tokenizer.fast_path_refusal(path) or "")


def test_chat_prompts_import_neither_transformers_nor_torch(model_dir: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from rlcore import tokenizer; "
        f"t = tokenizer.load(Path({str(model_dir)!r})); "
        "t.apply_chat_template([{'role': 'user', 'content': 'Hi'}], add_generation_prompt=True); "
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_what_only_transformers_serves_goes_to_it(model_dir: Path, tmp_path: Path) -> None:
    """Assistant masks (the template's generation block mapped to tokens) are
    transformers' work: such a call gets transformers' answer, masks included."""
    from transformers import AutoTokenizer

    path = _checkpoint(model_dir, tmp_path / "llama", files={"chat_template.jinja": LLAMA})
    fast, ref = tokenizer.load(path), AutoTokenizer.from_pretrained(str(path))
    chat = [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]
    got = fast.apply_chat_template(chat, return_assistant_tokens_mask=True)
    want = ref.apply_chat_template(chat, return_assistant_tokens_mask=True)
    assert got["assistant_masks"] == want["assistant_masks"] and 1 in got["assistant_masks"]
    assert fast._full is not None  # it was transformers' tokenizer that answered


def test_a_template_set_after_loading_is_the_one_rendered(model_dir: Path) -> None:
    """As in transformers, ``chat_template`` and the special tokens are attributes a caller
    may set; later calls render with them."""
    fast = tokenizer.load(model_dir)
    chat = [{"role": "user", "content": "x"}]
    fast.chat_template = "{{ eos_token }}{{ messages[0]['content'] }}"
    assert fast.apply_chat_template(chat, tokenize=False) == "</s>x"
    fast.eos_token = "<pad>"
    assert fast.apply_chat_template(chat, tokenize=False) == "<pad>x"


def test_what_transformers_refuses_does_not_load_it(model_dir: Path) -> None:
    """A tool that is not a schema nor a function, or an empty conversation, is refused by
    rlcore itself: a bad request to an endpoint must not import transformers."""
    fast = tokenizer.load(model_dir)
    with pytest.raises(ValueError, match="JSON schemas"):
        fast.apply_chat_template([{"role": "user", "content": "x"}], tools=["x"], tokenize=False)
    with pytest.raises(ValueError, match="empty conversation"):
        fast.apply_chat_template([], tokenize=False)
    assert fast._full is None
