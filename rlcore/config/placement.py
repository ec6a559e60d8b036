"""Where each role runs on a Ray cluster of several nodes, and who must reach its servers.

Two things a backend reads from its :class:`~rlcore.context.InitContext`:

* ``ctx.placement`` (:class:`RolePlacement`): the nodes the role's actors may run on,
  from ``placement.nodes.<role>`` in Ray's own terms (custom resources each actor asks
  for, node labels it selects). :class:`rlcore.runtime.worker_group.WorkerGroup` takes it
  (``placement=ctx.placement``) and adds it to every actor's options; a backend that
  starts its actors that way needs nothing else.
* ``ctx.network`` (:class:`Network`): whether the run's servers (an OpenAI-compatible
  endpoint, an environment's servers, a refit rendezvous) have readers on another node,
  and the run's token. The core derives it from the placement (:func:`spans_nodes`): on
  one node every server binds loopback and needs no token (the single-host default); when
  a role or the driver may run on another node, servers bind their node's address
  (:func:`rlcore.runtime.addresses.server_host`) and every request must carry
  ``Authorization: Bearer <token>`` (:mod:`rlcore.serve.auth` checks it; 401 without).

On a cluster with GPUs the core also decides which GPU each policy and generation rank
gets (:func:`device_layout`): one Ray placement group of GPU bundles for the run, counted
as Ray counts them (a worker takes ``<role>.devices_per_worker`` of a bundle: a fraction of
one GPU, or whole GPUs). Colocated, policy rank *i* and generation rank *i* share bundle
*i* (one GPU); otherwise each role packs its own bundles. The preflight refuses a layout
that does not fit, ``rlcore plan`` prints it, and ``ctx.placement`` carries each rank's
bundle, so a backend that starts its actors through ``WorkerGroup`` lands there unchanged.
"""

from __future__ import annotations

import math
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
    #: The run's GPU placement group (a Ray ``PlacementGroup``), set by the core on a
    #: cluster with GPUs; ``None`` elsewhere.
    device_group: Any = None
    #: The bundle of ``device_group`` each rank runs in (rank -> bundle index).
    bundles: tuple[int, ...] = ()

    @property
    def pinned(self) -> bool:
        """True when the config narrows the role to some nodes."""
        return bool(self.resources or self.labels)

    def ray_options(self, rank: int | None = None) -> dict[str, Any]:
        """Options to merge into ``ActorClass.options(...)`` of ``rank``'s actor (empty when
        neither pinned nor given a GPU bundle). With a bundle, the actor is scheduled into
        it; the node labels are then the bundle's (Ray selects nodes per bundle)."""
        out: dict[str, Any] = {}
        if self.resources:
            out["resources"] = {str(k): float(v) for k, v in self.resources.items()}
        if rank is not None and self.device_group is not None and rank < len(self.bundles):
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            out["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.device_group, placement_group_bundle_index=self.bundles[rank]
            )
        elif self.labels:
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


def role_placement(config: RunConfig, role: str, devices: DeviceGroup | None = None) -> RolePlacement:
    """The :class:`RolePlacement` of ``role`` under ``config`` (in ``devices``' bundles when
    the core reserved them)."""
    selector = getattr(config.placement.nodes, role)
    if devices is None or role not in RESOURCE_ROLES:
        return RolePlacement(role, dict(selector.resources), dict(selector.labels))
    return RolePlacement(
        role, dict(selector.resources), dict(selector.labels),
        device_group=devices.group, bundles=devices.layout.ranks(role),
    )


# ---------------------------------------------------------------- GPU bundles

#: Roles whose workers hold devices (``workers x devices_per_worker``).
RESOURCE_ROLES = ("policy", "generation")
_EPS = 1e-9


@dataclass(frozen=True)
class DeviceBundle:
    """One bundle of the run's GPU placement group: ``gpus`` whole GPUs (one, unless a worker
    holds several) and the workers in it, each ``(role, rank, share)`` with ``share`` the
    GPUs its actor asks Ray for (``<role>.devices_per_worker``)."""

    gpus: int
    members: tuple[tuple[str, int, float], ...]

    def ray_bundle(self, config: RunConfig) -> dict[str, float]:
        """The bundle as Ray's ``placement_group`` takes it: the GPUs, one CPU per member
        (what :func:`rlcore.runtime.resources.device_resources` gives a GPU rank) and the
        members' custom resources (``placement.nodes.<role>.resources``)."""
        out: dict[str, float] = {"GPU": float(self.gpus), "CPU": float(len(self.members))}
        for role, _, _ in self.members:
            for name, value in getattr(config.placement.nodes, role).resources.items():
                out[str(name)] = out.get(str(name), 0.0) + float(value)
        return out

    def labels(self, config: RunConfig) -> dict[str, str]:
        """The node labels the bundle's node must carry (its members share a selector)."""
        roles = {role for role, _, _ in self.members}
        return {str(k): str(v) for r in sorted(roles) for k, v in getattr(config.placement.nodes, r).labels.items()}

    def describe(self) -> str:
        """``policy rank 0 (0.5 GPU) + generation rank 0 (0.5 GPU)``."""
        return " + ".join(f"{role} rank {rank} ({share:g} GPU)" for role, rank, share in self.members)


@dataclass(frozen=True)
class DeviceLayout:
    """Which GPU bundle each policy and generation rank gets (see :func:`device_layout`)."""

    bundles: tuple[DeviceBundle, ...]
    colocated: bool = False

    @property
    def gpus(self) -> int:
        """GPUs the placement group asks for: the preflight's count."""
        return sum(b.gpus for b in self.bundles)

    def ranks(self, role: str) -> tuple[int, ...]:
        """Bundle index of each of ``role``'s ranks, by rank."""
        found = {rank: i for i, b in enumerate(self.bundles) for r, rank, _ in b.members if r == role}
        return tuple(found[rank] for rank in sorted(found))

    def lines(self) -> list[str]:
        """One line per bundle: ``GPU 0: policy rank 0 (0.5 GPU) + generation rank 0 (0.5 GPU)``."""
        out, first = [], 0
        for b in self.bundles:
            where = f"GPU {first}" if b.gpus == 1 else f"GPUs {first}-{first + b.gpus - 1}"
            out.append(f"{where}: {b.describe()}")
            first += b.gpus
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "colocated": self.colocated,
            "bundles": [
                {"gpus": b.gpus, "members": [{"role": r, "rank": k, "share": s} for r, k, s in b.members]}
                for b in self.bundles
            ],
        }


def _share(config: RunConfig, role: str) -> float:
    """``<role>.devices_per_worker`` as Ray takes a GPU request: a fraction of one GPU, or
    whole GPUs; anything else is refused naming the key."""
    from rlcore.errors import ConfigError

    share = float(getattr(config, role).devices_per_worker)
    if share > 1 + _EPS and abs(share - round(share)) > _EPS:
        raise ConfigError(
            f"config key '{role}.devices_per_worker' is {share:g}: on GPUs a worker holds a "
            "fraction of one GPU (at most 1) or whole GPUs (2, 3, ...), as Ray assigns them",
            key=f"{role}.devices_per_worker",
        )
    return share


def device_layout(config: RunConfig) -> DeviceLayout:
    """The GPU bundles of the run's policy and generation workers, counted as Ray counts them.

    Colocated (``placement.colocated``): bundle *i* is one GPU holding policy rank *i* and
    generation rank *i*, each asking ``devices_per_worker`` of it, so the two shares must
    add up to at most 1 (0.5 each is the usual split); ``max(policy.workers,
    generation.workers)`` GPUs. Otherwise each role packs its own bundles: a share below 1
    puts ``floor(1 / share)`` of its workers on one GPU, a share of k >= 1 gives each
    worker k GPUs of its own. Raises :class:`~rlcore.errors.ConfigError` naming the key
    for shares that cannot be placed.
    """
    from rlcore.errors import ConfigError

    workers = {r: int(getattr(config, r).workers) for r in RESOURCE_ROLES if getattr(config, r).backend}
    shares = {r: _share(config, r) for r in workers}
    if config.placement.colocated and len(workers) == 2:
        p, g = shares["policy"], shares["generation"]
        if p + g > 1 + _EPS:
            raise ConfigError(
                f"config key 'generation.devices_per_worker': placement.colocated puts policy rank i "
                f"and generation rank i on GPU i, but policy.devices_per_worker ({p:g}) + "
                f"generation.devices_per_worker ({g:g}) = {p + g:g} GPUs > 1; set both to 0.5 "
                "(or placement.colocated=false)",
                key="generation.devices_per_worker",
            )
        bundles = tuple(
            DeviceBundle(1, tuple((r, i, shares[r]) for r in RESOURCE_ROLES if i < workers[r]))
            for i in range(max(workers.values()))
        )
        return DeviceLayout(bundles, colocated=True)
    out: list[DeviceBundle] = []
    for role, n in workers.items():
        share = shares[role]
        if share >= 1 - _EPS:
            out += [DeviceBundle(round(share), ((role, i, float(round(share))),)) for i in range(n)]
            continue
        per = max(1, math.floor(1 / share + _EPS))
        out += [
            DeviceBundle(1, tuple((role, i, share) for i in range(first, min(n, first + per))))
            for first in range(0, n, per)
        ]
    return DeviceLayout(tuple(out))


@dataclass(frozen=True)
class DeviceGroup:
    """The run's reserved GPU bundles: the layout and its Ray placement group (picklable,
    so it travels in :class:`rlcore.context.InitContext` to the init hooks)."""

    layout: DeviceLayout
    group: Any


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
