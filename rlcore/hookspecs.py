"""The plugin contract of rlcore: every hook a plugin may implement.

This module is the reference for backend authors. A plugin is a module (or
object) with functions named after these hooks and marked with
:data:`hookimpl`; it is registered under the entry-point group
``rlcore.backends`` in its distribution's ``pyproject.toml``::

    [project.entry-points."rlcore.backends"]
    mybackend = "rlcore_mybackend.plugin"

Rules every plugin follows:

* **One backend per plugin.** A plugin that returns a declaration from
  :func:`rlcore_declare_backend` is a *backend*; the core calls its init hooks
  only for the roles the run's config selects it for, and calls no other
  backend's init hook for that role. A plugin that declares nothing is a
  *wrapper* plugin: it may wrap any hook (``@hookimpl(wrapper=True)``) for
  timing, tracing or fault injection, and sees every call.
* **Cheap, idempotent import.** The plugin module is imported by ``rlcore
  plugins`` and again in Ray worker processes. Import torch, ray and the
  backend's engine inside the hook functions, never at module level.
* **Declare only the arguments you use.** pluggy passes arguments by name;
  an implementation may take any subset of the spec's arguments. An argument
  the spec does not have makes registration fail, and the plugin is skipped
  with an error naming it.
* **Honour cancellation and deadlines.** Every wait inside an init uses the
  context's ``cancel`` and ``deadline`` (``ctx.wait_event``,
  ``ctx.wait_artifact`` do). A backend that blocks forever holds up the
  failure path of the whole run.
* **Clean up after yourself.** If an init hook raises, it has already released
  what it started. A returned handle's ``shutdown()`` releases everything.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from rlcore.context import InitContext
    from rlcore.declarations import BackendDeclaration
    from rlcore.errors import CancelToken, Deadline
    from rlcore.handles import BackendHandle

PROJECT = "rlcore"

#: Marks a hook specification (used by rlcore itself).
hookspec = pluggy.HookspecMarker(PROJECT)
#: Marks a hook implementation in a plugin: ``@hookimpl`` or ``@hookimpl(wrapper=True)``.
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def rlcore_declare_backend() -> BackendDeclaration | None:
    """Declare the backend this plugin provides.

    Called once per plugin at registration, in every process that loads plugins.
    Must be cheap and pure: build and return a
    :class:`rlcore.declarations.BackendDeclaration` without importing the
    backend's heavy dependencies. Wrapper-only plugins do not implement it (or
    return ``None``).

    The declaration is validated at registration; an invalid or contradictory
    one, or a backend name another plugin already declared, makes the core
    report the plugin (with its distribution) and skip it.
    """


@hookspec(firstresult=True)
def rlcore_init_policy(ctx: InitContext) -> BackendHandle:
    """Start the policy (the model being trained) and return its handle.

    Called once per run, in the driver process, for the backend selected by
    ``policy.backend``, inside the setup task ``init:policy``. It may run at the
    same time as the other inits when the declarations allow it.

    Args:
        ctx: role, backend options, run config, cancellation token, deadline,
            event board and artifact helpers (see :class:`rlcore.context.InitContext`).
            Artifacts the declaration says it ``produces`` are published with
            ``ctx.publish`` (an init may skip one when ``ctx.artifact_needed(name)``
            is false: no reader of this run needs it); artifacts it ``needs`` are
            awaited with ``ctx.wait_artifact``.

    Returns:
        A policy handle (see :mod:`rlcore.handles`): at least ``shutdown()``; for
        refit, the sending side of the transports it declares.
    """


@hookspec(firstresult=True)
def rlcore_init_generation(ctx: InitContext) -> BackendHandle:
    """Start the generation engine and return its handle.

    Called once per run, in the driver process, for the backend selected by
    ``generation.backend``, inside the setup task ``init:generation``.

    When the config sets ``generation.refit_fed: true`` (allowed only if the
    declaration says ``refit_fed=True``), build the engine *without* reading
    checkpoint weights: the core runs ``refit:initial`` as soon as policy and
    generation are both up, and only then treats the engine as serving. Otherwise
    load the weights from ``config.model.path`` or an artifact the declaration
    ``needs`` (wait for it with ``ctx.wait_artifact``).

    Called again, in the same driver process, when the run has
    ``generation.on_worker_loss: replace`` and a call on the handle raised
    :class:`rlcore.errors.WorkerLost` (one of its workers' processes is gone): the core
    drops the old handle's refit channels, calls its ``shutdown()`` (which must return
    with workers already dead), then calls this hook with the context ``init:generation``
    had and refits the new handle before it serves. So an init must not depend on state
    a previous init of the run left behind, and a handle whose worker is lost raises
    ``WorkerLost`` (handles over :class:`rlcore.runtime.worker_group.WorkerGroup` do).

    Returns:
        A generation handle: at least ``shutdown()``; ``endpoint`` (an
        :class:`rlcore.handles.Endpoint`) if it serves an OpenAI-compatible
        endpoint; and the receiving side of the transports it declares.
    """


@hookspec(firstresult=True)
def rlcore_init_env(ctx: InitContext) -> BackendHandle:
    """Start the environment(s) that score samples and return their handle.

    Called once per run, in the driver process, for the backend selected by
    ``env.backend``, inside the setup task ``init:env``. An environment that
    talks to the model through an OpenAI-compatible endpoint declares
    ``Need("generation.endpoint", kind="event")`` and calls
    ``ctx.wait_event("generation.endpoint")`` inside this hook: its init starts
    at once and waits there, so it never blocks the refit that makes the
    endpoint serve.
    """


@hookspec(firstresult=True)
def rlcore_refit(policy: BackendHandle, generation: BackendHandle, ctx: Any) -> Any:
    """Copy the policy's current weights into the running generation engine.

    Called by the core for ``refit:initial`` and after every training step.
    First non-``None`` result wins. The core's own implementation (registered
    last) streams Hugging Face-named tensors in bounded buckets over the best
    transport both sides declare; a backend pair with a faster private path may
    implement this hook and return ``None`` when the pair is not its own.

    Args:
        policy: the handle ``rlcore_init_policy`` returned.
        generation: the handle ``rlcore_init_generation`` returned.
        ctx: a :class:`rlcore.context.RefitContext`: chosen transport, bucket size,
            timeout, cancellation token, step number.

    Returns:
        A :class:`rlcore.refit.RefitReport` (bytes moved, ``weight_sync_time_s``,
        transport). Must check names, shapes and dtypes before writing any byte
        and raise :class:`rlcore.errors.RefitError` on a mismatch, leaving the
        engine's old weights intact.
    """


@hookspec(firstresult=True)
def rlcore_publish(
    destination: Path,
    write: Callable[[Path], None],
    cancel: CancelToken,
    deadline: Deadline,
) -> Path:
    """Publish a directory atomically at ``destination``.

    ``write(staging)`` fills a private staging directory. The implementation
    makes the result visible in one step, so that a reader never sees a
    half-written directory as complete, a crash at any point leaves nothing that
    counts as complete, and concurrent publishers of one destination end with
    exactly one winner. If ``destination`` is already published, ``write`` is
    not called. Returns ``destination``.

    The core's implementation (:func:`rlcore.publish.publish_dir`, registered
    last) stages beside the destination, flushes, writes a completion marker
    inside the staging directory and renames it into place. Readers wait with
    :func:`rlcore.publish.wait_for_artifact`. A plugin may override it (e.g. to
    publish to an object store) by returning a path; first non-``None`` wins.
    """
