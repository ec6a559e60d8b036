"""What a backend declares about itself, once and statically.

A backend plugin returns one :class:`BackendDeclaration` from its
``rlcore_declare_backend`` hook. The declaration is plain data: listing it
(``rlcore plugins``) imports none of the backend's heavy dependencies, and the
planner turns it, together with the run's config, into the setup plan.

Parts of a declaration may depend on the run's config (Megatron generation needs
the converted checkpoint *unless* it starts refit-fed): such entries carry
:class:`Condition` objects that are evaluated against the role's section of the
config, and the planner names the condition when it explains an edge.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rlcore.errors import DeclarationError

#: The version of the backend contract (hookspecs, declarations, handle protocols)
#: this rlcore implements, ``MAJOR.MINOR``. A minor version only adds (new optional
#: hooks, declaration fields with defaults, protocol methods the core calls only when
#: declared); a major version may change or remove. A plugin declares the version it
#: was written against (:attr:`BackendDeclaration.contract_version`) and loads when
#: its major equals the core's and its minor is not newer.
CONTRACT_VERSION = "2.6"
_VERSION_RE = re.compile(r"^(\d+)\.(\d+)$")

#: What each major version changed that a plugin of the major before must change, and how.
MAJOR_CHANGES: dict[int, str] = {
    2: (
        "contract 2.0 changed GenerationHandle.generate(prompt_ids, *, n, max_tokens, "
        "temperature, seed) to generate(prompt_ids, params), params an "
        "rlcore.handles.SamplingParams with those four fields (Session.generate takes one "
        "too); to port a 1.x plugin, take params and read params.n, params.max_tokens, "
        "params.temperature and params.seed, then declare contract_version=\"2.0\""
    ),
}


def parse_contract_version(text: str) -> tuple[int, int]:
    """``"1.2"`` -> ``(1, 2)``; :class:`ValueError` for anything else."""
    m = _VERSION_RE.match(str(text))
    if m is None:
        raise ValueError(f"contract version {text!r} is not MAJOR.MINOR (e.g. {CONTRACT_VERSION!r})")
    return int(m.group(1)), int(m.group(2))


def contract_compatible(plugin_version: str, core_version: str = CONTRACT_VERSION) -> bool:
    """Whether a plugin written for ``plugin_version`` runs on a core implementing
    ``core_version``: same major, and the plugin's minor not newer than the core's."""
    p, c = parse_contract_version(plugin_version), parse_contract_version(core_version)
    return p[0] == c[0] and p[1] <= c[1]


def porting_note(plugin_version: str, core_version: str = CONTRACT_VERSION) -> str:
    """The sentence that ends the refusal of a plugin of an older major: what changed since
    and how to port it (:data:`MAJOR_CHANGES`), after a space; empty when the plugin's
    major is not older."""
    p, c = parse_contract_version(plugin_version)[0], parse_contract_version(core_version)[0]
    changes = [MAJOR_CHANGES[m] for m in range(p + 1, c + 1) if m in MAJOR_CHANGES]
    return f" What changed: {'; '.join(changes)}." if changes else ""


class Role(StrEnum):
    """A part of the RL job a backend can serve."""

    POLICY = "policy"
    GENERATION = "generation"
    ENV = "env"


class Transport(StrEnum):
    """A way to move weights from policy to generation during refit."""

    COLLECTIVE = "collective"  # torch.distributed group: NCCL on GPUs, gloo on CPUs
    SHARED_MEMORY = "shared_memory"  # same host: /dev/shm files mapped by both sides
    CUDA_IPC = "cuda_ipc"  # same GPU(s): CUDA IPC handles
    DISK = "disk"  # safetensors published atomically; always works


#: Events the core itself raises during setup. A backend may wait for them.
#: ``generation.endpoint``: the generation engine serves an OpenAI-compatible
#: endpoint with real weights; its value is an :class:`rlcore.handles.Endpoint`.
ENDPOINT_EVENT = "generation.endpoint"
CORE_EVENTS: frozenset[str] = frozenset({ENDPOINT_EVENT})

_NAME_RE = re.compile(r"^[a-z][a-z0-9_\-]*$")
_ARTIFACT_RE = re.compile(r"^[a-z][a-z0-9_\-.]*$")


@dataclass(frozen=True)
class Condition:
    """A test on the role's config section: ``key`` (dotted) must equal ``equals``.

    Keys are looked up in the role's view of the config: ``refit_fed``,
    ``colocated``, ``workers`` and ``options.<name>`` for backend options.
    """

    key: str
    equals: Any

    def holds(self, view: Mapping[str, Any]) -> bool:
        node: Any = view
        for part in self.key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return False
            node = node[part]
        return bool(node == self.equals)

    def describe(self) -> str:
        return f"{self.key} == {self.equals!r}"


def _conditions_hold(conditions: tuple[Condition, ...], view: Mapping[str, Any]) -> bool:
    return all(c.holds(view) for c in conditions)


@dataclass(frozen=True)
class Artifact:
    """Something a backend writes that other backends read (e.g. a converted checkpoint).

    Attributes:
        name: artifact name, shared by producer and consumers (``megatron.checkpoint``).
        atomic: True if the backend publishes it through the ``rlcore_publish`` hook:
            readers may then start at once and wait for it. False makes readers start
            only after the producing init has finished.
        role: the role in which the backend produces it (``None``: any role it serves).
        when: conditions on the config under which it is produced (all must hold).
        description: one line for people.
    """

    name: str
    atomic: bool
    role: Role | None = None
    when: tuple[Condition, ...] = ()
    description: str = ""

    def applies(self, role: Role, view: Mapping[str, Any]) -> bool:
        return (self.role is None or self.role == role) and _conditions_hold(self.when, view)


@dataclass(frozen=True)
class Need:
    """An artifact or core event a backend's init waits for.

    Attributes:
        name: the artifact's name, or a core event from :data:`CORE_EVENTS`.
        kind: ``"artifact"`` or ``"event"``.
        role: the role in which the backend needs it (``None``: any role it serves).
        when: conditions on the config under which it is needed (all must hold).
        reason: why, in words; shown by ``rlcore plan``.
    """

    name: str
    kind: str = "artifact"
    role: Role | None = None
    when: tuple[Condition, ...] = ()
    reason: str = ""

    def applies(self, role: Role, view: Mapping[str, Any]) -> bool:
        return (self.role is None or self.role == role) and _conditions_hold(self.when, view)


@dataclass(frozen=True)
class OverlapSafety:
    """May this backend's init run while other inits run?

    Attributes:
        non_colocated: safe to overlap with inits on other devices/hosts.
        colocated: safe to overlap with inits on the same devices (policy and
            generation under colocated placement). Engines that profile free device
            memory at start (vLLM, SGLang) must say False.
        reason: why it is not safe, in words; shown by ``rlcore plan``.
    """

    non_colocated: bool = True
    colocated: bool = False
    reason: str = ""


class RefitLanding(StrEnum):
    """When a refit reaches a generation engine that is serving calls (contract 2.1).

    The asynchronous loop (``grpo.max_staleness`` > 0) sends a refit while the rollouts
    of later steps are being sampled; the landing says what the engine does with the
    requests it holds when the new weights arrive.
    """

    #: The refit waits until the engine's calls in flight have returned, and the next
    #: call runs on the new weights: every token of a sample comes from one version.
    #: Every backend does this (the core serialises the two calls); the default.
    BETWEEN_CALLS = "between_calls"
    #: The engine's own pause holds its requests in flight, the weights land, and the
    #: requests resume on the new weights: a sample's later tokens may come from a
    #: newer version than its first ones.
    PAUSE = "pause"
    #: The worker applies the refit between two steps of the engine's decode loop,
    #: without stopping its requests: as with ``PAUSE``, a sample may span versions.
    BETWEEN_STEPS = "between_steps"


@dataclass(frozen=True)
class InflightRefit:
    """How a generation backend takes a refit while it serves, under some config (contract 2.1).

    Attributes:
        landing: when the new weights reach the engine (:class:`RefitLanding`).
        token_versions: the samples it returns carry the weight version of each token
            (``versions`` beside ``token_ids``), so a sample a refit landed in the middle
            of says which tokens came from which weights. Only meaningful for a landing
            in flight (``PAUSE``, ``BETWEEN_STEPS``): between calls a sample has one version.
        when: conditions on the generation's config view under which this landing
            applies (all must hold); empty: always.
    """

    landing: RefitLanding
    token_versions: bool = False
    when: tuple[Condition, ...] = ()

    def __post_init__(self) -> None:
        # Authors may write the landing as its string; an unknown one is left for the
        # declaration's validation to name with the plugin.
        if isinstance(self.landing, str) and not isinstance(self.landing, RefitLanding):
            try:
                object.__setattr__(self, "landing", RefitLanding(self.landing))
            except ValueError:
                pass
        object.__setattr__(self, "when", tuple(self.when))


#: What a policy may declare in ``loss_options``: the parts of :class:`rlcore.handles.LossOptions`
#: its ``train_step`` applies (contract 2.5).
LOSS_FEATURES = ("clip_eps_high", "aggregation", "correction")

#: What a generation backend that declares no in-flight refit does: it waits for its calls.
BETWEEN_CALLS = InflightRefit(RefitLanding.BETWEEN_CALLS)


@dataclass(frozen=True)
class CheckpointSupport:
    """How a policy backend saves and loads its training state (contract 2.2).

    A policy that declares it implements :class:`rlcore.handles.Checkpointable`; the
    run then takes checkpoints (``checkpoint.every_steps``), resumes from them
    (``rlcore run --resume``) and exports them (``rlcore export``).

    Attributes:
        format: the name of what its ``save_checkpoint`` writes, e.g.
            ``"torch-dcp"`` or ``"megatron-dist-ckpt"``; recorded in each
            checkpoint's manifest. A checkpoint of another format is refused at resume.
        version: the version of that format as this backend writes it. Bump it when
            this backend can no longer load what an earlier release wrote: resume then
            refuses the old checkpoint in one line naming both versions, instead of
            failing inside ``load_checkpoint``.
        overlap: the save only reads the policy's state, so the core may start it and
            go on with the next step's rollouts while it writes; the core makes no other
            call on the policy (``train_step``, ``logprobs``, refit) until the save has
            returned. False: the run waits for the save before going on.
        staged: the handle also implements :class:`rlcore.handles.StagedCheckpointable`
            (contract 2.3): ``stage_checkpoint`` returns once the state is copied off the
            devices and writes the files in the background. The loop then waits only for
            that copy: it trains, samples and refits while the files are written, and the
            core publishes the checkpoint once ``checkpoint_written`` says they all are
            (a crash before that leaves the previous checkpoint the newest). One staged
            save is in flight at a time; ``checkpoint.staged: false`` saves as without.
    """

    format: str
    version: str = "1"
    overlap: bool = False
    staged: bool = False


@dataclass(frozen=True)
class BackendDeclaration:
    """Everything the core needs to know about a backend before starting it.

    Attributes:
        name: the backend's name as the config selects it (``policy.backend: fsdp``);
            lower case letters, digits, ``_`` and ``-``. Unique across plugins.
        roles: the roles it serves.
        overlap: overlap safety of its init.
        produces: artifacts it writes during init.
        needs: artifacts and events its init waits for.
        refit_fed: (generation) it can start without reading checkpoint weights and
            serve after the first refit. The run selects this with
            ``generation.refit_fed: true``.
        send_transports: (policy) refit transports it can send over.
        receive_transports: (generation) refit transports it can receive over.
        openai_endpoint: (generation) it can serve an OpenAI-compatible HTTP
            endpoint for environments (its handle's ``endpoint``).
        openai_endpoint_when: conditions on the generation's config under which it
            serves that endpoint (all must hold), e.g.
            ``(Condition("options.serve_openai", True),)``; empty: whenever
            ``openai_endpoint`` is true. The planner refuses an env that needs the
            endpoint when the conditions do not hold, before anything starts.
        dtypes: (policy, generation) the compute dtypes (``model.dtype``) it runs in
            and exports its weights in, e.g. ``{"float32", "bfloat16"}``; the
            preflight refuses any other before anything starts, and the conformance
            suite exercises each. Empty: not declared (the suite runs ``float32``, the
            preflight does not check). Since contract 1.1.
        inflight_refit: (generation) how it takes a refit while it serves calls
            (contract 2.1): the first entry whose ``when`` holds under the
            generation's config applies (:meth:`refit_landing`); none (the default),
            :data:`BETWEEN_CALLS`: a refit waits for the calls in flight. A landing
            in flight (``PAUSE``, ``BETWEEN_STEPS``) promises that a refit sent while
            the engine samples completes without ending those requests, and that the
            tokens after it come from the new weights.
        max_staleness: (policy) the most weight versions a sample it trains on may lag
            its current weights (contract 2.1): its ``train_step`` takes the sampling
            logprobs as ``old_logprobs`` and corrects for them per token (the clipped
            importance ratio of :func:`rlcore.runtime.losses.clipped_pg_loss`), so
            samples from older weights still give the right gradient. The preflight
            refuses ``grpo.max_staleness`` above it. 0 (the default): it trains only
            on samples from its current weights (the synchronous loop).
        checkpoint: (policy) how it saves and loads its training state
            (:class:`CheckpointSupport`, contract 2.2); ``None`` (the default): it does
            not, and a config with ``checkpoint.every_steps`` or a resume is refused
            before anything starts.
        loss_options: (policy) which of :class:`rlcore.handles.LossOptions` its
            ``train_step`` applies when given ``loss=`` (contract 2.5): any of
            :data:`LOSS_FEATURES`, ``clip_eps_high`` (the asymmetric clip),
            ``aggregation`` (the three aggregations), ``correction`` (``tis`` and
            ``mis``). The core passes ``loss=`` only when the run asks for a feature, and
            refuses a run that asks for one the policy does not declare, before anything
            starts. :class:`rlcore.runtime.losses.PolicyGradientWorker` applies all three.
        extra_draws: (env) its ``collect_rollouts`` gives other prompts for each
            ``RolloutRequest.draw`` > 0 of one step (contract 2.5): what dynamic sampling
            (``grpo.dynamic_sampling``) asks for after it drops groups of equal rewards.
            A run with dynamic sampling and an env that does not declare it is refused.
        trains_adapters: (policy) it takes ``policy.options.lora``
            (:class:`rlcore.lora.LoraOptions`, contract 2.4) and then trains low-rank
            adapters alone, the base weights frozen and without optimizer state, and
            exports merged weights (base + the adapters' product, under the base
            weights' names) to refit and ``rlcore export``. The core refuses
            ``policy.options.lora`` for a policy that does not declare it.
        takes_adapters: (generation) it serves a policy's LoRA adapters in place of merged
            weights (contract 2.6): its handle implements
            :class:`rlcore.handles.AdapterReceiver`, its engines start from the base
            weights of ``model.path`` able to serve adapters of the run's rank and targets
            (:attr:`rlcore.context.InitContext.adapters`), and each refit then carries the
            adapters alone. Without it, a policy that trains adapters sends merged weights.
        max_workers: the most workers (``<role>.workers``: policy ranks, generation
            replicas, env processes) it runs in any role it serves (contract 2.6);
            ``rlcore plan`` refuses more before anything starts, naming the key, the
            backend and the limit. ``None`` (the default): any number.
        memory_handoff: (policy, generation) its handles implement
            :class:`rlcore.handles.MemoryHandoff` (``sleep``/``wake``): with
            ``placement.colocated`` the loop has it give device memory back while the
            other role works.
        contract_version: the version of rlcore's backend contract the plugin was
            written against (``MAJOR.MINOR``, :data:`CONTRACT_VERSION` at the time);
            the registry refuses a plugin of another major version (saying what
            changed: :data:`MAJOR_CHANGES`), or of a newer minor than the core's.
            Left out: this core's version (test doubles written with it); a plugin
            you publish states it.
        options: a dataclass type describing the backend's options
            (``<role>.options`` in the config); unknown keys and wrong types are
            then config errors that name the key. ``None``: options are not checked.
        description: one line for people (``rlcore plugins``).
    """

    name: str
    roles: frozenset[Role]
    overlap: OverlapSafety = field(default_factory=OverlapSafety)
    produces: tuple[Artifact, ...] = ()
    needs: tuple[Need, ...] = ()
    refit_fed: bool = False
    send_transports: frozenset[Transport] = frozenset()
    receive_transports: frozenset[Transport] = frozenset()
    openai_endpoint: bool = False
    openai_endpoint_when: tuple[Condition, ...] = ()
    memory_handoff: bool = False
    dtypes: frozenset[str] = frozenset()
    inflight_refit: tuple[InflightRefit, ...] = ()
    max_staleness: int = 0
    checkpoint: CheckpointSupport | None = None
    trains_adapters: bool = False
    takes_adapters: bool = False
    loss_options: frozenset[str] = frozenset()
    extra_draws: bool = False
    max_workers: int | None = None
    contract_version: str = CONTRACT_VERSION
    options: type | None = None
    description: str = ""

    def __post_init__(self) -> None:
        # Accept lists/sets/strings from authors; store canonical immutable forms.
        object.__setattr__(self, "roles", frozenset(Role(r) for r in self.roles))
        object.__setattr__(
            self, "send_transports", frozenset(Transport(t) for t in self.send_transports)
        )
        object.__setattr__(
            self, "receive_transports", frozenset(Transport(t) for t in self.receive_transports)
        )
        object.__setattr__(
            self, "dtypes", frozenset([self.dtypes] if isinstance(self.dtypes, str) else self.dtypes)
        )
        object.__setattr__(self, "produces", tuple(self.produces))
        object.__setattr__(self, "needs", tuple(self.needs))
        object.__setattr__(self, "openai_endpoint_when", tuple(self.openai_endpoint_when))
        object.__setattr__(self, "inflight_refit", tuple(self.inflight_refit))
        object.__setattr__(
            self, "loss_options",
            frozenset([self.loss_options] if isinstance(self.loss_options, str) else self.loss_options),
        )

    def serves(self, role: Role) -> bool:
        return role in self.roles

    def produced(self, role: Role, view: Mapping[str, Any]) -> list[Artifact]:
        """Artifacts produced when serving ``role`` under the config ``view``."""
        return [a for a in self.produces if a.applies(role, view)]

    def needed(self, role: Role, view: Mapping[str, Any]) -> list[Need]:
        """Needs in force when serving ``role`` under the config ``view``."""
        return [n for n in self.needs if n.applies(role, view)]

    def serves_endpoint(self, view: Mapping[str, Any]) -> bool:
        """Whether the generation serves an OpenAI-compatible endpoint under the config ``view``."""
        return self.openai_endpoint and _conditions_hold(self.openai_endpoint_when, view)

    def refit_landing(self, view: Mapping[str, Any]) -> InflightRefit:
        """How a refit reaches this generation under the config ``view``: the first
        :attr:`inflight_refit` entry whose conditions hold, else :data:`BETWEEN_CALLS`."""
        return next((r for r in self.inflight_refit if _conditions_hold(r.when, view)), BETWEEN_CALLS)

    def option_names(self) -> list[str] | None:
        if self.options is None:
            return None
        return [f.name for f in dataclasses.fields(self.options)]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``rlcore plugins --json``)."""

        def cond(cs: tuple[Condition, ...]) -> list[dict[str, Any]]:
            return [{"key": c.key, "equals": c.equals} for c in cs]

        return {
            "name": self.name,
            "roles": sorted(r.value for r in self.roles),
            "overlap": {
                "non_colocated": self.overlap.non_colocated,
                "colocated": self.overlap.colocated,
                "reason": self.overlap.reason,
            },
            "produces": [
                {
                    "name": a.name,
                    "atomic": a.atomic,
                    "role": a.role.value if a.role else None,
                    "when": cond(a.when),
                    "description": a.description,
                }
                for a in self.produces
            ],
            "needs": [
                {
                    "name": n.name,
                    "kind": n.kind,
                    "role": n.role.value if n.role else None,
                    "when": cond(n.when),
                    "reason": n.reason,
                }
                for n in self.needs
            ],
            "refit_fed": self.refit_fed,
            "send_transports": sorted(t.value for t in self.send_transports),
            "receive_transports": sorted(t.value for t in self.receive_transports),
            "openai_endpoint": self.openai_endpoint,
            "openai_endpoint_when": cond(self.openai_endpoint_when),
            "memory_handoff": self.memory_handoff,
            "dtypes": sorted(self.dtypes),
            "inflight_refit": [
                {"landing": str(r.landing), "token_versions": r.token_versions, "when": cond(r.when)}
                for r in self.inflight_refit
            ],
            "max_staleness": self.max_staleness,
            "checkpoint": (
                None if self.checkpoint is None else {
                    "format": self.checkpoint.format, "version": self.checkpoint.version,
                    "overlap": self.checkpoint.overlap, "staged": self.checkpoint.staged,
                }
            ),
            "trains_adapters": self.trains_adapters,
            "takes_adapters": self.takes_adapters,
            "loss_options": sorted(self.loss_options),
            "extra_draws": self.extra_draws,
            "max_workers": self.max_workers,
            "contract_version": self.contract_version,
            "options": self.option_names(),
            "description": self.description,
        }


#: Keys of the role view that conditions may test besides ``options.*``.
VIEW_KEYS: frozenset[str] = frozenset({"refit_fed", "colocated", "workers", "role"})


def _name(d: BackendDeclaration) -> Iterator[str]:
    if not _NAME_RE.match(d.name or ""):
        yield f"name {d.name!r} must be lower case letters, digits, '_' or '-', starting with a letter"


def _roles(d: BackendDeclaration) -> Iterator[str]:
    if not d.roles:
        yield "roles is empty: a backend serves at least one of policy, generation, env"


def _overlap(d: BackendDeclaration) -> Iterator[str]:
    if d.overlap.colocated and not d.overlap.non_colocated:
        yield (
            "overlap: safe when colocated but not when non-colocated is contradictory "
            "(sharing devices is the harder case)"
        )


def _generation_only(d: BackendDeclaration) -> Iterator[str]:
    if Role.GENERATION not in d.roles:
        for field_name in ("refit_fed", "openai_endpoint", "inflight_refit"):
            if getattr(d, field_name):
                yield f"{field_name} is only meaningful for a backend that serves generation"
        if d.receive_transports:
            yield "receive_transports given but the backend does not serve generation"


#: The compute dtypes ``model.dtype`` takes (and a declaration's ``dtypes`` may name).
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def _dtypes(d: BackendDeclaration) -> Iterator[str]:
    unknown = sorted(t for t in d.dtypes if t not in DTYPES)
    if unknown:
        yield f"dtypes {unknown} unknown; a dtype is one of {list(DTYPES)}"
    if d.dtypes and not d.roles & {Role.POLICY, Role.GENERATION}:
        yield "dtypes given but the backend serves neither policy nor generation"


def _memory_handoff(d: BackendDeclaration) -> Iterator[str]:
    if d.memory_handoff and not d.roles & {Role.POLICY, Role.GENERATION}:
        yield "memory_handoff is only meaningful for a backend that serves policy or generation"


def _inflight_refit(d: BackendDeclaration) -> Iterator[str]:
    for i, r in enumerate(d.inflight_refit):
        where = f"inflight_refit[{i}]"
        if not isinstance(r, InflightRefit):
            yield f"{where} {r!r} is not an InflightRefit"
            continue
        if not isinstance(r.landing, RefitLanding):
            yield f"{where}: landing {r.landing!r} is not one of {[x.value for x in RefitLanding]}"
        elif r.token_versions and r.landing is RefitLanding.BETWEEN_CALLS:
            yield (
                f"{where}: token_versions with landing between_calls is contradictory (a refit "
                "never lands inside a call, so every token of a sample has one version)"
            )
        yield from _condition_problems(d, where, r.when)


def _max_staleness(d: BackendDeclaration) -> Iterator[str]:
    k = d.max_staleness
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        yield f"max_staleness must be an int >= 0 (weight versions), got {k!r}"
    elif k and Role.POLICY not in d.roles:
        yield "max_staleness is only meaningful for a backend that serves policy"


def _checkpoint(d: BackendDeclaration) -> Iterator[str]:
    c = d.checkpoint
    if c is None:
        return
    if not isinstance(c, CheckpointSupport):
        yield f"checkpoint must be a CheckpointSupport or None, got {type(c).__name__}"
    elif Role.POLICY not in d.roles:
        yield "checkpoint is only meaningful for a backend that serves policy"
    elif not (isinstance(c.format, str) and c.format.strip()):
        yield f"checkpoint.format must be a non-empty string, got {c.format!r}"
    elif not (isinstance(c.version, str) and c.version.strip()):
        yield f"checkpoint.version must be a non-empty string, got {c.version!r}"


def _loss_options(d: BackendDeclaration) -> Iterator[str]:
    unknown = sorted(set(d.loss_options) - set(LOSS_FEATURES))
    if unknown:
        yield f"loss_options {unknown} are not features of rlcore.handles.LossOptions ({', '.join(LOSS_FEATURES)})"
    elif d.loss_options and Role.POLICY not in d.roles:
        yield "loss_options is only meaningful for a backend that serves policy"


def _extra_draws(d: BackendDeclaration) -> Iterator[str]:
    if d.extra_draws and Role.ENV not in d.roles:
        yield "extra_draws is only meaningful for a backend that serves env"


def _max_workers(d: BackendDeclaration) -> Iterator[str]:
    n = d.max_workers
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        yield f"max_workers must be an int >= 1 (the most <role>.workers it runs) or None, got {n!r}"


def _refit_fed(d: BackendDeclaration) -> Iterator[str]:
    if d.refit_fed and not d.receive_transports:
        yield "refit_fed needs at least one receive transport to get its first weights"


def _endpoint_conditions(d: BackendDeclaration) -> Iterator[str]:
    if d.openai_endpoint_when and not d.openai_endpoint:
        yield "openai_endpoint_when given but openai_endpoint is False"


def _contract_version(d: BackendDeclaration) -> Iterator[str]:
    try:
        parse_contract_version(d.contract_version)
    except ValueError as err:
        yield str(err)


def _transports(d: BackendDeclaration) -> Iterator[str]:
    pol, gen = Role.POLICY in d.roles, Role.GENERATION in d.roles
    if d.send_transports and not pol:
        yield "send_transports given but the backend does not serve policy"
    if pol and not d.send_transports:
        yield "a policy backend must declare at least one send transport (disk always works)"
    if gen and not d.receive_transports:
        yield "a generation backend must declare at least one receive transport (disk always works)"


def _options(d: BackendDeclaration) -> Iterator[str]:
    if d.options is not None and not dataclasses.is_dataclass(d.options):
        yield f"options must be a dataclass type, got {d.options!r}"


def _condition_problems(d: BackendDeclaration, where: str, conditions: tuple[Condition, ...]) -> Iterator[str]:
    """Each condition tests a key of the role view, or an option the options dataclass has."""
    option_names = set(d.option_names() or []) if dataclasses.is_dataclass(d.options) else None
    for c in conditions:
        if not isinstance(c, Condition):
            yield f"{where}: condition {c!r} is not a Condition"
            continue
        head, _, rest = c.key.partition(".")
        if head == "options":
            if not rest:
                yield f"{where}: condition key 'options' needs an option name"
            elif option_names is not None and rest.split(".")[0] not in option_names:
                yield (
                    f"{where}: condition tests option '{rest}', which the options "
                    f"dataclass {d.options.__name__} does not define"  # type: ignore[union-attr]
                )
        elif c.key not in VIEW_KEYS:
            yield f"{where}: condition key '{c.key}' is not one of {sorted(VIEW_KEYS)} or options.<name>"


def _role_served(d: BackendDeclaration, where: str, role: Role | None) -> Iterator[str]:
    if role is not None and role not in d.roles:
        yield f"{where} is for role '{role}', which the backend does not serve"


def _artifacts(d: BackendDeclaration) -> Iterator[str]:
    yield from _condition_problems(d, "openai_endpoint_when", d.openai_endpoint_when)
    for a in d.produces:
        if not isinstance(a, Artifact):
            yield f"produces entry {a!r} is not an Artifact"
            continue
        if not _ARTIFACT_RE.match(a.name or ""):
            yield f"artifact name {a.name!r} must be lower case, e.g. 'megatron.checkpoint'"
        yield from _role_served(d, f"artifact '{a.name}'", a.role)
        yield from _condition_problems(d, f"artifact '{a.name}'", a.when)


def _waits_for_itself(d: BackendDeclaration, n: Need) -> bool:
    return any(
        isinstance(a, Artifact)
        and a.name == n.name
        and (a.role is None or n.role is None or a.role == n.role)
        and not a.when
        and not n.when
        for a in d.produces
    )


def _needs(d: BackendDeclaration) -> Iterator[str]:
    for n in d.needs:
        if not isinstance(n, Need):
            yield f"needs entry {n!r} is not a Need"
            continue
        if n.kind not in ("artifact", "event"):
            yield f"need '{n.name}': kind must be 'artifact' or 'event', got {n.kind!r}"
        if n.kind == "event" and n.name not in CORE_EVENTS:
            yield f"need '{n.name}': unknown core event; known events: {sorted(CORE_EVENTS)}"
        yield from _role_served(d, f"need '{n.name}'", n.role)
        yield from _condition_problems(d, f"need '{n.name}'", n.when)
        if n.kind == "artifact" and _waits_for_itself(d, n):
            yield (
                f"artifact '{n.name}' is both produced and needed in the same role: "
                "the backend would wait for itself"
            )


#: One check per rule a declaration must keep; each yields what it finds wrong.
_RULES: tuple[Callable[[BackendDeclaration], Iterator[str]], ...] = (
    _name, _roles, _overlap, _generation_only, _refit_fed, _dtypes, _memory_handoff,
    _endpoint_conditions, _inflight_refit, _max_staleness, _checkpoint, _loss_options, _extra_draws,
    _max_workers, _contract_version, _transports, _options, _artifacts, _needs,
)


def validate_declaration(
    decl: object, *, plugin: str, distribution: str | None
) -> BackendDeclaration:
    """Check a declaration for type errors and contradictions (every rule of :data:`_RULES`).

    Returns the declaration; raises :class:`DeclarationError` naming the plugin,
    its distribution and every problem found.
    """
    if not isinstance(decl, BackendDeclaration):
        raise DeclarationError(
            f"plugin '{plugin}' (distribution {distribution or 'unknown'}): "
            f"rlcore_declare_backend returned {type(decl).__name__}, expected BackendDeclaration",
            plugin=plugin,
            distribution=distribution,
        )
    problems = [p for rule in _RULES for p in rule(decl)]
    if problems:
        raise DeclarationError(
            f"plugin '{plugin}' (distribution {distribution or 'unknown'}) declares backend "
            f"{decl.name!r} inconsistently:\n  - " + "\n  - ".join(problems),
            plugin=plugin,
            distribution=distribution,
        )
    return decl
