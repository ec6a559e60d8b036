"""The core's own hook implementations, registered after every plugin (``trylast``).

They are the defaults a plugin can override: atomic publish and refit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rlcore.errors import CancelToken, Deadline
from rlcore.hookspecs import hookimpl

#: Name under which the registry registers this module.
PLUGIN_NAME = "rlcore.setup.builtin"


@hookimpl(trylast=True)
def rlcore_publish(
    destination: Path, write: Callable[[Path], None], cancel: CancelToken, deadline: Deadline
) -> Path:
    from rlcore.publish import publish_dir

    return publish_dir(destination, write, cancel=cancel, deadline=deadline)


@hookimpl(trylast=True)
def rlcore_refit(policy: object, generation: object, ctx: object) -> object:
    from rlcore.refit.sync import refit

    return refit(policy, generation, ctx)  # type: ignore[arg-type]
