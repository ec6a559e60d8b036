"""Reward functions named by ``env.options.reward``: found, checked and called.

A reward is ``module:function`` (imported from ``sys.path``) or ``path/to/file.py:function``
(loaded from the file). It follows TRL's convention: called with keyword arguments
``completions`` (the completion texts of one group), ``prompts`` (each completion's prompt,
as the data holds it) and every other column of the data, one list per column with one
entry per completion, it returns one float per completion. A function that does not take
``**kwargs`` gets only the arguments it names. ``async def`` functions are awaited.

The same loader runs in the preflight (to check the signature against the data's columns)
and in each reward process (to call it), so what was checked is what runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.errors import ConfigError

KEY = "env.options.reward"
#: Arguments every call passes, beside the data's columns.
CALL_ARGUMENTS = ("completions", "prompts")


@dataclass(frozen=True)
class RewardSpec:
    """One reward function: where it is, its weight."""

    spec: str
    weight: float = 1.0

    @property
    def name(self) -> str:
        """The function's name, for metrics and errors."""
        return self.spec.rsplit(":", 1)[-1]


def parse_specs(reward: Any, weights: Sequence[float] | None) -> list[RewardSpec]:
    """``env.options.reward`` (one spec or a list) with ``reward_weights``, checked for form."""
    specs = [reward] if isinstance(reward, str) else list(reward) if isinstance(reward, list | tuple) else None
    if not specs or not all(isinstance(s, str) for s in specs):
        raise ConfigError(
            f"{KEY} is {reward!r}; give the reward function as 'module:function' or "
            "'path/to/file.py:function' (or a list of them)",
            key=KEY,
        )
    for s in specs:
        where, _, fn = s.rpartition(":")
        if not where or not fn.isidentifier():
            raise ConfigError(
                f"{KEY} entry {s!r} is not 'module:function' or 'path/to/file.py:function'", key=KEY
            )
    if weights is None:
        return [RewardSpec(s) for s in specs]
    if len(weights) != len(specs):
        raise ConfigError(
            f"env.options.reward_weights has {len(weights)} weights for {len(specs)} reward functions; "
            "give one per function, in the order of env.options.reward",
            key="env.options.reward_weights",
        )
    return [RewardSpec(s, float(w)) for s, w in zip(specs, weights, strict=True)]


def load(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names; a :class:`ConfigError` naming the key and the fix when
    it cannot be imported or is not callable."""
    where, _, name = spec.rpartition(":")
    try:
        module = _load_file(Path(where)) if where.endswith(".py") else importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as err:  # the user's module: anything it raises on import is theirs to fix
        raise ConfigError(
            f"{KEY}: cannot import {where!r} for {spec!r} ({type(err).__name__}: {err}); give an "
            "importable module or an existing .py file",
            key=KEY,
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(
            f"{KEY}: {where!r} has no function {name!r}"
            + (f" ({type(fn).__name__}, not callable)" if fn is not None else "")
            + f"; functions there: {', '.join(_functions(module)) or '(none)'}",
            key=KEY,
        )
    return fn


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(
            f"{KEY}: reward file {str(path)!r} does not exist (relative to {Path.cwd()}); give the "
            "path of a .py file",
            key=KEY,
        )
    resolved = path.resolve()
    # A private module name per file: two reward files both named reward.py do not collide.
    name = f"rlcore_dataset_reward_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _functions(module: Any) -> list[str]:
    return sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))


def check_signature(spec: str, fn: Callable[..., Any], columns: Sequence[str]) -> None:
    """``fn`` can be called with ``completions``, ``prompts`` and ``columns`` as keywords: it
    takes no positional-only argument, and every argument it requires is one of those."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: nothing to read, the call will tell
    offered = (*CALL_ARGUMENTS, *columns)
    if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()) and "completions" not in sig.parameters:
        raise ConfigError(
            f"{KEY}: {spec} takes no 'completions' argument; a reward function is "
            "fn(completions, prompts=None, **columns) -> list[float]",
            key=KEY,
        )
    for p in sig.parameters.values():
        if p.kind is p.POSITIONAL_ONLY:
            raise ConfigError(
                f"{KEY}: {spec} takes {p.name!r} positional-only; reward functions are called with "
                f"keyword arguments ({', '.join(CALL_ARGUMENTS)} and the data's columns)",
                key=KEY,
            )
        required = p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        if required and p.name not in offered:
            raise ConfigError(
                f"{KEY}: {spec} requires {p.name!r}, which is neither {' nor '.join(CALL_ARGUMENTS)} "
                f"nor a column of env.options.data (columns: {', '.join(columns) or '(none)'}); add "
                "the column to the data or give the argument a default",
                key=KEY,
            )


def call(fn: Callable[..., Any], arguments: Mapping[str, Any]) -> Any:
    """``fn`` called with the ``arguments`` it takes (all of them with ``**kwargs``); a
    coroutine it returns is run to its end."""
    out = fn(**_accepted(fn, arguments))
    if inspect.isawaitable(out):
        out = asyncio.run(_awaited(out))
    return out


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _accepted(fn: Callable[..., Any], arguments: Mapping[str, Any]) -> dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return dict(arguments)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(arguments)
    return {k: v for k, v in arguments.items() if k in params}
