"""Where each role runs on a Ray cluster of several nodes, and who must reach its servers.

Two things a backend reads from its :class:`~rlcore.context.InitContext`:

* ``ctx.placement`` (:class:`RolePlacement`): the nodes the role's actors may run on,
  from ``placement.nodes.<role>`` in Ray's own terms (custom resources each actor asks
  for, node labels it selects). :class:`rlcore.runtime.workers.WorkerGroup` takes it
  (``placement=ctx.placement``) and adds it to every actor's options; a backend that
  starts its actors that way needs nothing else.
* ``ctx.network`` (:class:`Network`): whether the run's servers (an OpenAI-compatible
  endpoint, an environment's servers, a refit rendezvous) have readers on another node,
  and the run's token. The core derives it from the placement (:func:`spans_nodes`): on
  one node every server binds loopback and needs no token (the single-host default); when
  a role or the driver may run on another node, servers bind their node's address
  (:func:`rlcore.runtime.workers.server_host`) and every request must carry
  ``Authorization: Bearer <token>`` (:mod:`rlcore.serve.auth` checks it; 401 without).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcore.config import RunConfig

#: Environment variable through which a server process (vLLM's, say) gets the run's token.
TOKEN_ENV = "RLCORE_SERVER_TOKEN"


@dataclass(frozen=True)
class RolePlacement:
    """The nodes one role's actors may run on (``placement.nodes.<role>``).

    Attributes:
        role: ``policy``, ``generation`` or ``env``.
        resources: custom resources each actor asks for (``{"node_a": 0.01}``).
        labels: node labels the node must carry (Ray's ``label_selector``).
    """

    role: str
    resources: Mapping[str, float] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def pinned(self) -> bool:
        """True when the config narrows the role to some nodes."""
        return bool(self.resources or self.labels)

    def ray_options(self) -> dict[str, Any]:
        """Options to merge into ``ActorClass.options(...)`` (empty when not pinned)."""
        out: dict[str, Any] = {}
        if self.resources:
            out["resources"] = {str(k): float(v) for k, v in self.resources.items()}
        if self.labels:
            out["label_selector"] = {str(k): str(v) for k, v in self.labels.items()}
        return out

    def matches(self, resources: Mapping[str, float], labels: Mapping[str, str]) -> bool:
        """Whether a node with these total ``resources`` and ``labels`` can hold one actor."""
        return all(resources.get(k, 0.0) + 1e-9 >= v for k, v in self.resources.items()) and all(
            labels.get(k) == v for k, v in self.labels.items()
        )

    def describe(self) -> str:
        """``resources {'node_a': 0.01}, labels {'zone': 'a'}`` (or ``any node``)."""
        parts = [f"resources {dict(self.resources)}"] * bool(self.resources)
        parts += [f"labels {dict(self.labels)}"] * bool(self.labels)
        return ", ".join(parts) or "any node"


def role_placement(config: RunConfig, role: str) -> RolePlacement:
    """The :class:`RolePlacement` of ``role`` under ``config``."""
    selector = getattr(config.placement.nodes, role)
    return RolePlacement(role, dict(selector.resources), dict(selector.labels))


@dataclass(frozen=True)
class NodeInfo:
    """An alive Ray node as placement sees it (from ``ray.nodes()``)."""

    node_id: str
    resources: Mapping[str, float]
    labels: Mapping[str, str]


def spans_nodes(placements: Iterable[RolePlacement], nodes: Iterable[NodeInfo], driver_node: str) -> bool:
    """Whether a run may put its roles (or its driver, which reads every role) on more than
    one node: the nodes each role may land on (all of them for a role left unpinned), with
    the driver's node, are more than one node. On an embedded cluster (one node) never."""
    nodes = list(nodes)
    used = {driver_node}
    for p in placements:
        used |= {n.node_id for n in nodes if p.matches(n.resources, n.labels)}
    return len(used) > 1


@dataclass(frozen=True)
class Network:
    """Who reaches the run's servers (see the module doc). Picklable: pass it to workers.

    Attributes:
        readers_elsewhere: a reader of some server may be on another node, so servers
            bind their node's address and check the token. False: loopback, no token.
        token: the run's secret for ``Authorization: Bearer``; set exactly when
            ``readers_elsewhere``.
    """

    readers_elsewhere: bool = False
    token: str | None = None

    def __post_init__(self) -> None:
        if self.readers_elsewhere and not self.token:
            raise ValueError("a Network with readers elsewhere needs a token")

    def auth_headers(self) -> dict[str, str]:
        """``{"Authorization": "Bearer <token>"}`` for requests to the run's servers, or {}."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def server_env(self) -> dict[str, str]:
        """Environment of a server process that checks the token (:data:`TOKEN_ENV`), or {}."""
        return {TOKEN_ENV: self.token} if self.token else {}

    @staticmethod
    def spread() -> Network:
        """A network for a run across nodes, with a fresh random token."""
        import secrets

        return Network(readers_elsewhere=True, token=secrets.token_urlsafe(32))
