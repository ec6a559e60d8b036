"""A backend's options as people read them (``rlcore plugins NAME``): each field of its
declared options dataclass with its type, default, range and the ``#:`` comment above it.

The comments are read from the dataclass's source (``inspect`` and ``tokenize``), the
ranges from :func:`rlcore.config.bounded`; a nested options dataclass (``lora``) lists its
own fields under its name (``lora.rank``).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OptionDoc:
    """One option: dotted ``name``, ``type``, ``default``, ``range`` (words, or empty) and ``doc``."""

    name: str
    type: str
    default: str
    range: str
    doc: str


def option_docs(schema: type, prefix: str = "") -> list[OptionDoc]:
    """Every field of the options dataclass ``schema``, nested dataclasses expanded."""
    comments = _field_comments(schema)
    hints = typing.get_type_hints(schema)
    out = []
    for f in dataclasses.fields(schema):
        hint = hints.get(f.name, f.type)
        bounds = f.metadata.get("bounds")
        out.append(OptionDoc(
            name=prefix + f.name,
            type=_type_name(hint),
            default=_default(f),
            range=bounds.describe() if bounds is not None else "",
            doc=comments.get(f.name, ""),
        ))
        nested = next((t for t in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(t)), None)
        if isinstance(nested, type):
            out += option_docs(nested, f"{prefix}{f.name}.")
    return out


def _field_comments(schema: type) -> dict[str, str]:
    """``field name -> its #: comment`` from the class's source (empty where unreadable)."""
    try:
        source = textwrap.dedent(inspect.getsource(schema))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    pending: list[str] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.string.startswith("#:"):
            pending.append(tok.string[2:].strip())
        elif tok.type == tokenize.NAME and pending and tok.start[1] == _indent(source, tok.start[0]):
            docs.setdefault(tok.string, " ".join(pending))
            pending = []
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT):
            pending = [] if tok.type != tokenize.NAME else pending
    return docs


def _indent(source: str, line: int) -> int:
    text = source.splitlines()[line - 1]
    return len(text) - len(text.lstrip())


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "").replace("NoneType", "None")


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return "null" if f.default is None else repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return repr(value) if not dataclasses.is_dataclass(value) else "{...}"
    return "(required)"
