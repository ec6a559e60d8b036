"""The context an init hook receives: config, cancellation, deadline, events, artifacts."""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.config.placement import DeviceGroup, Network, RolePlacement, role_placement
from rlcore.declarations import Role
from rlcore.errors import CancelToken, Deadline

if TYPE_CHECKING:
    from rlcore.config import RunConfig
    from rlcore.lora import LoraOptions
    from rlcore.setup.events import EventBoard

_KEY_RE = re.compile(r"[^A-Za-z0-9_.\-]+")


def artifact_key(*parts: object) -> str:
    """A filesystem-safe cache key from parts (model path, options...); injective.

    Parts are joined by ``-`` and characters outside ``[A-Za-z0-9_.-]`` become ``_``;
    that readable text is the key only when it tells the parts back exactly. When a
    part holds such a character or a ``-`` (``("a-b",)`` and ``("a", "b")`` would
    meet) or is empty, when the text would start or end with ``_``, start with ``.``
    or pass 100 characters, or when there are no parts, 16 hex digits of a SHA-256
    of the exact parts follow the (shortened) readable text after a ``~``, which no
    plain key holds. Different parts (as ``str``) therefore never share a key:
    ``("+-",)`` and ``("*-",)`` get different ones.
    """
    texts = [str(p) for p in parts]
    joined = "-".join(texts)
    readable = _KEY_RE.sub("_", joined).strip("_")
    exact = (
        bool(texts)
        and readable == joined
        and not joined.startswith(".")
        and len(joined) <= 100
        and all(t and "-" not in t for t in texts)
    )
    if exact:
        return readable
    digest = hashlib.sha256(repr(tuple(texts)).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{readable[:80].lstrip('.') or 'default'}~{digest}"


@dataclass
class InitContext:
    """Passed to ``rlcore_init_policy``, ``rlcore_init_generation`` and ``rlcore_init_env``.

    Attributes:
        role: the role being started.
        backend: the backend's declared name.
        config: the whole run config.
        options: ``<role>.options`` checked against the backend's options dataclass
            (an instance of it), or a dict when the backend declares none.
        cancel: set when another task fails; long work should check it and stop.
        deadline: this task's deadline; every wait must respect it.
        run_dir: the run's output directory.
        cache_dir: the shared artifact cache (atomic publish writes here).
        events: the setup's event board (see :meth:`wait_event`).
        publish_hook: calls the ``rlcore_publish`` hook (set by the core).
        needed_artifacts: the artifacts this init produces that another selected
            backend needs under this config (from the plan); None when the context
            was not made from a plan (then :meth:`artifact_needed` says yes to all).
        network: who reaches this run's servers (:class:`rlcore.config.placement.Network`):
            with ``network.readers_elsewhere`` a server binds its node's address
            (:func:`rlcore.runtime.addresses.server_host`) and checks ``network.token``
            (:class:`rlcore.serve.auth.BearerGuard`); otherwise loopback, no token.
            Set by the core from the placement; the default is a single node.
        devices: the run's GPU bundles (:class:`rlcore.config.placement.DeviceGroup`), reserved
            by the core on a cluster with GPUs; ``None`` elsewhere. Read through
            :attr:`placement`, which puts each rank in its bundle.
        adapters: (generation, contract 2.6) the LoRA adapters every refit will carry in
            place of weights (refit content ``adapters``: the policy trains them and this
            backend declares ``takes_adapters``): start the engines from the base weights of
            the checkpoint (even where ``generation.refit_fed`` is set: adapters apply on
            top of the base) and able to serve adapters of this rank and these targets.
            ``None``: refits carry weights.
    """

    role: Role
    backend: str
    config: RunConfig
    options: Any
    cancel: CancelToken
    deadline: Deadline
    run_dir: Path
    cache_dir: Path
    events: EventBoard
    publish_hook: Callable[..., Path] | None = None
    needed_artifacts: frozenset[str] | None = None
    network: Network = field(default_factory=Network)
    devices: DeviceGroup | None = None
    adapters: LoraOptions | None = None
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("rlcore.backend"))

    @property
    def task(self) -> str:
        return f"init:{self.role.value}"

    @property
    def placement(self) -> RolePlacement:
        """The nodes this role's actors may run on (``placement.nodes.<role>``) and, on a
        cluster with GPUs, the GPU bundle of each rank: pass it to
        :class:`rlcore.runtime.worker_group.WorkerGroup` (``placement=ctx.placement``)."""
        return role_placement(self.config, self.role.value, self.devices)

    def artifact_needed(self, name: str) -> bool:
        """Whether another backend of this run needs artifact ``name`` from this init.

        A declared artifact that nobody needs under this config (the only reader's
        need is conditional and does not hold, say) may be skipped: the plan draws no
        wait for it. Without a plan (``needed_artifacts`` None) the answer is yes,
        because skipping a needed artifact leaves its reader waiting until its deadline.
        """
        return self.needed_artifacts is None or name in self.needed_artifacts

    def wait_event(self, name: str) -> Any:
        """Wait for a core event (e.g. ``generation.endpoint``) and return its value.

        Raises Cancelled or DeadlineExceeded instead of blocking forever.
        """
        return self.events.wait(name, self.deadline, waiter=f"{self.task} ({self.backend})")

    def artifact_path(self, name: str, key: str) -> Path:
        """Where artifact ``name`` under ``key`` lives in the cache (published or not)."""
        return self.cache_dir / name / key

    def publish(self, name: str, key: str, write: Callable[[Path], None]) -> Path:
        """Publish artifact ``name``/``key`` atomically through the ``rlcore_publish`` hook.

        ``write(staging_dir)`` fills a private staging directory; the hook makes it
        visible in one step. If the artifact is already published, ``write`` is not
        called. Returns the published directory.
        """
        if self.publish_hook is None:
            raise RuntimeError("InitContext.publish_hook is not set: the core sets it before init")
        return self.publish_hook(
            destination=self.artifact_path(name, key),
            write=write,
            cancel=self.cancel,
            deadline=self.deadline,
        )

    def wait_artifact(self, name: str, key: str) -> Path:
        """Wait until artifact ``name``/``key`` is published (its completion marker exists)."""
        from rlcore.publish import wait_for_artifact

        return wait_for_artifact(
            self.artifact_path(name, key), cancel=self.cancel, deadline=self.deadline
        )


@dataclass
class RefitContext:
    """Passed to ``rlcore_refit``: how this weight sync should run.

    Attributes:
        step: 0 for ``refit:initial``, then the training step that produced the weights.
        transport: the transport the core chose from both declarations and the
            placement (``collective``, ``shared_memory``, ``disk``...).
        bucket_bytes: upper bound on one streamed bucket.
        timeout_s: timeout of every collective and of the whole refit.
        cancel: set when the run is cancelled.
        deadline: deadline of the whole refit.
        config: the run config.
        cache_dir: where the disk transport publishes.
        content: what the refit carries (the plan's ``refit content``): ``weights``,
            ``merged`` (base + adapters' product, as weights) or ``adapters`` (the policy's
            LoRA adapters alone, to a generation that declares ``takes_adapters``; the
            core's refit then calls :class:`rlcore.handles.AdapterSource` and
            :class:`rlcore.handles.AdapterReceiver` instead of streaming weights).
        sessions: the run's open refit channels (a
            :class:`rlcore.refit.sessions.RefitSessions`, not named here: the refit
            imports this module): a channel is opened at the first refit of a pair and
            reused after. The run owns it; a backend's own ``rlcore_refit`` may keep its
            state there too.
    """

    step: int
    transport: str
    bucket_bytes: int
    timeout_s: float
    cancel: CancelToken
    deadline: Deadline
    config: RunConfig
    cache_dir: Path
    sessions: Any
    content: str = "weights"
