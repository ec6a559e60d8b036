"""A checkpoint's chat template, rendered by jinja2 alone as transformers renders it.

An OpenAI-compatible endpoint turns ``messages`` into a prompt with the model's chat
template. transformers' ``apply_chat_template`` is a jinja2 template rendered in a
sandbox; importing transformers for it costs ~3.8 CPU-seconds (it imports torch) in a
driver whose setup shares the cores with the workers it starts. :class:`ChatTemplate`
reads the same files and renders with the same jinja2 settings:

* where the templates live (transformers' order): ``chat_template.jinja`` and the named
  templates in ``additional_chat_templates/*.jinja``, else ``tokenizer_config.json``'s
  ``chat_template`` (one template, or a list of ``{"name", "template"}``);
* which one renders: the one passed (a name, or a template's text), else the only
  template, else ``tool_use`` when tools are given and it exists, else ``default``;
* the environment: a sandbox whose objects cannot be changed, ``trim_blocks`` and
  ``lstrip_blocks``, ``loopcontrols``, a ``{% generation %}`` block that renders its
  body, a ``tojson`` filter that does not escape HTML (``json.dumps`` with its options),
  ``raise_exception(message)`` and ``strftime_now(format)``;
* the variables: ``messages``, ``tools``, ``documents``, ``add_generation_prompt``,
  the named special tokens (``bos_token``...), then the caller's keywords over them;
* ``continue_final_message``: the rendering ends where the final message's text ends, so
  the model continues it (a marker is appended to that text and the rendering cut at it).

``tests/test_chat_template.py`` holds it to transformers' output, errors included.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

#: The file transformers writes a checkpoint's (default) template to, and the folder of
#: its named templates.
TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES_DIR = "additional_chat_templates"
#: Appended to the final message's text under ``continue_final_message``; the rendering
#: is cut where it appears, so whatever the template adds after a message is dropped.
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "

Templates = str | dict[str, str]

#: ``apply_chat_template`` options only transformers serves (tokenizing with padding,
#: truncation, tensors, assistant masks).
TRANSFORMERS_ONLY_OPTIONS = frozenset(
    {"padding", "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)
#: Every ``apply_chat_template`` option: none of them is a template variable.
APPLY_OPTIONS = TRANSFORMERS_ONLY_OPTIONS | {
    "tokenize",
    "return_dict",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
}


def read_templates(path: Path, config: Mapping[str, Any] | None = None) -> Templates | None:
    """The chat template(s) of the checkpoint at ``path``: one template, a dict of named
    ones, or None. ``config``: ``tokenizer_config.json`` already parsed."""
    path = Path(path)
    named: dict[str, str] = {}
    if (path / TEMPLATE_FILE).is_file():
        named["default"] = (path / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (path / NAMED_TEMPLATES_DIR).is_dir():
        for file in sorted((path / NAMED_TEMPLATES_DIR).glob("*.jinja")):
            named[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if named:
        return named["default"] if list(named) == ["default"] else named
    if config is None:
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    found = config.get("chat_template")
    if isinstance(found, list):
        return {t["name"]: t["template"] for t in found}
    return found if isinstance(found, str) else None


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML: templates want the JSON as is.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks what the assistant wrote (for
        training masks); rendering a prompt keeps the body as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(
                self.call_method("_body"), [], [], body
            ).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> Any:
    return _environment().from_string(source)


class ChatTemplate:
    """A checkpoint's chat template(s) and named special tokens (module doc).

    Args:
        templates: one template, or named ones (``default``, ``tool_use``...); None when
            the checkpoint has none (rendering then raises, as transformers does).
        special_tokens: ``{"bos_token": "<s>", ...}``, the template's variables.
    """

    def __init__(self, templates: Templates | None, special_tokens: Mapping[str, str]) -> None:
        self.templates = templates
        self.special_tokens = dict(special_tokens)

    def source(self, chat_template: str | None = None, tools: Sequence[Any] | None = None) -> str:
        """The template that renders: ``chat_template`` (a name or a template), else the
        checkpoint's (``tool_use`` for calls with tools where it has one, else ``default``)."""
        if isinstance(self.templates, dict):
            if chat_template is not None and chat_template in self.templates:
                return self.templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in self.templates:
                    return self.templates["tool_use"]
                if "default" in self.templates:
                    return self.templates["default"]
                raise ValueError(
                    "the checkpoint has several chat templates and none is named 'default' "
                    f"({sorted(self.templates)}): pass chat_template= with one of the names"
                )
        if chat_template is not None:
            return chat_template
        if self.templates is None:
            raise ValueError(
                "the tokenizer has no chat template (no chat_template.jinja, no chat_template "
                "in tokenizer_config.json) and none was passed"
            )
        return self.templates

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        **variables: Any,
    ) -> str:
        """The prompt text of one conversation. ``continue_final_message``: True (or the
        name of the message field to continue, ``content`` by default) ends the text
        inside the final message. ``variables`` reach the template (``enable_thinking``...)
        and override the special tokens. Raises ValueError for what transformers refuses
        and jinja2's ``TemplateError`` for what the template refuses."""
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt exclude each other: the "
                "first continues the last message, the second opens a new assistant turn"
            )
        tools = None if tools is None else list(tools)  # a generator is read once
        source = self.source(chat_template, tools)
        for tool in tools or ():
            if not isinstance(tool, Mapping):
                raise ValueError(f"tools must be JSON schemas (dicts); got {type(tool).__name__}")
        for document in documents or ():
            if not isinstance(document, Mapping):
                raise TypeError("documents must be dicts with 'title' and 'text' keys")
        field = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            messages, final = _marked(messages, field, source)
        text = _compiled(source).render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **variables},
        )
        if field is None:
            return str(text)
        return _cut_at_mark(str(text), final)


def _marked(
    messages: Sequence[Mapping[str, Any]], field: str, source: str
) -> tuple[list[dict[str, Any]], str]:
    """A copy of ``messages`` whose final ``field`` text ends in the mark, and that text."""
    import copy

    if not messages:
        raise ValueError("continue_final_message: the conversation has no message to continue")
    marked = copy.deepcopy([dict(m) for m in messages])
    final = marked[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message: the final message has no '{field}' to continue")
    if field not in source:
        raise ValueError(
            f"continue_final_message names field '{field}', which the chat template never uses"
        )
    if isinstance(final, list | tuple):
        for block in reversed(final):
            if "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_MARK
                return marked, text
        raise ValueError("continue_final_message: the final message has no text block to continue")
    marked[-1][field] = final + _CONTINUE_MARK
    return marked, final


def _cut_at_mark(text: str, final: str) -> str:
    mark = _CONTINUE_MARK.strip()
    if final.strip() not in text or mark not in text:
        raise ValueError(
            "continue_final_message: the final message is not in the rendered chat (the "
            f"template changes or drops it); final message: {final.strip()!r}"
        )
    at = text.rindex(mark)
    if text[at : at + len(_CONTINUE_MARK)] == _CONTINUE_MARK:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


__all__ = [
    "APPLY_OPTIONS",
    "NAMED_TEMPLATES_DIR",
    "TEMPLATE_FILE",
    "TRANSFORMERS_ONLY_OPTIONS",
    "ChatTemplate",
    "read_templates",
]
