"""rlcore: the setup-and-weight-sync core for RL post-training of LLMs.

``import rlcore`` is light: it imports no torch, ray, vllm, megatron or
transformers. Heavy imports happen inside the backends when they start.

As a library (README, "rlcore as a library")::

    with rlcore.open("examples/quickstart.yaml", ["grpo.prompts_per_step=4"]) as s:
        groups = s.rollouts(1)
        ...

:func:`open`, :class:`Session` and :class:`RunInterrupted` live in :mod:`rlcore.app` and
are imported at their first use (PEP 562), so that ``import rlcore`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rlcore.hookspecs import hookimpl

if TYPE_CHECKING:
    from rlcore.app.interrupts import RunInterrupted
    from rlcore.app.session import Session, open

__version__ = "0.1.0"
__all__ = ["RunInterrupted", "Session", "__version__", "hookimpl", "open"]

#: The library's names and the modules they are imported from at first use.
_LAZY = {
    "open": "rlcore.app.session",
    "Session": "rlcore.app.session",
    "RunInterrupted": "rlcore.app.interrupts",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rlcore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
