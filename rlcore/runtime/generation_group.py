"""What the generation backends over a :class:`rlcore.runtime.worker_group.WorkerGroup` of
independent engines share: the handle's driver-side calls (the generation counterpart of
:mod:`rlcore.runtime.policy_group`), the start of the engines, and the engine's side.

:class:`GroupGeneration` implements :class:`rlcore.handles.RefitReceiver` (engine ``i``
is rank ``1 + i`` of every refit channel) and the generation calls of
:class:`rlcore.handles.GenerationHandle`, fanned out over the engines in contiguous
shards. Its workers provide ``open_refit_channel(spec, rank)``,
``receive_weights(spec, step, buckets)``, ``refit_ceiling(spec, rank, step, nbytes)``,
``generate(prompt_ids, params, seeds)`` (``params`` a :class:`rlcore.handles.SamplingParams`),
``logprobs(batch)`` and ``weight_version()``; :class:`EngineWorker` is a base for them.
:func:`start_engines` starts the group of a backend's init hook. An engine class that takes
refits while a call is in flight (:attr:`EngineWorker.inflight_refit`) gets its refit-side
calls on a thread of their own.

Weight versions (:mod:`rlcore.handles`): the workers label the weights of the refit of
step ``t`` ``step-<t>`` in their engines (vLLM's and SGLang's ``weight_version``);
:func:`label_version` reads a label back, :func:`versions_from_spans` an engine's spans of
labels as one version per token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from rlcore.handles import Endpoint, Pair, Sample, SamplingParams
from rlcore.runtime.adapter_files import AdapterDirs
from rlcore.runtime.addresses import free_port, server_host
from rlcore.runtime.batches import shard_range
from rlcore.runtime.group_handle import GroupHandle
from rlcore.runtime.worker_group import DistributedWorker, WorkerGroup

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from rlcore.context import InitContext
    from rlcore.errors import Deadline

log = logging.getLogger(__name__)


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of prompt ``index`` of a call made with ``seed``.

    Engines seed the ``j``-th sample of a request ``seed + j``, so consecutive
    per-prompt seeds (``seed + index``) would make prompt 0's second sample and
    prompt 1's first share a random stream. A 48-bit hash keeps every
    (call, prompt, sample) stream distinct, and does not depend on how the
    prompts are split across engines.
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


#: The label the workers give the weights of the refit of step ``t``: ``step-<t>``.
_LABEL = re.compile(r"step-(\d+)")


def label_version(label: str) -> int:
    """The weight version an engine's label names: ``t`` for ``step-<t>``; any other label
    is the one the engine started with, before rlcore's first refit labelled its weights
    (vLLM and SGLang say ``default``): version 0."""
    m = _LABEL.fullmatch(str(label))
    return int(m.group(1)) if m else 0


def versions_from_spans(spans: Iterable[tuple[str, int, int]], n_tokens: int) -> list[int] | None:
    """One version per token from an engine's ``(label, start, end)`` spans over a sample's
    tokens (``[start, end)`` sampled by the weights labelled ``label``); None when the spans
    do not cover the ``n_tokens`` tokens exactly once, in order (the engine could not tell)."""
    out: list[int] = []
    for label, start, end in spans:
        if start != len(out) or end < start:
            return None
        out += [label_version(label)] * (end - start)
    return out if len(out) == n_tokens else None


class GroupGeneration(GroupHandle):
    """A base for generation handles (see the module doc); its lifecycle is
    :class:`rlcore.runtime.group_handle.GroupHandle`'s.

    Args:
        group: the worker group, one engine per worker.
        specs: the ``TensorSpec`` list the engines expect.
        backend: the backend's name (in errors).
        endpoints: each engine's OpenAI-compatible endpoint (none without servers).
        start_info: each worker's start record (timings in seconds).
        device_type: ``cuda`` or ``cpu``.

    Attributes:
        refit_ranks: the number of engines; engine ``i`` is rank ``1 + i`` of refit channels.
    """

    refit_ranks: int
    _specs: list[Any]

    def __init__(
        self,
        group: Any,
        specs: Sequence[Any],
        *,
        backend: str,
        endpoints: Sequence[Endpoint] = (),
        start_info: Sequence[dict[str, Any]] = (),
        device_type: str = "cpu",
    ) -> None:
        super().__init__(group, backend=backend, role="generation")
        self.refit_ranks = group.world_size
        self.endpoints = list(endpoints)
        self.start_info = list(start_info)
        self.device_type = device_type
        self._specs = list(specs)

    @property
    def endpoint(self) -> Endpoint | None:
        """Engine 0's OpenAI-compatible endpoint, else None (engines without a server).

        Each engine serves its own; spread load over :attr:`endpoints` if needed.
        """
        return self.endpoints[0] if self.endpoints else None

    # ------------------------------------------------------------ refit side

    def weight_specs(self) -> list[Any]:
        """``TensorSpec`` of every weight the engines expect (Hugging Face names)."""
        return list(self._specs)

    def open_refit_channel(self, spec: Any) -> list[Any]:
        """Every engine joins channel ``spec`` (engine ``i`` as rank ``1 + i``); Ray refs."""
        return [self.refit_side(a, "open_refit_channel").remote(spec, 1 + i) for i, a in enumerate(self._actors())]

    def refit_ceiling(self, spec: Any, step: int, nbytes: int) -> list[Any]:
        """Every engine receives ``nbytes`` raw over the channel (``bench/``); Ray refs."""
        return [
            self.refit_side(a, "refit_ceiling").remote(spec, 1 + i, step, nbytes) for i, a in enumerate(self._actors())
        ]

    def receive_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> list[Any]:
        """Every engine receives and loads the buckets; Ray refs that resolve when all have loaded.

        An engine that takes refits in flight (:attr:`EngineWorker.inflight_refit`) loads
        beside a generate or logprobs call it is running; any other waits for it to end."""
        return [self.refit_side(a, "receive_weights").remote(spec, step, buckets) for a in self._actors()]

    def load_adapter(self, tensors: Any, config: dict[str, Any], step: int) -> list[Any]:
        """Every engine serves the LoRA adapter ``tensors`` from now on, as the weights of
        ``step`` (:class:`rlcore.handles.AdapterReceiver`: refit content ``adapters``); Ray
        refs. A refit-side call, as :meth:`receive_weights`."""
        return [self.refit_side(a, "load_adapter").remote(tensors, config, step) for a in self._actors()]

    def refit_side(self, actor: Any, method: str) -> Any:
        """``actor``'s ``method`` as a refit-side call: on the engines' refit thread
        (:attr:`rlcore.runtime.worker_group.WorkerGroup.refit_group`) when they take refits in
        flight, so it does not queue behind a running generate; else the plain method."""
        call = getattr(actor, method)
        group = self.group.refit_group
        return call.options(concurrency_group=group) if group is not None else call

    def weight_versions(self) -> list[int]:
        """The weight version each engine holds, as it reports it
        (:class:`rlcore.handles.WeightVersioned`): 0 before any refit, ``t`` after refit ``t``.
        A refit-side call (:meth:`refit_side`): the check after a refit does not wait for a
        generate in flight."""
        self._check_open()
        refs = [self.refit_side(a, "weight_version").remote() for a in self._actors()]
        return [int(v) for v in self.group.get(refs, what="weight versions")]

    # -------------------------------------------------------- training loop

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Sample]]:
        """``params.n`` samples per prompt (:class:`rlcore.handles.GenerationHandle`).

        Prompts are split into contiguous shards over the engines; prompt ``i``
        samples with seed :func:`prompt_seed` ``(params.seed, i)``, so results do not
        depend on the number of engines.
        """
        seeds = [prompt_seed(params.seed, i) for i in range(len(prompt_ids))]
        shards = self._shards(len(prompt_ids))
        refs = [
            actor.generate.remote([list(p) for p in prompt_ids[a:b]], params, seeds[a:b])
            for _, actor, (a, b) in shards
        ]
        parts = self.group.get(refs, what="generate", ranks=[r for r, _, _ in shards])
        return [group for part in parts for group in part]

    def logprobs(self, batch: Sequence[Pair]) -> list[list[float]]:
        """Per-token log-probabilities of each ``(prompt_ids, completion_ids)`` pair's completion."""
        shards = self._shards(len(batch))
        refs = [actor.logprobs.remote([(list(p), list(c)) for p, c in batch[a:b]]) for _, actor, (a, b) in shards]
        parts = self.group.get(refs, what="logprobs", ranks=[r for r, _, _ in shards])
        return [row for part in parts for row in part]

    # ------------------------------------------------------- one engine again

    def replace_engine(self, rank: int, deadline: Deadline | None = None) -> EngineReceiver:
        """Start engine ``rank`` again, alone, after it was lost or hung: its old process is
        killed, a new worker is built and started as at setup (bounded by the group's call
        timeout), its endpoint updated; the other engines keep running and serving.

        Returns the :class:`EngineReceiver` of that engine, for its first refit: it serves
        the policy's weights only after one (a refit-fed engine has none before). The core
        calls this under ``generation.on_worker_loss: replace`` (:mod:`rlcore.app.recovery`).
        """
        self._check_open()
        what = f"starting {self.group.name} rank {rank} again"
        self.group.restart_rank(rank, deadline=deadline)
        info = self.group.call("start", self.group.timeout_s, ranks=[rank], what=what, deadline=deadline)[0]
        if rank < len(self.start_info):
            self.start_info[rank] = info
        if self.endpoints:
            e = self.group.call("endpoint_info", ranks=[rank], what="endpoint", deadline=deadline)[0]
            self.endpoints[rank] = Endpoint(base_url=e["base_url"], model=e["model"], api_key=e["api_key"])
        return EngineReceiver(self, [rank])

    # ------------------------------------------------------------ helpers

    def _shards(self, count: int) -> list[tuple[int, Any, tuple[int, int]]]:
        """(rank, engine, [start, end)) of each non-empty contiguous shard of ``count`` items."""
        actors = self._actors()
        bounds = [shard_range(count, len(actors), i) for i in range(len(actors))]
        return [(r, a, (s, e)) for r, (a, (s, e)) in enumerate(zip(actors, bounds, strict=True)) if e > s]

    def _actors(self) -> list[Any]:
        self._check_open()
        return self.group.actors


class EngineReceiver:
    """Some engines of a :class:`GroupGeneration` as a :class:`rlcore.handles.RefitReceiver`
    of their own: a refit to it opens a channel of ``1 + len(engine_ranks)`` ranks and
    loads the weights into those engines only (an engine started again while the others
    keep their weights). ``engine_ranks`` name the engines in errors."""

    def __init__(self, handle: GroupGeneration, engine_ranks: Sequence[int]) -> None:
        self.handle = handle
        self.group = handle.group
        self.engine_ranks = list(engine_ranks)
        self.refit_ranks = len(self.engine_ranks)

    def weight_specs(self) -> list[Any]:
        return self.handle.weight_specs()

    def _engines(self) -> list[Any]:
        actors = self.handle._actors()
        return [actors[r] for r in self.engine_ranks]

    def open_refit_channel(self, spec: Any) -> list[Any]:
        side = self.handle.refit_side
        return [side(a, "open_refit_channel").remote(spec, 1 + i) for i, a in enumerate(self._engines())]

    def receive_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> list[Any]:
        return [self.handle.refit_side(a, "receive_weights").remote(spec, step, buckets) for a in self._engines()]

    def load_adapter(self, tensors: Any, config: dict[str, Any], step: int) -> list[Any]:
        return [self.handle.refit_side(a, "load_adapter").remote(tensors, config, step) for a in self._engines()]


@dataclass(frozen=True)
class EngineArgs:
    """What each engine of a group is built from (:class:`EngineWorker`'s arguments).

    Attributes:
        model_dir: Hugging Face checkpoint directory.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        refit_fed: start with dummy weights; the first refit brings real ones.
        adapters: the :class:`rlcore.lora.LoraOptions` of the adapters every refit brings
            (:attr:`rlcore.context.InitContext.adapters`): the engine starts from the
            checkpoint's base weights able to serve them; None: refits bring weights.
        options: the backend's options (``port``, ``served_model_name`` where it serves).
        log_dir: where the engine's server writes its log.
        seed: the engine's seed.
        network: the run's :class:`rlcore.config.placement.Network`: where a server binds, its token.
        cuda: whether the engine runs on a GPU, as the handle decided from the cluster (Ray
            then gives the actor one); None (a worker built directly, a test) asks torch.
        specs_cache: the run's cache directory, where
            :class:`rlcore.refit.worker.HFWeightSpecs` keeps the weight specs between runs;
            None: worked out every time.
    """

    model_dir: str
    dtype: str
    refit_fed: bool
    options: Any
    log_dir: str | None = None
    seed: int = 0
    network: Any = None
    cuda: bool | None = None
    specs_cache: str | None = None
    adapters: Any = None


@dataclass(frozen=True)
class PauseRoutes:
    """How an engine's server holds its requests in flight while a refit loads
    (:meth:`EngineWorker._held_for_refit`): each a ``(route, JSON body)`` POSTed to it, a
    body of None sent as ``{}``.

    Attributes:
        pause: stop scheduling and keep the requests, their KV cache freed (it was
            computed with the old weights; it is recomputed with the new ones once resumed).
        resume: schedule them again.
        abort: end every request of the server (a load failed half-way: none may go on).
    """

    pause: tuple[str, dict[str, Any] | None]
    resume: tuple[str, dict[str, Any] | None]
    abort: tuple[str, dict[str, Any] | None]


@dataclass(frozen=True)
class Engines:
    """The engines a backend's init hook starts with :func:`start_engines`.

    Attributes:
        worker_class: the :class:`EngineWorker` subclass, one per engine.
        name: the worker group's name.
        model_dir: Hugging Face checkpoint directory.
        options: the backend's options (``server_start_timeout_s``, ``call_timeout_s``).
        cuda: one GPU per engine, else ``generation.devices_per_worker`` CPUs.
        env: the workers' environment variables.
        what: names the start in errors (``starting vLLM servers``).
        endpoints: whether the engines serve (then each one's endpoint is read).
        log_dir: where the engines' servers write their logs.
        extra: further keyword arguments of ``worker_class``.
    """

    worker_class: type
    name: str
    model_dir: Path
    options: Any
    cuda: bool
    env: dict[str, str]
    what: str
    endpoints: bool = True
    log_dir: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def start_engines(
    ctx: InitContext, engines: Engines
) -> tuple[WorkerGroup, list[dict[str, Any]], list[Any], list[Endpoint]]:
    """Start the ``generation.workers`` engines of the init hook of ``ctx``.

    Worker ``i`` is ``engines.worker_class(i, workers, EngineArgs(...), **engines.extra)``,
    its :class:`EngineArgs` from ``engines`` and the run (dtype, refit-fed, network, cache),
    on one GPU (``cuda``) or on ``generation.devices_per_worker`` CPUs, with ``env``; then
    every worker's ``start(timeout_s)`` runs, bounded by ``options.server_start_timeout_s``
    and the deadline, and each call by ``options.call_timeout_s``.

    Returns the group, each worker's start record, engine 0's ``weight_specs()``
    (:class:`rlcore.refit.worker.HFWeightSpecs` gives a worker one) and,
    with ``endpoints``, each engine's :class:`rlcore.handles.Endpoint` (its
    ``endpoint_info()``). Shuts the group down if any of that fails.
    """
    group = _engine_group(ctx, engines)
    try:
        remaining = ctx.deadline.remaining()
        limit = engines.options.server_start_timeout_s
        info = group.call(
            "start", limit if remaining is None else min(limit, remaining), what=engines.what, deadline=ctx.deadline
        )
        specs = group.call("weight_specs", ranks=[0], what="weight specs", deadline=ctx.deadline)[0]
        served = []
        if engines.endpoints:
            served = [
                Endpoint(base_url=e["base_url"], model=e["model"], api_key=e["api_key"])
                for e in group.call("endpoint_info", what="endpoints", deadline=ctx.deadline)
            ]
    except BaseException:
        group.shutdown()
        raise
    return group, info, specs, served


def _engine_group(ctx: InitContext, engines: Engines) -> WorkerGroup:
    """The worker group of ``engines`` (built, not started)."""
    section, cuda = ctx.config.generation, engines.cuda
    args = EngineArgs(
        str(engines.model_dir),
        dtype=ctx.config.model.dtype,
        # Adapters apply on top of the base weights, which no adapter refit brings.
        refit_fed=bool(section.refit_fed) and ctx.adapters is None,
        options=engines.options,
        log_dir=engines.log_dir,
        network=ctx.network,
        cuda=cuda,
        specs_cache=str(ctx.cache_dir),
        adapters=ctx.adapters,
    )
    return WorkerGroup(
        engines.worker_class,
        section.workers,
        name=engines.name,
        args=(args,),
        kwargs=dict(engines.extra),
        num_cpus=1.0 if cuda else float(section.devices_per_worker),
        num_gpus=float(section.devices_per_worker) if cuda else 0.0,
        env=engines.env,
        dist_backend=None,
        timeout_s=engines.options.call_timeout_s,
        cancel=ctx.cancel,
        deadline=ctx.deadline,
        placement=ctx.placement,
    )


def _copy(sample: Sample) -> Sample:
    """A sample whose lists are its own (copies of one greedy sample must not share them)."""
    return {k: list(v) for k, v in sample.items()}  # type: ignore[return-value]


class EngineWorker(DistributedWorker):
    """A base for the workers of :class:`GroupGeneration`: one engine each (a Ray actor).

    :meth:`generate` and :meth:`logprobs` check the call, and refuse while :attr:`stale`
    says why the weights cannot be trusted (a refit failed half-way), before the
    subclass's ``_generate`` and ``_logprobs`` run; a greedy call (temperature 0) samples
    once per prompt and copies it ``n`` times. A subclass's ``receive_weights`` of step
    ``t`` sets :attr:`loaded_version` to ``t`` when it succeeds; a sample whose engine
    reported no weight versions gets that counter's value at the call's start. A
    subclass names its engine in ``engine`` (``vLLM``: errors say ``vLLM worker 0``); a
    server it starts is :attr:`server` (a :class:`rlcore.runtime.server.GuardedServer`),
    through which :mod:`rlcore.runtime.engine_http` runs its calls given the engine's
    HTTP API.

    Args:
        rank, world_size: this worker's index and the number of engines.
        args: what the engine is built from (:class:`EngineArgs`); each of its fields is
            also an attribute of the worker (``self.model_dir``, ``self.options``...).
    """

    engine = "engine"
    #: Whether this engine takes a refit while a generate or logprobs call is in flight:
    #: its actors then get a refit thread
    #: (:attr:`rlcore.runtime.worker_group.WorkerGroup.refit_group`), where
    #: :class:`GroupGeneration` sends ``open_refit_channel``, ``receive_weights`` and
    #: ``refit_ceiling``. Such a class's ``receive_weights`` holds the engine's requests
    #: for the load itself (a server's own pause: :meth:`_held_for_refit`), and nothing
    #: else it touches may race with ``generate``. False: a refit waits for the call in
    #: flight to end (the actor runs one call at a time).
    inflight_refit: ClassVar[bool] = False

    def __init__(self, rank: int, world_size: int, args: EngineArgs) -> None:
        super().__init__(rank, world_size)
        self.args = args
        self.model_dir = args.model_dir
        self.dtype = args.dtype
        self.refit_fed = args.refit_fed
        self.options = args.options
        self.log_dir = args.log_dir
        self.seed = args.seed
        self.network = args.network
        self.cuda = args.cuda
        self.specs_cache = args.specs_cache
        self.adapters = args.adapters
        #: Where adapter refits are written for the engine to load (:meth:`load_adapter`).
        self.adapter_dirs = AdapterDirs(prefix=f"rlcore-adapter-{rank}-")
        self.server: Any = None
        #: Why the engine's weights cannot be trusted (a refit failed half-way), or None.
        self.stale: str | None = None
        #: Refits that failed half-way while requests were held, and aborted them: a call
        #: in flight across one fails instead of returning cut samples.
        self.refit_aborts = 0
        #: The step of the last refit that succeeded (0 before any): the weights' version.
        self.loaded_version = 0

    def _on_cuda(self) -> bool:
        """Whether this engine runs on a GPU: :attr:`cuda` as the handle decided, else torch's
        answer. An actor whose engine is a server never needs torch itself: importing it
        before the launch would take seconds of the cores the server starts on."""
        if self.cuda is not None:
            return self.cuda
        import torch

        return bool(torch.cuda.is_available())

    # ------------------------------------------------------------- inference

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[list[Sample]]:
        """``params.n`` samples per prompt: ``[[{"token_ids": [...], "logprobs": [...]}] * n] *
        len(prompts)``; prompt ``i`` samples with seed ``seeds[i]`` (see the subclass's
        ``_generate``)."""
        self._check_weights()
        if len(seeds) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(seeds)} seeds")
        if not prompt_ids:
            return []
        # Exact while this actor runs one call at a time (a refit waits for the call); were
        # a refit to land during it, the version at its start is the conservative one.
        version = self.loaded_version
        if params.temperature <= 0 and params.n > 1:
            # Every greedy sample is the same one (and vLLM refuses n > 1 greedy): sample once.
            with self._not_cut_by_refit():
                groups = self._generate(prompt_ids, dataclasses.replace(params, n=1), seeds)
            groups = [[_copy(g[0]) for _ in range(params.n)] for g in groups]
        else:
            with self._not_cut_by_refit():
                groups = self._generate(prompt_ids, params, seeds)
        for group in groups:
            for sample in group:
                sample.setdefault("versions", [version] * len(sample["token_ids"]))
        return groups

    def weight_version(self) -> int:
        """The version of the weights this engine holds: :attr:`loaded_version` (an engine
        that can ask its own engine overrides this)."""
        return self.loaded_version

    def logprobs(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """Log-probabilities of each completion's tokens given its prompt (and the tokens before)."""
        self._check_weights()
        if not batch:
            return []
        with self._not_cut_by_refit():
            return self._logprobs(batch)

    def _generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[list[Sample]]:
        raise NotImplementedError

    def _logprobs(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        raise NotImplementedError

    def _check_weights(self) -> None:
        if self.stale is not None:
            raise RuntimeError(
                f"{self.engine} worker {self.rank}: {self.stale}; its weights may mix two versions, "
                "so it refuses to generate until a refit succeeds"
            )

    @contextlib.contextmanager
    def _not_cut_by_refit(self) -> Iterator[None]:
        """Fail the call if a refit aborted its requests meanwhile (:meth:`_held_for_refit`):
        an engine answers an aborted request with the tokens it had, which are no sample."""
        aborts = self.refit_aborts
        yield
        if self.refit_aborts != aborts:
            raise RuntimeError(
                f"{self.engine} worker {self.rank}: a refit failed half-way during this call and "
                f"aborted its requests ({self.stale})"
            )

    # ----------------------------------------------------------------- refit

    def load_adapter(self, tensors: dict[str, Any], config: dict[str, Any], step: int) -> float:
        """Serve the LoRA adapter ``tensors`` (by peft's names) with peft's adapter ``config``
        as the weights of ``step`` (refit content ``adapters``); returns seconds taken.

        Written as a peft directory (:class:`rlcore.runtime.adapter_files.AdapterDirs`),
        then loaded by the subclass's ``_load_adapter(path, step)``, which makes its engine
        serve it from the next token on. A failure leaves the engine refusing to sample
        until a refit succeeds, as a weight refit's does.
        """
        if self.adapters is None:
            raise RuntimeError(
                f"{self.engine} worker {self.rank} was started without adapters (EngineArgs.adapters), "
                f"so it cannot serve the adapter refit of step {step}"
            )
        t0 = time.monotonic()
        path = self.adapter_dirs.write(step, tensors, config)
        self.stale = f"adapter refit step {step} did not complete"
        self._load_adapter(path, step)
        self.stale = None
        self.loaded_version = step
        self.adapter_dirs.keep_only(path)
        return time.monotonic() - t0

    def _load_adapter(self, path: Path, step: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not serve adapters (no _load_adapter)")

    @contextlib.contextmanager
    def _held_for_refit(self, routes: PauseRoutes, step: int, timeout_s: float) -> Iterator[None]:
        """Hold :attr:`server`'s requests in flight while the body loads refit ``step``
        (for an :attr:`inflight_refit` engine): pause them, and resume them afterwards
        whatever happened, while the server lives; each request waits at most ``timeout_s``.

        When the body fails with :attr:`stale` set (the weights may be half-loaded), the
        held requests are aborted before the resume, so no sample mixes two versions, and
        the calls they belong to fail (:attr:`refit_aborts`); the error propagates. A
        resume that fails marks the engine stale (it would hold requests forever), and
        raises :class:`rlcore.errors.RefitError` unless the body failed already.
        """
        from rlcore.errors import RefitError
        from rlcore.runtime.server import ServerError

        s = self.server
        t0 = time.monotonic()
        loaded = False
        try:
            s.post(*routes.pause, timeout_s=timeout_s)
            yield
            loaded = True
        except BaseException:
            if self.stale is not None and s.alive():
                self.refit_aborts += 1  # before the abort: a call it ends must see it
                try:
                    s.post(*routes.abort, timeout_s=timeout_s)
                except ServerError as err:
                    log.warning("%s worker %d: aborting held requests failed: %s", self.engine, self.rank, err)
            raise
        finally:
            if s.alive():
                try:
                    s.post(*routes.resume, timeout_s=timeout_s)
                except ServerError as err:
                    self.stale = f"generation was not resumed after refit step {step}: {err}"
                    if loaded:
                        raise RefitError(f"{self.engine} worker {self.rank}: {self.stale}") from None
            log.debug("%s worker %d: requests held %.3fs for refit step %d", self.engine, self.rank, time.monotonic() - t0, step)

    def _bind(self) -> dict[str, Any]:
        """``port``, ``host`` and ``token`` of this engine's server: ``options.port + rank``
        (a free port when the option is 0), the address and token of the run's network."""
        port = self.options.port
        return {
            "port": port + self.rank if port else free_port(),
            "host": server_host(self.network),
            "token": self.network.token if self.network is not None else None,
        }

    def _endpoint_info(self) -> dict[str, Any]:
        """``{"base_url", "model", "api_key", "pid", "pgid"}`` of :attr:`server`."""
        s = self.server
        return {
            "base_url": s.base + "/v1",
            "model": self.options.served_model_name,
            "api_key": s.token or "EMPTY",
            "pid": s.proc.pid,
            "pgid": s.pgid,
        }

    def _stop_server(self) -> None:
        """Stop :attr:`server`'s process group, if one runs, and remove the adapter
        directories it read. Idempotent."""
        self.adapter_dirs.remove()
        if self.server is not None:
            self.server.stop()
            self.server = None
