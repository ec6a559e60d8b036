"""Run-time checks of what backends return, against the formats of :mod:`rlcore.handles`.

The GRPO loop talks to the policy, generation and env through :class:`GuardedPolicy`,
:class:`GuardedGeneration` and :class:`GuardedEnv`: the same calls, with every
result checked before the loop uses it. A result of the wrong shape raises
:class:`~rlcore.errors.ProtocolError` naming the backend, the method, what was
expected and what came back, instead of failing later somewhere that names
neither. The conformance suite (:mod:`rlcore.testing`) uses the same checks.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rlcore.declarations import porting_note
from rlcore.errors import ConfigError, ProtocolError, WorkerLost
from rlcore.handles import (
    EnvHandle,
    GenerationHandle,
    Pair,
    PolicyHandle,
    Rollout,
    RolloutRequest,
    Sample,
    SamplingParams,
    WeightVersioned,
)

#: Logprobs may exceed 0 by float rounding only.
_LOGPROB_SLACK = 1e-4


@dataclass(frozen=True)
class Caller:
    """Who is being checked: a backend in a role, and the method called."""

    backend: str
    role: str
    method: str

    def fail(self, expected: str, got: str) -> ProtocolError:
        return ProtocolError(
            f"{self.role} backend '{self.backend}' broke the contract of {self.method}() "
            f"(rlcore.handles): expected {expected}; got {got}",
            backend=self.backend,
            role=self.role,
            method=self.method,
        )


def _brief(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_logprob_row(row: Any, n_tokens: int, who: Caller, where: str) -> list[float]:
    if not isinstance(row, Sequence) or isinstance(row, str | bytes):
        raise who.fail(
            f"{where}: a list of {n_tokens} floats", f"{type(row).__name__} {_brief(row)}"
        )
    if len(row) != n_tokens:
        raise who.fail(f"{where}: {n_tokens} logprobs (one per token)", f"{len(row)}")
    out = []
    for k, x in enumerate(row):
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise who.fail(f"{where}: finite float logprobs", f"{_brief(x)} at token {k}")
        if x > _LOGPROB_SLACK:
            raise who.fail(
                f"{where}: log-probabilities (<= 0, natural log, temperature 1)",
                f"{x:g} at token {k}",
            )
        out.append(float(x))
    return out


def check_logprobs(rows: Any, batch: Sequence[Pair], who: Caller) -> list[list[float]]:
    """``rows`` must hold one row per pair of ``batch``, one logprob per completion token."""
    if not isinstance(rows, Sequence) or len(rows) != len(batch):
        got = f"{len(rows)} rows" if isinstance(rows, Sequence) else type(rows).__name__
        raise who.fail(f"one row per pair of the batch ({len(batch)} rows)", got)
    return [
        _check_logprob_row(row, len(pair[1]), who, f"row {i}")
        for i, (row, pair) in enumerate(zip(rows, batch, strict=True))
    ]


def _check_tokens(ids: Any, who: Caller, where: str) -> list[int]:
    if not isinstance(ids, Sequence) or isinstance(ids, str | bytes):
        raise who.fail(f"{where}: token_ids, a list of ints", _brief(ids))
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise who.fail(f"{where}: token_ids, non-negative ints", _brief(ids))
    return [int(t) for t in ids]


def _check_versions(versions: Any, n_tokens: int, who: Caller, where: str) -> list[int]:
    """The weight versions of a sample's tokens (:mod:`rlcore.handles`, "Weight versions"):
    one int >= 0 per token, never decreasing (a refit only moves an engine forward)."""
    if not isinstance(versions, Sequence) or isinstance(versions, str | bytes):
        raise who.fail(f"{where}: versions, a list of {n_tokens} ints", _brief(versions))
    if len(versions) != n_tokens:
        raise who.fail(f"{where}: {n_tokens} versions (one per token)", f"{len(versions)}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in versions):
        raise who.fail(f"{where}: versions, ints >= 0 (train steps in the weights)", _brief(versions))
    for k in range(1, n_tokens):
        if versions[k] < versions[k - 1]:
            raise who.fail(
                f"{where}: versions that never decrease",
                f"{versions[k - 1]} then {versions[k]} at token {k}",
            )
    return [int(v) for v in versions]


def check_weight_versions(versions: Any, who: Caller) -> list[int]:
    """``weight_versions()`` (:class:`rlcore.handles.WeightVersioned`): one int >= 0 per engine."""
    if (
        not isinstance(versions, Sequence)
        or isinstance(versions, str | bytes)
        or not versions
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in versions)
    ):
        raise who.fail("one weight version (an int >= 0) per engine", _brief(versions))
    return [int(v) for v in versions]


def _check_eos(ids: list[int], eos_ids: Collection[int], who: Caller, where: str) -> None:
    for k, t in enumerate(ids[:-1]):
        if t in eos_ids:
            raise who.fail(
                f"{where}: sampling to stop after end-of-sequence (EOS, id {t}, included as the "
                "last token)",
                f"{len(ids) - k - 1} token(s) after EOS at position {k}",
            )


def check_samples(
    groups: Any,
    n_prompts: int,
    n: int,
    max_tokens: int,
    who: Caller,
    eos_ids: Collection[int] = (),
) -> list[list[Sample]]:
    """``groups`` must hold ``n`` samples per prompt: token ids (1..``max_tokens``, nothing
    after EOS) and one logprob per token; and one weight version per token where a sample
    carries ``versions`` (kept)."""
    if not isinstance(groups, Sequence) or len(groups) != n_prompts:
        got = f"{len(groups)} groups" if isinstance(groups, Sequence) else type(groups).__name__
        raise who.fail(f"one group of samples per prompt ({n_prompts})", got)
    out: list[list[Sample]] = []
    for i, group in enumerate(groups):
        if not isinstance(group, Sequence) or len(group) != n:
            raise who.fail(f"prompt {i}: n={n} samples", _brief(group))
        checked: list[Sample] = []
        for j, s in enumerate(group):
            where = f"prompt {i} sample {j}"
            if not isinstance(s, dict) or "token_ids" not in s or "logprobs" not in s:
                raise who.fail(f"{where}: a dict with token_ids and logprobs", _brief(s))
            ids = _check_tokens(s["token_ids"], who, where)
            if not 1 <= len(ids) <= max_tokens:
                raise who.fail(f"{where}: 1 to max_tokens={max_tokens} tokens", f"{len(ids)}")
            _check_eos(ids, eos_ids, who, where)
            sample = Sample(token_ids=ids, logprobs=_check_logprob_row(s["logprobs"], len(ids), who, where))
            if "versions" in s:
                sample["versions"] = _check_versions(s["versions"], len(ids), who, where)
            checked.append(sample)
        out.append(checked)
    return out


def check_rollouts(groups: Any, request: RolloutRequest, who: Caller) -> list[list[Rollout]]:
    """``groups`` must hold ``request.prompts`` groups of ``request.samples_per_prompt``
    rollouts, each with prompt ids, token ids, one logprob per token and a finite reward;
    ``model_turns``, the tokens' weight ``versions`` and a ``failed`` reason are kept where a
    rollout has them."""
    if not isinstance(groups, Sequence) or len(groups) != request.prompts:
        got = f"{len(groups)} groups" if isinstance(groups, Sequence) else type(groups).__name__
        raise who.fail(f"{request.prompts} groups of rollouts (one per prompt)", got)
    out: list[list[Rollout]] = []
    for i, group in enumerate(groups):
        if not isinstance(group, Sequence) or len(group) != request.samples_per_prompt:
            raise who.fail(
                f"group {i}: {request.samples_per_prompt} rollouts",
                f"{len(group) if isinstance(group, Sequence) else _brief(group)}",
            )
        checked: list[Rollout] = []
        for j, r in enumerate(group):
            where = f"group {i} rollout {j}"
            missing = (
                [k for k in ("prompt_ids", "token_ids", "logprobs", "reward") if k not in r]
                if isinstance(r, dict)
                else None
            )
            if missing is None or missing:
                raise who.fail(
                    f"{where}: a dict with prompt_ids, token_ids, logprobs, reward", _brief(r)
                )
            ids = _check_tokens(r["token_ids"], who, where)
            reward = r["reward"]
            if (
                isinstance(reward, bool)
                or not isinstance(reward, int | float)
                or not math.isfinite(reward)
            ):
                raise who.fail(f"{where}: a finite float reward", _brief(reward))
            row = Rollout(
                prompt_ids=_check_tokens(r["prompt_ids"], who, where + " prompt"),
                token_ids=ids,
                logprobs=_check_logprob_row(r["logprobs"], len(ids), who, where),
                reward=float(reward),
            )
            if "model_turns" in r:
                row["model_turns"] = r["model_turns"]
            if "versions" in r:
                row["versions"] = _check_versions(r["versions"], len(ids), who, where)
            if "failed" in r:
                if not isinstance(r["failed"], str) or not r["failed"]:
                    raise who.fail(f"{where}: failed, a non-empty reason (str)", _brief(r["failed"]))
                row["failed"] = r["failed"]
            checked.append(row)
        out.append(checked)
    return out


def check_train_metrics(metrics: Any, who: Caller) -> dict[str, float]:
    """A train step returns a dict with float ``loss`` and ``grad_norm``."""
    if not isinstance(metrics, dict):
        raise who.fail("a dict of metrics with loss and grad_norm", _brief(metrics))
    for key in ("loss", "grad_norm"):
        value = metrics.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise who.fail(f"metrics['{key}'], a float", _brief(value))
    return dict(metrics)


@contextlib.contextmanager
def losses_tagged(role: str) -> Iterator[None]:
    """A :class:`WorkerLost` raised inside is ``role``'s (:meth:`WorkerLost.tag`): the
    run replaces a lost generation worker (``generation.on_worker_loss: replace``) and
    aborts on any other loss."""
    try:
        yield
    except WorkerLost as err:
        err.tag(role)
        raise


class GuardedPolicy:
    """The policy handle with every result checked (see the module doc)."""

    def __init__(self, handle: PolicyHandle, backend: str, before: Callable[[], None] | None = None) -> None:
        self.handle = handle
        self.backend = backend
        #: Called before each call (the session joins a checkpoint save in flight there).
        self.before = before or (lambda: None)

    def logprobs(self, batch: Sequence[Pair]) -> list[list[float]]:
        self.before()
        with losses_tagged("policy"):
            rows = self.handle.logprobs(batch)
        return check_logprobs(rows, batch, Caller(self.backend, "policy", "logprobs"))

    def train_step(
        self,
        batch: Sequence[Pair],
        advantages: Sequence[float],
        old_logprobs: Any = None,
        **kw: float,
    ) -> dict[str, float]:
        self.before()
        with losses_tagged("policy"):
            out = self.handle.train_step(batch, advantages, old_logprobs, **kw)
        return check_train_metrics(out, Caller(self.backend, "policy", "train_step"))


#: Contract 1.x's generate keywords: a parameter of one of these names is a 1.x signature.
_V1_SAMPLING_NAMES = frozenset({"n", "max_tokens", "temperature", "seed"})
#: Handle types whose generate signature was read and found to be 2.x (read once per type).
_SIGNATURES_OK: set[type] = set()


def _check_generate_signature(handle: GenerationHandle, backend: str) -> None:
    """Refuse a handle whose ``generate`` still has contract 1.x's sampling arguments (a
    plugin that never declared its contract version gets the core's, so the registry could
    not tell), naming the change and the port instead of a TypeError from deep in a step."""
    if type(handle) in _SIGNATURES_OK:
        return
    try:
        signature = inspect.signature(handle.generate)
    except (TypeError, ValueError):  # a builtin or a proxy: nothing to read
        return
    old = sorted(_V1_SAMPLING_NAMES & set(signature.parameters))
    try:
        signature.bind([], SamplingParams(n=1, max_tokens=1, temperature=0.0, seed=0))
    except TypeError as err:
        old = old or [str(err)]
    if old:
        raise ProtocolError(
            f"backend '{backend}' (generation): generate{signature} cannot take "
            f"(prompt_ids, params) ({', '.join(old)}).{porting_note('1.0')}",
            backend=backend, role="generation", method="generate",
        )
    _SIGNATURES_OK.add(type(handle))


class GuardedGeneration:
    """The generation handle with every result checked (see the module doc).

    The run replaces :attr:`handle` in place when it starts the generation again after a
    lost worker (:mod:`rlcore.app.recovery`): envs hold this object, so their next call
    reaches the new engine."""

    def __init__(
        self, handle: GenerationHandle, backend: str, eos_ids: Collection[int] = ()
    ) -> None:
        self.handle = handle
        self.backend = backend
        self.eos_ids = frozenset(eos_ids)

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Sample]]:
        _check_generate_signature(self.handle, self.backend)
        with losses_tagged("generation"):
            out = self.handle.generate(prompt_ids, params)
        who = Caller(self.backend, "generation", "generate")
        return check_samples(out, len(prompt_ids), params.n, params.max_tokens, who, self.eos_ids)

    def logprobs(self, batch: Sequence[Pair]) -> list[list[float]]:
        who = Caller(self.backend, "generation", "logprobs")
        with losses_tagged("generation"):
            rows = self.handle.logprobs(batch)
        return check_logprobs(rows, batch, who)

    def weight_versions(self) -> list[int] | None:
        """The weight version of each engine (:class:`rlcore.handles.WeightVersioned`), or
        None for a handle that cannot say."""
        if not isinstance(self.handle, WeightVersioned):
            return None
        with losses_tagged("generation"):
            versions = self.handle.weight_versions()
        return check_weight_versions(versions, Caller(self.backend, "generation", "weight_versions"))

    def shutdown(self) -> None:  # the run shuts the real handle down; never this view
        raise RuntimeError("GuardedGeneration is a view; shut down the handle itself")


class GuardedEnv:
    """The env handle with every result checked (see the module doc).

    Every env makes scored rollouts (``collect_rollouts``). A prompt-and-score env
    (:class:`rlcore.handles.PromptAndScoreEnv`) also lends a loop its two halves, for loops that
    sample themselves (several turns, say): ``sample_prompts`` and ``score``."""

    def __init__(self, handle: EnvHandle, backend: str) -> None:
        self.handle = handle
        self.backend = backend

    def collect_rollouts(self, request: RolloutRequest) -> list[list[Rollout]]:
        out = self.handle.collect_rollouts(request)
        return check_rollouts(out, request, Caller(self.backend, "env", "collect_rollouts"))

    def _half(self, method: str) -> Any:
        fn = getattr(self.handle, method, None)
        if not callable(fn):
            raise ConfigError(
                f"env backend '{self.backend}' makes its own rollouts (collect_rollouts) and has no "
                f"{method}(): a loop that samples itself needs a prompt-and-score env "
                "(rlcore.handles.PromptAndScoreEnv, e.g. env.backend=arithmetic)",
                key="env.backend",
            )
        return fn

    def sample_prompts(self, n: int, step: int) -> list[Any]:
        """``n`` prompts for ``step``, each with its ``text`` (the same step gives the same)."""
        who = Caller(self.backend, "env", "sample_prompts")
        prompts = self._half("sample_prompts")(n, step)
        if not isinstance(prompts, Sequence) or len(prompts) != n:
            raise who.fail(f"{n} prompts", _brief(prompts))
        for i, p in enumerate(prompts):
            if not isinstance(getattr(p, "text", None), str):
                raise who.fail(f"prompt {i}: an object with a text attribute (str)", _brief(p))
        return list(prompts)

    def score(self, prompts: Sequence[Any], completions: Sequence[Sequence[str]]) -> list[list[float]]:
        """One finite reward per completion text, per prompt."""
        who = Caller(self.backend, "env", "score")
        out = self._half("score")(prompts, completions)
        if not isinstance(out, Sequence) or len(out) != len(completions):
            raise who.fail(f"one row of rewards per prompt ({len(completions)} rows)", _brief(out))
        rows = []
        for i, (row, texts) in enumerate(zip(out, completions, strict=True)):
            if not isinstance(row, Sequence) or len(row) != len(texts):
                raise who.fail(f"prompt {i}: {len(texts)} rewards (one per completion)", _brief(row))
            for r in row:
                if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r):
                    raise who.fail(f"prompt {i}: finite float rewards", _brief(r))
            rows.append([float(r) for r in row])
        return rows
