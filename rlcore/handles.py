"""What init hooks return: handles to started backends, and every call the core makes on them.

This module is the second half of the contract (the first is
:mod:`rlcore.hookspecs`). A handle is the core's grip on a started backend; it
lives in the driver process and usually drives Ray actors it owns. The core
calls a backend only through the protocols below, so their docstrings fix every
data format. ``rlcore.testing.BackendConformance`` holds a backend to them and
the run loop checks what comes back (:mod:`rlcore.app.guards`).

Conventions every backend follows
=================================

Token ids
    Plain ``list[int]`` in the tokenizer of ``model.path`` (or of the tiny model
    rlcore makes). A *prompt* is the ids the model conditions on, BOS included
    when the tokenizer adds one; a *completion* is the ids that follow it.

Log-probabilities
    Natural-log probabilities (``float``, ``<= 0``) of each completion token given
    the prompt and the completion tokens before it, under the model's own
    distribution **at temperature 1**: ``log_softmax(logits)`` of the raw logits,
    never scaled by the sampling temperature and never renormalised by top-k/top-p.
    ``GenerationHandle.generate`` and ``logprobs`` and ``PolicyHandle.logprobs``
    all use this one convention, so the same tokens get the same numbers from
    policy and generation (``refit/token_mult_prob_error`` is exp of their mean
    absolute difference and stays near 1.0).

End of sequence
    Sampling stops after the first end-of-sequence token (the tokenizer's
    ``eos_token_id``, or any id of the model's ``generation_config.eos_token_id``).
    That token **is** part of ``token_ids`` (with its logprob): training learns
    to stop. No token follows it. A sample that reaches ``max_tokens`` ends
    without one.

Sampling parameters
    What ``generate`` samples with travels as one :class:`SamplingParams`
    (``n``, ``max_tokens``, ``temperature``, ``seed``), from the loop through the
    guards, the handle and the OpenAI-compatible endpoint to each engine
    (since contract 2.0; before, four keyword arguments).

Seeding
    ``generate`` with the same prompts, :class:`SamplingParams` and weights returns
    the same samples. Different ``seed`` values give
    independent samples. Results do not depend on how many workers the engine
    runs (derive per-prompt seeds from ``seed`` and the prompt's index).

Batches
    A *batch* is a sequence of ``(prompt_ids, completion_ids)`` pairs; results
    come back in the batch's order, one row per pair, one value per completion
    token.

Weight versions
    Version ``v`` of the weights is the number of train steps in them: the
    weights an engine starts with (and those of setup's ``refit:initial``, step 0)
    are version 0; after the refit of step ``t`` they are version ``t``. A
    :class:`Sample` (and the :class:`Rollout` made from it) may carry
    ``versions``, the version of the weights that sampled each token of
    ``token_ids`` (same length, ints >= 0, never decreasing). A refit that lands
    while a sequence is being sampled gives that sample tokens of two versions,
    which is why the version is per token. A backend that cannot tell leaves
    ``versions`` out; the loop then knows nothing of the sample's age. A handle
    whose engines can say which weights they hold implements
    :class:`WeightVersioned` (since contract 2.1).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NotRequired, Protocol, TypedDict, runtime_checkable

if TYPE_CHECKING:
    from rlcore.refit.specs import ChannelSpec, TensorSpec

#: ``(prompt_ids, completion_ids)``: one sequence of a batch.
Pair = tuple[Sequence[int], Sequence[int]]


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible HTTP endpoint served by a generation backend."""

    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str  # the model name to put in requests
    api_key: str = "EMPTY"


@dataclass(frozen=True)
class SamplingParams:
    """How :meth:`GenerationHandle.generate` samples (see the module's conventions).

    Attributes:
        n: samples per prompt (>= 1).
        max_tokens: most tokens of each completion (>= 1).
        temperature: the sampling temperature (>= 0; 0: greedy). Logprobs are at
            temperature 1 whatever it is.
        seed: the call's seed: the same seed, prompts and weights give the same samples.

    Raises :class:`ValueError` naming the field for a value out of range.
    """

    n: int
    max_tokens: int
    temperature: float
    seed: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")


@dataclass(frozen=True)
class LossOptions:
    """How a policy that declares ``loss_options`` (contract 2.5) shapes its loss, passed to
    :meth:`PolicyHandle.train_step` as ``loss=`` when the run asks for anything but the
    defaults (``grpo.clip_eps_high``, ``grpo.loss_aggregation``, ``grpo.rollout_correction``).

    With ``ratio = exp(logprob - old_logprob)`` and ``A`` the row's advantage, each completion
    token ``t`` of row ``i`` has the loss
    ``l = -w_t * min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)``:

    Attributes:
        clip_eps_high: the upper clip (``None``: ``clip_eps``, symmetric); a token is
            counted in ``clip_fraction`` when its ratio leaves that asymmetric range.
        aggregation: the step's loss from the token losses: ``token_mean``
            (``sum l / tokens``), ``seq_mean_token_mean`` (``mean_i (sum_t l / len_i)``),
            ``seq_mean_token_sum_norm`` (``mean_i (sum_t l / norm_tokens)``).
        norm_tokens: the constant of ``seq_mean_token_sum_norm`` (the run's ``max_new_tokens``).
        correction: ``none`` (``w = 1``), ``tis`` (``w = min(rho, cap)``) or ``mis``
            (``w = rho`` where ``rho <= cap``, else 0), ``rho = exp(old_logprob -
            engine_logprob)`` per token, detached: the trainer's probability of the sampled
            token over the sampler's.
        cap: the correction's bound (>= 1).
        engine_logprobs: the generation's sampling logprobs, one row per pair (needed by
            ``tis`` and ``mis``).
    """

    clip_eps_high: float | None = None
    aggregation: str = "token_mean"
    norm_tokens: int | None = None
    correction: str = "none"
    cap: float = 2.0
    engine_logprobs: Sequence[Sequence[float]] | None = None

    def features(self) -> frozenset[str]:
        """What of this differs from the plain GRPO loss: the names of
        :data:`rlcore.declarations.LOSS_FEATURES` the policy must declare."""
        used = set()
        if self.clip_eps_high is not None:
            used.add("clip_eps_high")
        if self.aggregation != "token_mean":
            used.add("aggregation")
        if self.correction != "none":
            used.add("correction")
        return frozenset(used)

    def __post_init__(self) -> None:
        if self.correction != "none" and self.engine_logprobs is None:
            raise ValueError(f"LossOptions.correction={self.correction!r} needs engine_logprobs")
        if self.aggregation == "seq_mean_token_sum_norm" and not self.norm_tokens:
            raise ValueError("LossOptions.aggregation='seq_mean_token_sum_norm' needs norm_tokens >= 1")


class Sample(TypedDict):
    """One sampled completion (see the module's conventions).

    Attributes:
        token_ids: the completion's token ids, 1 to ``max_tokens`` of them, ending
            with EOS when the engine stopped on it.
        logprobs: one per token of ``token_ids``, at temperature 1.
        versions: (optional, since contract 2.1) the weight version of each token of
            ``token_ids`` (see the module's conventions); left out by an engine that
            cannot tell.
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: NotRequired[list[int]]


class Rollout(TypedDict, total=False):
    """One scored sample, as an env returns it.

    Attributes:
        prompt_ids: the ids the completion was generated from (for a multi-turn
            env: the whole conversation before the last model turn).
        token_ids: the completion (the last model turn).
        logprobs: the generation's logprobs of ``token_ids``, at temperature 1.
        reward: a finite float.
        model_turns: (optional) how many model turns the rollout took.
        versions: (optional, since contract 2.1) the weight version of each token of
            ``token_ids``, as the :class:`Sample` carried it (the module's conventions).
        failed: (optional) why the sample has no reward (a reward function that raised,
            hung or returned a non-finite value): the loop counts it in ``reward/failed``,
            leaves it out of its group's advantage (advantage 0) and of the reward figures;
            ``reward`` is then ignored (set it to 0.0).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    reward: float
    model_turns: int
    versions: list[int]
    failed: str


@dataclass
class RefitReport:
    """What one weight sync did. ``weight_sync_time_s`` is wall time of the whole sync."""

    step: int
    transport: str
    bytes: int
    tensors: int
    weight_sync_time_s: float
    #: Time to create the transport's channel (collective group), non-zero only the first time.
    channel_init_time_s: float = 0.0
    #: What moved: ``hf``, the plan's Hugging Face tensors (each backend converts), or
    #: ``native``, the backends' own tensors, copied as they are where both hold the same
    #: layout (agreed when the channel opened: :func:`rlcore.refit.transports.cuda_ipc.offer_layout`).
    path: str = "hf"

    @property
    def throughput_gib_s(self) -> float:
        return self.bytes / max(self.weight_sync_time_s, 1e-9) / 2**30


@runtime_checkable
class BackendHandle(Protocol):
    """A started backend. ``shutdown`` must release every process, actor and port
    the backend started, be safe to call twice, and return within the
    ``setup.shutdown_timeout_s`` the core allows. It calls nothing of the core's:
    the run owns its refit channels and drops them itself."""

    def shutdown(self) -> None: ...


@runtime_checkable
class PolicyHandle(BackendHandle, Protocol):
    """The model being trained (``rlcore_init_policy`` returns one)."""

    def logprobs(self, batch: Sequence[Pair]) -> list[list[float]]:
        """Per-token logprobs of each pair's completion under the current weights.

        Returns one row per pair, ``len(row) == len(completion_ids)``, at temperature 1.
        """
        ...

    def train_step(
        self,
        batch: Sequence[Pair],
        advantages: Sequence[float],
        old_logprobs: Sequence[Sequence[float]] | None = None,
        *,
        clip_eps: float = 0.2,
        lr: float = 1e-5,
        loss: LossOptions | None = None,
    ) -> dict[str, float]:
        """One optimiser step of the clipped policy-gradient (GRPO) loss over ``batch``.

        ``loss`` (contract 2.5) comes only to a policy that declares ``loss_options``, and
        only when the run asks for more than the plain loss below (:class:`LossOptions`).

        ``advantages`` has one float per pair (every token of a completion shares
        it); ``old_logprobs`` are the policy's logprobs of the same tokens before
        the step (``None``: on-policy, ratio 1). The loss is ``-mean`` over every
        completion token of the batch of ``min(ratio * A, clip(ratio, 1 - clip_eps,
        1 + clip_eps) * A)`` with ``ratio = exp(logprob - old_logprob)``.

        The step starts from the current weights alone: nothing of an earlier step's
        gradients carries over (optimizer moments may). ``lr=0`` leaves the weights as
        they are. A row with an empty prompt raises ``ValueError`` naming the row (a
        convention the in-tree policies keep; the suite checks the rest).

        Returns metrics, at least (all floats, each checked by the conformance suite):
        ``loss`` (of the batch at the weights before the step), ``grad_norm`` (global,
        before any clipping), ``clip_fraction`` (tokens whose ratio left
        ``[1 - clip_eps, 1 + clip_eps]``), ``tokens`` (completion tokens of the batch)
        and ``lr``.
        """
        ...


@runtime_checkable
class GenerationHandle(BackendHandle, Protocol):
    """The engine that samples (``rlcore_init_generation`` returns one).

    A backend whose declaration serves an OpenAI-compatible endpoint under the
    run's config also has an ``endpoint`` attribute (:class:`Endpoint`, or None
    while it does not serve).
    """

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Sample]]:
        """``params.n`` samples of at most ``params.max_tokens`` tokens for each prompt,
        sampled at ``params.temperature`` (0: greedy) with ``params.seed``.

        Returns one list of ``params.n`` :class:`Sample` per prompt, in prompt order. See
        the module's conventions for logprobs (temperature 1), EOS and seeding.
        """
        ...

    def logprobs(self, batch: Sequence[Pair]) -> list[list[float]]:
        """Per-token logprobs of each pair's completion under the engine's current
        weights (same format and convention as :meth:`PolicyHandle.logprobs`)."""
        ...


@runtime_checkable
class WeightVersioned(Protocol):
    """A generation handle whose engines say which weights they hold (optional, since
    contract 2.1).

    The core calls :meth:`weight_versions` when the handle has it, after each refit,
    to check that every engine reports that refit's version (a refit that returned
    without loading everywhere is then caught, naming the engine).
    """

    def weight_versions(self) -> list[int]:
        """The weight version each engine holds (the module's conventions), one int per
        engine (engine ``i`` is refit rank ``1 + i``): 0 before any refit, ``t`` after
        the refit of step ``t`` succeeded."""
        ...


@runtime_checkable
class Checkpointable(Protocol):
    """A policy handle that saves and loads its training state (contract 2.2).

    Declared with :class:`rlcore.declarations.CheckpointSupport`. The core publishes
    each checkpoint atomically (a staging directory, then one rename): it hands
    :meth:`save_checkpoint` an empty directory inside the staging one, digests and
    flushes what was written there once it returns, and deletes the whole staging
    directory if the save raised or the run was killed. So a backend writes plain
    files and never needs a completion marker of its own.
    """

    def save_checkpoint(self, directory: str) -> None:
        """Write everything the policy needs to go on as if it never stopped into
        ``directory`` (empty, on a filesystem every rank's node sees): weights, optimizer
        state, any scheduler state of its own and the RNG states of every rank, in the
        backend's own (sharded) form; each rank may write its own files.

        Returns once every file is written. Must not change the policy's state: the next
        ``train_step`` gives what it would have given without the save. Raises on any
        failure (a full disk: an ``OSError`` naming the path); the core then drops the
        directory.
        """
        ...

    def load_checkpoint(self, directory: str) -> None:
        """Restore the state :meth:`save_checkpoint` wrote into ``directory`` (the same
        backend and format version; the core checks those first).

        Afterwards ``logprobs`` and ``train_step`` give exactly what they gave right after
        that save, where the backend is deterministic. A directory it cannot load (another
        world size it cannot reshard to, another model) raises
        :class:`rlcore.errors.CheckpointError` naming the difference.
        """
        ...


@runtime_checkable
class StagedCheckpointable(Checkpointable, Protocol):
    """A policy handle whose saves stop its training only for a copy to host memory
    (contract 2.3; declared with ``CheckpointSupport(staged=True)``).

    The core calls :meth:`stage_checkpoint` where it would call ``save_checkpoint``, goes
    on with the loop (``train_step``, ``logprobs``, refits) as soon as it returns, and
    polls :meth:`checkpoint_written` from another thread until it says True; only then is
    the directory digested and published. Its calls may therefore come between the
    loop's calls, on any rank in any order: :meth:`checkpoint_written` must be local to
    each rank (no collective) and return at once. One staged save is in flight at a
    time: the next :meth:`stage_checkpoint` comes only after :meth:`checkpoint_written`
    returned True. A process that dies before then leaves a directory the core never
    publishes and deletes at the next start.
    """

    def stage_checkpoint(self, directory: str) -> Mapping[str, float]:
        """Copy what ``save_checkpoint(directory)`` would write off the devices (into host
        memory, pinned where there is a GPU, reused by the next save so it stays bounded),
        start writing it into ``directory`` in the background, and return. What is written
        is the state at this call, whatever the policy does after it. Collective, as
        ``save_checkpoint``.

        Returns figures of the staging for the save's metrics line, e.g.
        ``{"host_bytes": ...}`` (the host memory the staged copy holds); they are recorded
        as ``checkpoint/<name>``.
        """
        ...

    def checkpoint_written(self) -> bool:
        """Whether every file of the staged save is written, on every rank (True also when
        no save is staged). Raises the background write's failure (an ``OSError`` naming
        the path, a full disk included) once, as ``save_checkpoint`` would have. Returns
        at once."""
        ...


@runtime_checkable
class AdapterSource(Protocol):
    """A policy that trains LoRA adapters (``trains_adapters``, contract 2.5) gives them as
    peft saves them, for ``rlcore export --adapter``: a directory peft loads onto the base."""

    def adapter_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The adapter tensors by the names peft saves them under
        (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; CPU tensors)
        and peft's adapter config (``adapter_config.json``'s fields: ``r``, ``lora_alpha``,
        ``target_modules``, ...). Raises when the run trained every weight."""
        ...


@runtime_checkable
class AdapterReceiver(Protocol):
    """A generation that serves a policy's LoRA adapters in place (``takes_adapters``,
    contract 2.6): every refit of such a run hands it the adapters alone
    (:class:`AdapterSource`'s ``adapter_state()``), never weights; its engines started from
    the checkpoint's base weights (:attr:`rlcore.context.InitContext.adapters`)."""

    def load_adapter(self, tensors: Any, config: dict[str, Any], step: int) -> list[Any]:
        """Every engine serves the adapter ``tensors`` (peft's names, CPU tensors, or a Ray
        reference to them) with peft's adapter ``config`` from now on, as the weights of
        ``step`` (its :class:`WeightVersioned` version); Ray refs (or values) that resolve
        when every engine has loaded. Requests in flight go on with the new adapter or wait
        for it, as the engine's in-flight landing says; a failure leaves the engine refusing
        to sample until a refit succeeds."""
        ...


@runtime_checkable
class ResumableEnv(Protocol):
    """An env handle with state a resumed run must get back (optional, contract 2.2): a
    position in a dataset, a curriculum. An env that picks its prompts from the step alone
    needs none of it.
    """

    def state(self, after_step: int) -> Any:
        """What a run resumed after ``after_step`` needs (plain JSON), called on the loop's
        thread right after that step. A loop that samples ahead (``grpo.max_staleness``) may
        have asked for later steps already: the state is still the one after ``after_step``,
        so that the resumed run's step ``after_step + 1`` gets the same prompts."""
        ...

    def load_state(self, state: Any) -> None:
        """Continue from what :meth:`state` returned (raise naming what does not match)."""
        ...


@dataclass(frozen=True)
class RolloutRequest:
    """What the GRPO loop asks an env for at one step.

    Attributes:
        step: the training step (1-based); an env picks its prompts from it, so the
            same step gives the same prompts.
        prompts: how many prompts (groups).
        samples_per_prompt: samples per prompt (the group size).
        max_new_tokens: bound on each completion.
        temperature: sampling temperature.
        seed: the sampling seed of this step.
        generation: the run's generation handle, for envs that sample through it
            (prompt-and-score envs). Envs that talk to the model through its
            OpenAI-compatible endpoint ignore it.
        tokenizer: the run's Hugging Face tokenizer (to encode prompts, decode
            completions): transformers' ``AutoTokenizer`` of the run's model
            (:func:`rlcore.models.tokenizer.load`).
        draw: 0 for the step's own prompts; 1, 2, ... when dynamic sampling
            (``grpo.dynamic_sampling``) asks the same step for more prompts because
            groups of equal rewards were dropped (contract 2.5). An env that declares
            ``extra_draws`` gives other prompts for each draw (and the same ones for the
            same step and draw); the core sends draws > 0 to no other env.
    """

    step: int
    prompts: int
    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    seed: int
    generation: GenerationHandle
    tokenizer: Any
    draw: int = 0

    def sampling(self) -> SamplingParams:
        """The :class:`SamplingParams` of this request's ``generate`` call."""
        return SamplingParams(self.samples_per_prompt, self.max_new_tokens, self.temperature, self.seed)


@runtime_checkable
class EnvHandle(BackendHandle, Protocol):
    """Environments that produce scored samples (``rlcore_init_env`` returns one).

    One interface for both kinds of env: a prompt-and-score env samples through
    ``request.generation`` and scores the texts (subclass
    :class:`rlcore.handles.PromptAndScoreEnv`, which does this for you); an env that
    drives the model itself (NeMo Gym, through the generation endpoint) ignores it.
    """

    def collect_rollouts(self, request: RolloutRequest) -> list[list[Rollout]]:
        """``request.prompts`` groups of ``request.samples_per_prompt`` scored
        :class:`Rollout` each, in a deterministic order for a given step."""
        ...


@runtime_checkable
class MemoryHandoff(Protocol):
    """A policy or generation handle that gives device memory back while the other
    colocated role works (declared with ``memory_handoff=True``).

    With ``placement.colocated`` the GRPO loop calls the generation's :meth:`sleep` and
    the policy's :meth:`wake` before training, and the reverse before sampling. The
    weights stay in place (refit and logprobs read them); what moves is what the other
    role needs room for: a generation's KV cache and engine buffers, a policy's
    optimizer state. Both are idempotent, and a call that needs the memory back
    (``generate``, ``train_step``) wakes a sleeping handle itself.
    """

    def sleep(self) -> Any:
        """Release the memory the other role needs; returns what was done (for metrics)."""
        ...

    def wake(self) -> Any:
        """Take it back."""
        ...


@runtime_checkable
class RefitSender(Protocol):
    """The policy side of the core's refit (all methods are called in the driver).

    Call order, by the core's ``rlcore_refit`` (:func:`rlcore.refit.sync.refit`):
    ``weight_specs()`` (checked against the receiver's before any byte moves);
    the first time only, ``refit_address()`` (collective) and
    ``open_refit_channel(spec)``; then every refit ``send_weights(spec, step, buckets)``
    together with the receiver's ``receive_weights``. Methods that return Ray
    object refs return at once; the core waits on the refs with the refit's
    deadline and cancellation.
    """

    #: ``cuda`` or ``cpu``: where the sending rank's tensors live (picks NCCL or gloo).
    device_type: str

    def weight_specs(self) -> list[TensorSpec]:
        """``TensorSpec`` of every weight, Hugging Face names, full (unsharded) shapes,
        in send order."""
        ...

    def refit_address(self) -> tuple[str, int]:
        """A host and free port on the sending rank's node for the collective rendezvous."""
        ...

    def open_refit_channel(self, spec: ChannelSpec) -> list[Any]:
        """Join channel ``spec`` as rank 0; returns Ray object refs to wait on."""
        ...

    def send_weights(self, spec: ChannelSpec, step: int, buckets: list[list[TensorSpec]]) -> list[Any]:
        """Start streaming the current weights over ``spec`` in the planned ``buckets``
        (worker side: :func:`rlcore.refit.channels.send_weights`); returns Ray object refs."""
        ...


@runtime_checkable
class RefitReceiver(Protocol):
    """The generation side of the core's refit (all methods are called in the driver)."""

    #: Number of generation workers that receive (channel ranks 1..refit_ranks).
    refit_ranks: int

    def weight_specs(self) -> list[TensorSpec]:
        """``TensorSpec`` of every weight the engine expects (Hugging Face names)."""
        ...

    def open_refit_channel(self, spec: ChannelSpec) -> list[Any]:
        """Join channel ``spec`` as ranks 1..refit_ranks; returns Ray object refs."""
        ...

    def receive_weights(self, spec: ChannelSpec, step: int, buckets: list[list[TensorSpec]]) -> list[Any]:
        """Receive the buckets and load them into the running engine (worker side:
        :func:`rlcore.refit.channels.receive_weights`); returns Ray object refs that
        resolve once every worker has loaded every tensor. A failure leaves the
        engine refusing to sample until a refit succeeds, never serving mixed weights."""
        ...


# A base for envs that make prompts and score completions (the simplest kind of env).
class Prompt(Protocol):
    """What :meth:`PromptAndScoreEnv.sample_prompts` returns: at least the prompt's text."""

    text: str


class PromptAndScoreEnv:
    """An env that makes prompts and scores completion texts; the core samples."""

    def sample_prompts(self, n: int, step: int) -> Sequence[Prompt]:
        """``n`` prompts for ``step`` (the same step gives the same prompts)."""
        raise NotImplementedError

    def sample_extra_prompts(self, n: int, step: int, draw: int) -> Sequence[Prompt]:
        """``n`` other prompts for ``step``'s extra ``draw`` (>= 1) of dynamic sampling (the
        same step and draw give the same prompts). An env that implements it declares
        ``extra_draws=True`` (contract 2.5)."""
        raise NotImplementedError(
            f"{type(self).__name__} draws no extra prompts (implement sample_extra_prompts and "
            "declare extra_draws=True for grpo.dynamic_sampling)"
        )

    def score(self, prompts: Sequence[Any], completions: Sequence[Sequence[str]]) -> list[list[float]]:
        """One reward per completion text (special tokens removed), per prompt."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Nothing to release by default."""

    def collect_rollouts(self, request: RolloutRequest) -> list[list[Rollout]]:
        """Sample ``request.samples_per_prompt`` completions of each prompt through
        ``request.generation``, then score their texts."""
        tok = request.tokenizer
        if request.draw:
            prompts = list(self.sample_extra_prompts(request.prompts, request.step, request.draw))
        else:
            prompts = list(self.sample_prompts(request.prompts, request.step))
        prompt_ids = [list(tok(p.text).input_ids) for p in prompts]
        groups = request.generation.generate(prompt_ids, request.sampling())
        texts = [[tok.decode(s["token_ids"], skip_special_tokens=True) for s in g] for g in groups]
        rewards = self.score(prompts, texts)
        return [
            [rollout_of(pid, s, r) for s, r in zip(group, group_rewards, strict=True)]
            for pid, group, group_rewards in zip(prompt_ids, groups, rewards, strict=True)
        ]


def rollout_of(prompt_ids: Sequence[int], sample: Sample, reward: float) -> Rollout:
    """The :class:`Rollout` of ``sample`` of ``prompt_ids`` with its ``reward``: what an env
    that samples through the generation returns, its weight versions kept when the sample
    carries them. A ``reward`` that is not a real number (None, a string) is kept as it
    is, not converted, so the run's check names the backend and the row instead of a
    ``float()`` failing in the env."""
    rollout = Rollout(
        prompt_ids=list(prompt_ids),
        token_ids=list(sample["token_ids"]),
        logprobs=list(sample["logprobs"]),
        reward=float(reward) if isinstance(reward, numbers.Real) else reward,
    )
    if "versions" in sample:
        rollout["versions"] = list(sample["versions"])
    return rollout
