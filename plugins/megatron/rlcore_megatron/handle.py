"""Driver-side handles of the Megatron backend, and the bodies of its init hooks.

:func:`start_policy` and :func:`start_generation` are what ``rlcore_init_policy``
and ``rlcore_init_generation`` run (in the driver, inside the setup tasks
``init:policy`` and ``init:generation``). They start Ray worker groups of
:mod:`rlcore_megatron.worker` classes and return :class:`MegatronPolicy` /
:class:`MegatronGeneration`, which implement :class:`rlcore.handles.RefitSender`
and :class:`rlcore.handles.RefitReceiver` and the calls of the training loop.

Setup overlap, as declared:

* The policy **publishes** the converted checkpoint (``megatron.checkpoint``,
  keyed by :func:`rlcore_megatron.checkpoint.checkpoint_key` of the model and the
  policy's options) through the core's ``rlcore_publish`` hook, but only when a
  reader of the run needs it (``ctx.artifact_needed``: the plan; a refit-fed
  Megatron generation does not). The
  conversion runs in its own processes, at the same time as the policy's workers
  start and load the Hugging Face checkpoint directly.
* A generation that loads the checkpoint starts at once: it starts its workers
  and builds model and engine, then waits inside its init
  (``ctx.wait_artifact``, cancellable, with the task's deadline) and loads it.
* A refit-fed generation builds the model from the Hugging Face config alone and
  serves after ``refit:initial``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.context import InitContext
from rlcore.errors import CancelToken, CheckpointError, ConfigError, WorkerError
from rlcore.handles import Endpoint, SamplingParams
from rlcore.refit.specs import TensorSpec
from rlcore.runtime.batches import put_rows
from rlcore.runtime.group_handle import GroupHandle
from rlcore.runtime.policy_group import GroupPolicy
from rlcore.runtime.resources import device_resources, require_ray, resolve_worker_device
from rlcore.runtime.worker_group import WorkerGroup
from rlcore_megatron.options import (
    CHECKPOINT_ARTIFACT,
    MegatronOptions,
    check_inflight_refit,
    resolve_engine,
)

log = logging.getLogger(__name__)

POLICY_GROUP = "megatron-policy"
GENERATION_GROUP = "megatron-generation"
BACKEND = "megatron"


def _options(raw: Any, section: str = "policy") -> MegatronOptions:
    if isinstance(raw, MegatronOptions):
        return raw
    from rlcore.config import resolve_options

    return resolve_options(dict(raw or {}), MegatronOptions, section=section, backend=BACKEND)


def _group_kwargs(
    section: Any, options: MegatronOptions, device: str, ctx: InitContext
) -> dict[str, Any]:
    """Resources, environment and process-group backend of a worker group."""
    resources, threads = device_resources(
        device, section.devices_per_worker, options.threads_per_worker
    )
    return {
        **resources,
        # megatron-core's noise is silenced by the workers themselves (worker.quiet_process).
        "env": {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"},
        "timeout_s": options.timeout_s,
        "cancel": ctx.cancel,
        "deadline": ctx.deadline,
        "placement": ctx.placement,
    }


def _check_tp(spec: Any, workers: int, options: MegatronOptions, section: str) -> None:
    tp = int(options.tensor_model_parallel_size)
    if tp < 1 or workers % tp:
        raise ConfigError(
            f"{section}.workers = {workers} is not a multiple of "
            f"{section}.options.tensor_model_parallel_size = {tp}",
            key=f"{section}.workers",
        )
    from rlcore_megatron.convert import ConversionError

    try:
        spec.check_tp(tp)
    except ConversionError as err:
        raise ConfigError(
            f"{section}.options.tensor_model_parallel_size: {err}",
            key=f"{section}.options.tensor_model_parallel_size",
        ) from err


def _check_go(ctx: InitContext) -> None:
    """Raise before starting workers when setup was cancelled or the deadline passed."""
    ctx.cancel.raise_if_cancelled(ctx.task)
    ctx.deadline.raise_if_expired(ctx.task)


class _Handle(GroupHandle):
    """What both handles share: the group's layout, ordered submission, memory handoff
    (lifecycle: :class:`GroupHandle`)."""

    kind = "megatron"

    def __init__(
        self,
        group: WorkerGroup,
        *,
        device_type: str,
        specs: Sequence[TensorSpec],
        layout: Sequence[dict[str, Any]],
        info: dict[str, Any] | None = None,
    ) -> None:
        GroupHandle.__init__(self, group, backend="megatron", role=self.kind)
        self.device_type = device_type
        self._specs = list(specs)
        self.layout = [dict(x) for x in layout]
        self.info = dict(info or {})
        # The rank that answers for each data-parallel replica: its tensor-parallel rank 0.
        leads = sorted((x["dp_rank"], x["rank"]) for x in self.layout if x["tp_rank"] == 0)
        self._leads = [rank for _, rank in leads]
        self._submit_lock = threading.Lock()
        #: ``placement.colocated``: the loop hands GPU memory over with :meth:`sleep` / :meth:`wake`.
        self.colocated = bool(self.info.get("colocated", False))

    def _replicas(self, parts: Sequence[Sequence[Any]]) -> list[Any]:
        """Concatenate per-rank shard results, one per data-parallel replica, in order."""
        return [row for rank in self._leads for row in parts[rank]]

    def _submit(self, method: str, *args: Any, per_rank: Any = None, refit_side: bool = False) -> list[Any]:
        """Submit ``method`` to every rank in one step; Ray refs.

        Tensor-parallel ranks must run the same calls in the same order, and Ray
        runs one submitting process's calls to an actor in submission order: the
        lock keeps calls made from several threads of this process (the training
        loop, an endpoint) in one order on every rank. ``per_rank(i)`` gives extra
        leading arguments for rank ``i``. ``refit_side``: on the ranks' refit thread
        where they take refits in flight (``WorkerGroup.refit_group``: tensor-parallel
        size 1, so no order across ranks is needed), so it does not wait for a call.
        """
        self._check_open()
        group = self.group.refit_group if refit_side else None
        with self._submit_lock:
            return [
                _on(getattr(a, method), group).remote(*(per_rank(i) if per_rank else ()), *args)
                for i, a in enumerate(self.group.actors)
            ]

    def weight_specs(self) -> list[TensorSpec]:
        """Every weight under its Hugging Face name, full shape and dtype, in the refit's
        order: from the model's config (:func:`rlcore_megatron.convert.tensor_specs`),
        no weight touched."""
        self._check_open()
        return list(self._specs)

    def logprobs(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """Per-token logprobs of each ``(prompt_ids, completion_ids)`` row's completion;
        rows split over the replicas."""
        refs = self._submit("logprobs", put_rows(batch))
        return self._replicas(self.group.get(refs, what="logprobs"))

    def sleep(self) -> dict[str, float]:
        """Colocated placement: give back the GPU memory the other role needs while this
        one waits (policy: optimizer state to host memory; generation: KV cache and engine
        buffers released). Weights stay, so refit and logprobs work asleep; ``train_step``
        and ``generate`` wake a sleeping role themselves. Returns ``bytes`` (all ranks) and
        ``seconds`` (slowest rank)."""
        return self._handoff("sleep")

    def wake(self) -> dict[str, float]:
        """Take back what :meth:`sleep` gave (same report)."""
        return self._handoff("wake")

    def _handoff(self, method: str) -> dict[str, float]:
        parts = self.group.get(self._submit(method), what=f"{self.kind} {method}")
        return {
            "bytes": float(sum(p["bytes"] for p in parts)),
            "seconds": max((p["seconds"] for p in parts), default=0.0),
        }


class MegatronPolicy(GroupPolicy, _Handle):
    """A started Megatron policy: ``workers`` :class:`~rlcore_megatron.worker.MegatronPolicyWorker`
    ranks (tensor parallel ``options.tensor_model_parallel_size``, the rest data parallel).

    Implements :class:`rlcore.handles.RefitSender` (rank 0 sends; the ranks of
    replica 0 gather in lockstep) and the policy side of :func:`rlcore.app.grpo.run_grpo`.
    Every call waits through :meth:`rlcore.runtime.worker_group.WorkerGroup.call` (cancellation,
    a deadline of ``options.timeout_s``, the failing rank named).

    Attributes:
        device_type: ``cpu`` or ``cuda`` (gloo or NCCL for collective refit).
        info: init timings (seconds): ``init_s``, ``group_start_s``, ``build_s``,
            ``load_s``, ``convert_s`` (0 when no checkpoint was published); the
            published ``checkpoint`` and ``checkpoint_published_at`` (``time.monotonic()``).
    """

    kind = "policy"

    # refit_address, open_refit_channel, refit_ceiling, send_weights and train_step:
    # rlcore.runtime.policy_group.GroupPolicy; weight_specs and logprobs: _Handle.

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str) -> None:
        """Every rank writes its part of a training checkpoint into ``directory``
        (:class:`rlcore.handles.Checkpointable`; format: :mod:`rlcore_megatron.train_state`).
        Reads the policy's state only, so the core may run it beside the generation."""
        t0 = time.monotonic()
        parts = self.group.get(self._submit("save_train_state", directory), what="saving a training checkpoint")
        log.info(
            "megatron policy: training checkpoint written to %s in %.2fs (%s)",
            directory,
            time.monotonic() - t0,
            _size(Path(directory), parts),
        )

    def load_checkpoint(self, directory: str) -> None:
        """Every rank restores its training state from ``directory``
        (:class:`rlcore.handles.Checkpointable`). A checkpoint it cannot take raises
        :class:`rlcore.errors.CheckpointError`: its record is checked here first, the
        model and layout on the ranks, before anything is loaded."""
        from rlcore_megatron import train_state

        train_state.read_meta(directory)
        t0 = time.monotonic()
        try:
            parts = self.group.get(
                self._submit("load_train_state", directory), what="loading a training checkpoint"
            )
        except WorkerError as err:
            refused = _cause(err, CheckpointError)
            if refused is None:
                raise
            raise CheckpointError(f"megatron policy: {refused}") from err
        log.info(
            "megatron policy: training checkpoint %s loaded in %.2fs%s",
            directory,
            time.monotonic() - t0,
            " (resharded to this layout)" if parts[0].get("resharded") else "",
        )


def _size(root: Path, parts: Sequence[dict[str, float]]) -> str:
    try:
        total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    except OSError:
        total = int(sum(p["bytes"] for p in parts))
    return f"{total / 2**20:.1f} MiB, slowest rank {max(p['seconds'] for p in parts):.2f}s"


def _cause(err: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first ``kind`` in ``err``'s chain of causes (a worker's error arrives wrapped by
    Ray and :class:`rlcore.errors.WorkerError`)."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return e
        seen.add(id(e))
        # Ray's RayTaskError keeps the worker's exception as ``cause``
        e = e.__cause__ or getattr(e, "cause", None) or e.__context__
    return None


class MegatronGeneration(_Handle):
    """A started Megatron generation engine: ``workers`` :class:`~rlcore_megatron.worker.MegatronGenerationWorker`
    ranks running megatron-core's inference engine (static on CPU, dynamic on CUDA; tensor parallel
    ``options.tensor_model_parallel_size``, the rest independent replicas).

    Implements :class:`rlcore.handles.RefitReceiver` (every rank is a receiver:
    rank ``i`` is refit channel rank ``1 + i`` and loads its own slices) and the
    generation side of :func:`rlcore.app.grpo.run_grpo`. With ``serve_openai`` it also
    serves an OpenAI-compatible endpoint (:mod:`rlcore.serve.openai_endpoint`, in this
    process, from its own thread) over :meth:`generate`; ``endpoint`` says where
    (else None). Calls to the ranks go through ``_submit``, so requests the endpoint
    serves and the refits of the training loop reach every rank in one order.

    ``info``: ``init_s``, ``group_start_s``, ``start_s`` (model and engine),
    ``refit_fed``; loading the checkpoint: ``checkpoint``, ``checkpoint_wait_s``
    (inside the init, after the engine was built), ``checkpoint_load_s``, and
    ``started_at`` / ``checkpoint_at`` (``time.monotonic()`` of the init's start and
    of the checkpoint's arrival).
    """

    kind = "generation"
    #: The OpenAI-compatible endpoint (``serve_openai``), started by :func:`start_generation`.
    server: Any = None

    @property
    def refit_ranks(self) -> int:
        """Every rank receives (rank ``i`` is refit channel rank ``1 + i``)."""
        return int(self.group.world_size)

    @property
    def endpoint(self) -> Endpoint | None:
        """Where the OpenAI-compatible endpoint listens (``serve_openai``), else None."""
        return None if self.server is None else self.server.endpoint

    # ------------------------------------------------------------ refit receiver

    def open_refit_channel(self, spec: Any) -> list[Any]:
        """Rank ``i`` joins ``spec`` as channel rank ``1 + i``; Ray refs."""
        return self._submit("open_refit_channel", per_rank=lambda i: (spec, 1 + i), refit_side=True)

    def refit_ceiling(self, spec: Any, step: int, nbytes: int) -> list[Any]:
        """Every rank receives ``nbytes`` raw over the channel (bench); Ray refs."""
        return self._submit("refit_ceiling", spec, step, nbytes, refit_side=True)

    def receive_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> list[Any]:
        """Every rank receives and loads the buckets; Ray refs. Ranks that take refits in
        flight (:class:`~rlcore_megatron.worker.MegatronInflightGenerationWorker`) load
        between two engine steps of a generate in flight; others after it."""
        import ray

        return self._submit("receive_weights", spec, step, ray.put(buckets), refit_side=True)

    # ------------------------------------------------------------ training loop

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[dict[str, list]]]:
        """``params.n`` samples per prompt, each ``{"token_ids": [...], "logprobs": [...],
        "versions": [...]}`` (the weight version of each token).

        Prompts are split over the replicas in contiguous slices; each replica
        seeds its sampler from ``(params.seed, replica)``.
        """
        import ray

        prompts = ray.put([list(map(int, p)) for p in prompt_ids])
        refs = self._submit("generate", prompts, params)
        return self._replicas(self.group.get(refs, what="generate"))

    def weight_versions(self) -> list[int]:
        """The weight version each engine (data-parallel replica) serves
        (:class:`rlcore.handles.WeightVersioned`): 0 before any refit, ``t`` after refit ``t``.
        Submitted in order with the refits, so it answers for the last one submitted."""
        parts = self.group.get(self._submit("weight_version", refit_side=True), what="weight versions")
        return [int(parts[rank]) for rank in self._leads]

    def _release(self) -> None:
        """The endpoint, if any; the ranks go after it."""
        server, self.server = self.server, None
        if server is not None:
            server.stop()


# ---------------------------------------------------------------------------
# Init
# ---------------------------------------------------------------------------


class _LinkedCancel(CancelToken):
    """A token that is also cancelled when ``parent`` is: lets the policy stop its own
    conversion (its workers failed) without cancelling the whole setup."""

    def __init__(self, parent: CancelToken) -> None:
        super().__init__()
        self.parent = parent

    @property
    def cancelled(self) -> bool:
        return self._event.is_set() or self.parent.cancelled

    @property
    def reason(self) -> str | None:
        return self._reason or self.parent.reason

    def raise_if_cancelled(self, what: str = "wait") -> None:
        if self.parent.cancelled:
            self.parent.raise_if_cancelled(what)
        super().raise_if_cancelled(what)

    def sleep(self, seconds: float) -> bool:
        end = time.monotonic() + max(0.0, seconds)
        while not self.cancelled:
            left = end - time.monotonic()
            if left <= 0:
                return False
            self._event.wait(min(left, 0.05))
        return True


class _Converter:
    """The checkpoint conversion of a policy init, in a thread, published through the hook."""

    def __init__(self, ctx: InitContext, model_dir: Path, options: MegatronOptions) -> None:
        from rlcore_megatron.checkpoint import checkpoint_key

        self.ctx = ctx
        self.model_dir = model_dir
        self.options = options
        self.key = checkpoint_key(model_dir, options, dtype=ctx.config.model.dtype)
        self.cancel = _LinkedCancel(ctx.cancel)
        self.path: Path | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        #: time.monotonic() when the checkpoint was published (or found published).
        self.published_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="megatron-convert", daemon=True)

    def _publish(self, destination: Path, write: Any) -> Path:
        hook = self.ctx.publish_hook
        if hook is None:  # called outside the core (tests): rlcore's own publish
            from rlcore.publish import publish_dir

            return publish_dir(destination, write, cancel=self.cancel, deadline=self.ctx.deadline)
        return Path(
            hook(
                destination=destination, write=write, cancel=self.cancel, deadline=self.ctx.deadline
            )
        )

    def _run(self) -> None:
        from rlcore_megatron.checkpoint import convert_and_publish

        t0 = time.monotonic()
        try:
            self.path = convert_and_publish(
                self.model_dir,
                self.ctx.cache_dir,
                self.options,
                dtype=self.ctx.config.model.dtype,
                cancel=self.cancel,
                deadline=self.ctx.deadline,
                publish=self._publish,
            )
            self.published_at = time.monotonic()
        except BaseException as err:  # re-raised by join() in the init thread
            self.error = err
        finally:
            self.seconds = time.monotonic() - t0

    def start(self) -> None:
        self._thread.start()

    def join(self) -> Path:
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.path is not None
        return self.path

    def abort(self, reason: str) -> None:
        """Stop the conversion (its processes are killed) and wait for the thread."""
        self.cancel.cancel(reason)
        self._thread.join()


@dataclass
class _Start:
    """What both inits establish first (see :func:`_prepare`)."""

    options: MegatronOptions
    section: Any
    dtype: str
    model_dir: Path
    spec: Any
    device: str
    t0: float
    colocated: bool

    def report(self, group: WorkerGroup) -> dict[str, Any]:
        """What both inits report first: ``colocated``, ``init_s`` (so far), ``group_start_s``."""
        return {
            "colocated": self.colocated,
            "init_s": time.monotonic() - self.t0,
            "group_start_s": group.start_time_s,
        }


def _prepare(ctx: InitContext, role: str) -> _Start:
    """Ray is up, the model is there, tensor parallelism fits it, the device is chosen."""
    require_ray(BACKEND, role)
    from rlcore.models.tiny import ensure_model
    from rlcore_megatron import convert

    t0 = time.monotonic()
    options = _options(ctx.options, role)
    section = getattr(ctx.config, role)
    model_dir = ensure_model(
        ctx.config.model, ctx.cache_dir, cancel=ctx.cancel, deadline=ctx.deadline
    )
    spec = convert.ModelSpec.from_hf(model_dir)
    _check_tp(spec, section.workers, options, role)
    device = resolve_worker_device(options.device, backend=BACKEND, section=role)
    colocated = bool(ctx.config.placement.colocated)
    return _Start(options, section, ctx.config.model.dtype, model_dir, spec, device, t0, colocated)


def start_policy(ctx: InitContext) -> MegatronPolicy:
    """Start the policy as configured by ``ctx`` (the body of ``rlcore_init_policy``)."""
    start = _prepare(ctx, "policy")
    _check_go(ctx)
    from rlcore_megatron import convert

    # Converted only when a reader of this run needs it (the plan says: a refit-fed
    # Megatron generation's need does not hold, so a refit-fed run converts nothing).
    needed = ctx.artifact_needed(CHECKPOINT_ARTIFACT)
    converter = _Converter(ctx, start.model_dir, start.options) if needed else None
    if converter is not None:
        converter.start()
    group, layout, checkpoint = _load_policy(ctx, start, converter)
    info = {
        **start.report(group),
        "build_s": max(x["build_s"] for x in layout),
        "load_s": max(x["load_s"] for x in layout),
        "convert_s": converter.seconds if converter is not None else 0.0,
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "checkpoint_published_at": converter.published_at if converter is not None else None,
        "params": sum(x["local_numel"] for x in layout if x["dp_rank"] == 0),
    }
    _log_policy_ready(ctx, start, info, converted=converter is not None)
    return MegatronPolicy(
        group,
        device_type=start.device,
        specs=convert.tensor_specs(start.spec, start.dtype),
        layout=layout,
        info=info,
    )


def _load_policy(
    ctx: InitContext, start: _Start, converter: _Converter | None
) -> tuple[WorkerGroup, list[dict[str, Any]], Path | None]:
    """Start the policy's workers and load the model while the conversion runs; then the
    published checkpoint (None without a conversion). A failure ends both."""
    from rlcore_megatron.worker import MegatronPolicyWorker

    group: WorkerGroup | None = None
    try:
        group = WorkerGroup(
            MegatronPolicyWorker,
            start.section.workers,
            name=POLICY_GROUP,
            **_group_kwargs(start.section, start.options, start.device, ctx),
        )
        layout = group.call(
            "load",
            str(start.model_dir),
            start.dtype,
            start.options,
            start.device,
            what="loading the model into megatron-core",
            deadline=ctx.deadline,
        )
        checkpoint = converter.join() if converter is not None else None
    except BaseException:
        if converter is not None:
            converter.abort("the megatron policy init failed")
        if group is not None:
            group.shutdown()
        raise
    return group, layout, checkpoint


def _log_policy_ready(
    ctx: InitContext, start: _Start, info: dict[str, Any], *, converted: bool
) -> None:
    ctx.log.info(
        "megatron policy: %d rank(s) (tp=%d) on %s, %.1f M params, init %.2fs "
        "(workers %.2fs, build %.2fs, load %.2fs%s)",
        start.section.workers,
        start.options.tensor_model_parallel_size,
        start.device,
        info["params"] / 1e6,
        info["init_s"],
        info["group_start_s"],
        info["build_s"],
        info["load_s"],
        f", checkpoint published in {info['convert_s']:.2f}s" if converted else "",
    )


@dataclass
class _CheckpointLoad:
    """A generation's load of the policy's published checkpoint (all empty when refit-fed).

    ``key``: the artifact's key (None: refit-fed); ``padded_vocab_size``: the policy's
    padding of the vocabulary; ``checkpoint``, ``at`` (monotonic time it came),
    ``wait_s`` and ``load_s``: filled in by :func:`_start_generation_workers`.
    """

    key: str | None = None
    padded_vocab_size: int | None = None
    checkpoint: Path | None = None
    at: float | None = None
    wait_s: float = 0.0
    load_s: float = 0.0


def _checkpoint_load(ctx: InitContext, start: _Start) -> _CheckpointLoad:
    """What a generation that is not refit-fed loads: the megatron policy's checkpoint."""
    from rlcore_megatron.checkpoint import checkpoint_key

    if start.section.refit_fed:
        return _CheckpointLoad()
    if ctx.config.policy.backend != BACKEND:
        raise ConfigError(
            "generation backend 'megatron' without generation.refit_fed loads the checkpoint "
            f"the megatron policy publishes, but policy.backend is '{ctx.config.policy.backend}'; "
            "set generation.refit_fed=true",
            key="generation.refit_fed",
        )
    # The checkpoint is written with the *policy's* options: same key, same padding.
    policy_options = _options(ctx.config.policy.options, "policy")
    return _CheckpointLoad(
        key=checkpoint_key(start.model_dir, policy_options, dtype=start.dtype),
        padded_vocab_size=start.spec.padded_vocab_size(
            policy_options.tensor_model_parallel_size,
            policy_options.make_vocab_size_divisible_by,
        ),
    )


def start_generation(ctx: InitContext) -> MegatronGeneration:
    """Start the generation engine as configured by ``ctx`` (the body of ``rlcore_init_generation``)."""
    start = _prepare(ctx, "generation")
    # A bad engine choice fails before any worker starts.
    engine = resolve_engine(start.options.engine, start.device)
    check_inflight_refit(start.options, engine)
    _check_go(ctx)
    from rlcore_megatron import convert

    options = start.options
    endpoint_tokenizer = None
    if options.serve_openai:  # its tokenizer and imports load while the engine starts
        from rlcore.serve.openai_endpoint import prepare

        endpoint_tokenizer = prepare(str(start.model_dir))
    load = _checkpoint_load(ctx, start)
    group, layout = _start_generation_workers(ctx, start, load, engine)
    info = {
        **start.report(group),
        "start_s": max(x["start_s"] for x in layout),
        "started_at": start.t0,
        "checkpoint_wait_s": load.wait_s,
        "checkpoint_at": load.at,
        "checkpoint_load_s": load.load_s,
        "checkpoint": str(load.checkpoint) if load.checkpoint is not None else None,
        "refit_fed": bool(start.section.refit_fed),
        "engine": layout[0].get("engine", engine),
    }
    handle = MegatronGeneration(
        group,
        device_type=start.device,
        specs=convert.tensor_specs(start.spec, start.dtype),
        layout=layout,
        info=info,
    )
    if options.serve_openai:
        try:
            handle.server = _start_endpoint(
                handle, start.model_dir, options, ctx, endpoint_tokenizer
            )
        except BaseException:
            handle.shutdown()
            raise
    _log_generation_ready(ctx, start, handle, load)
    return handle


def _start_generation_workers(
    ctx: InitContext, start: _Start, load: _CheckpointLoad, engine: str
) -> tuple[WorkerGroup, list[dict[str, Any]]]:
    """Start the workers and build model and engine; then wait for the policy's checkpoint
    and load it (when ``load.key`` is set), filling in ``load``. A failure ends the workers.
    ``engine``: the resolved engine; the dynamic one at tensor-parallel size 1 takes refits
    in flight (:class:`~rlcore_megatron.worker.MegatronInflightGenerationWorker`)."""
    from rlcore_megatron.worker import MegatronGenerationWorker, MegatronInflightGenerationWorker

    inflight = start.options.inflight_refit
    group = WorkerGroup(
        MegatronInflightGenerationWorker if inflight else MegatronGenerationWorker,
        start.section.workers,
        name=GENERATION_GROUP,
        **_group_kwargs(start.section, start.options, start.device, ctx),
    )
    try:
        layout = group.call(
            "start",
            str(start.model_dir),
            start.dtype,
            start.options,
            start.device,
            padded_vocab_size=load.padded_vocab_size,
            what="building the megatron inference engine",
            deadline=ctx.deadline,
        )
        if load.key is not None:
            t1 = time.monotonic()
            load.checkpoint = ctx.wait_artifact(CHECKPOINT_ARTIFACT, load.key)
            load.at = time.monotonic()
            load.wait_s = load.at - t1
            t1 = time.monotonic()
            group.call(
                "load_checkpoint",
                str(load.checkpoint),
                what="loading the Megatron checkpoint",
                deadline=ctx.deadline,
            )
            load.load_s = time.monotonic() - t1
    except BaseException:
        group.shutdown()
        raise
    return group, layout


def _log_generation_ready(
    ctx: InitContext, start: _Start, handle: MegatronGeneration, load: _CheckpointLoad
) -> None:
    info = handle.info
    ctx.log.info(
        "megatron generation: %d rank(s) (tp=%d) on %s, %s engine, %s, init %.2fs (workers %.2fs, "
        "engine %.2fs%s)%s",
        start.section.workers,
        start.options.tensor_model_parallel_size,
        start.device,
        info["engine"],
        "refit-fed" if info["refit_fed"] else "from the published checkpoint",
        info["init_s"],
        info["group_start_s"],
        info["start_s"],
        f", waited {load.wait_s:.2f}s for the checkpoint, loaded in {load.load_s:.2f}s"
        if load.key
        else "",
        f"; OpenAI-compatible endpoint {handle.endpoint.base_url}" if handle.endpoint else "",
    )


def _start_endpoint(
    handle: MegatronGeneration, model_dir: Path, options: MegatronOptions, ctx: InitContext,
    tokenizer: Any,
) -> Any:
    """The OpenAI-compatible endpoint over ``handle.generate`` (``serve_openai``);
    ``tokenizer``: what :func:`rlcore.serve.openai_endpoint.prepare` started loading."""
    from rlcore.config.placement import Network
    from rlcore.runtime.addresses import is_loopback, server_host
    from rlcore.serve.openai_endpoint import Batching, Listen, OpenAIEndpoint, ServedModel
    from rlcore_megatron.worker import eos_token_ids

    replicas = max(1, len(handle._leads))
    # Loopback unless a reader is on another node (ctx.network) or the options chose a host;
    # off loopback every request needs a token: the run's, or one of its own.
    host = server_host(ctx.network) if is_loopback(options.host) else options.host
    token = ctx.network.token or (None if is_loopback(host) else Network.spread().token)
    server = OpenAIEndpoint(
        handle,
        tokenizer,
        ServedModel(options.served_model_name, options.max_sequence_length, eos_token_ids(str(model_dir))),
        listen=Listen(host=host, port=options.port, token=token),
        # Each replica's engine takes max_batch_size requests at once.
        batching=Batching(options.max_batch_size * replicas, options.batch_wait_ms / 1000.0, options.seed),
    )
    remaining = ctx.deadline.remaining()
    try:
        server.start(timeout_s=30.0 if remaining is None else max(1.0, min(30.0, remaining)))
    except OSError as err:
        raise ConfigError(
            f"the megatron generation's OpenAI-compatible endpoint cannot listen on "
            f"{options.host}:{options.port}: {err}; choose another generation.options.port "
            "(0 picks a free one) or generation.options.host",
            key="generation.options.port",
        ) from err
    return server


def _on(method: Any, concurrency_group: str | None) -> Any:
    """``method`` on the actor's ``concurrency_group`` (None: its default thread)."""
    return method if concurrency_group is None else method.options(concurrency_group=concurrency_group)
