"""The conformance suite catches deliberately broken backends, each naming the backend and rule.

Every broken backend is rlcore's reference peer (:mod:`rlcore.testing.peers`) with
exactly one rule broken: a worker subclass that misbehaves in one method, a
driver-side handle that mangles one result, or a declaration that claims one thing
too many. To stay fast, all of them drive the same two Ray actors (a reference
policy and a reference generation started once for this module): each init resets
the actors to the checkpoint's weights and switches on the case's fault.

The suite runs in-process once, over one generated test class per case; for each
case the test asserts which suite tests failed, and that the failure message of the
test that owns the rule names the backend and the rule.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import textwrap
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from rlcore.declarations import BackendDeclaration, Role, Transport
from rlcore.handles import PromptAndScoreEnv
from rlcore.hookspecs import hookimpl
from rlcore.testing.peers import (
    REFERENCE_TRANSPORTS,
    ReferenceGeneration,
    ReferenceGenerationWorker,
    ReferencePlugin,
    ReferencePolicy,
    ReferencePolicyWorker,
)

# -- faulty workers (one shared actor each; the fault is switched at every init) ------------


class FaultyPolicyWorker(ReferencePolicyWorker):
    """The reference policy worker, with a fault switch and a reset to the checkpoint."""

    fault = ""

    def reset(self, fault: str) -> None:
        if not hasattr(self, "base"):
            self.base = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.model.load_state_dict(self.base)
        self.fault = fault

    def train_step(self, rows: list, advantages: list, old: Any, clip_eps: float, lr: float) -> dict:
        if self.fault == "train_step_noop":
            return {"loss": 0.0, "grad_norm": 0.0}
        if self.fault == "loss_sign_flipped":  # minimises what it should maximise
            return super().train_step(rows, [-a for a in advantages], old, clip_eps, lr)
        if self.fault == "grads_not_reset":  # each backward adds to the last step's gradients
            from rlcore.testing.reference import reference_grpo_step

            old = old if old is not None else self.logprobs(rows)
            out = reference_grpo_step(self.model, rows, advantages, old, lr=lr, clip_eps=clip_eps)
            return {k: float(v) for k, v in out.items() if k != "state"}
        if self.fault == "lr_fixed":  # trains at its own learning rate, whatever it is given
            lr = 1e-3
        out = super().train_step(rows, advantages, old, clip_eps, lr)
        if self.fault == "tokens_are_rows":  # counts completions, not their tokens
            out["tokens"] = float(len(rows))
        if self.fault == "clip_fraction_never":  # a metric left at its initial value
            out["clip_fraction"] = 0.0
        return out

    def load_checkpoint(self, directory: str) -> None:
        if self.fault != "checkpoint_load_ignored":  # says it loaded, keeps its weights
            super().load_checkpoint(directory)

    def export_stream(self) -> Any:
        import torch

        stream = super().export_stream()
        if self.fault != "export_float64":  # a cast left in the export: not the declared dtype
            return stream
        return ((n, t.to(torch.float64)) for n, t in stream)

    def logprobs(self, rows: list) -> list[list[float]]:
        if self.fault != "policy_logprobs_scaled":
            return super().logprobs(rows)
        import torch

        out = []
        with torch.no_grad():
            for p, c in rows:
                logits = self.model(input_ids=torch.tensor([list(p) + list(c)])).logits[0, :-1]
                logp = (logits.float() / 0.7).log_softmax(-1)
                out.append([logp[len(p) - 1 + j, t].item() for j, t in enumerate(c)])
        return out


class FaultyGenerationWorker(ReferenceGenerationWorker):
    """The reference generation worker, with a fault switch and a reset to the checkpoint."""

    fault = ""

    def reset(self, fault: str, empty: bool) -> None:
        if not hasattr(self, "base"):
            self.base = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.model.load_state_dict(self.base)
        self.fault, self.ready, self.lagged = fault, not empty, None
        self.loaded_version = 0  # a new engine: no refit yet
        self.seen: dict[int, int] = {}  # calls per seed ("unseeded")

    def token_logprobs(self, logits: Any, temperature: float) -> Any:
        if self.fault == "temperature_scaled" and temperature > 0:
            return (logits / temperature).log_softmax(-1)
        return super().token_logprobs(logits, temperature)

    def stop_tokens(self) -> frozenset[int]:
        return frozenset() if self.fault == "tokens_after_eos" else super().stop_tokens()

    def pick(self, logits: Any, temperature: float, gen: Any) -> int:
        if self.fault == "never_eos":
            logits = logits.clone()
            logits[list(self.eos_ids)] = -math.inf
        return super().pick(logits, temperature, gen)

    def sample_one(self, prompt: list[int], max_tokens: int, temperature: float, seed: int) -> dict:
        if self.fault == "too_many_tokens":
            max_tokens += 1
        out = super().sample_one(prompt, max_tokens, temperature, seed)
        if self.fault == "drops_eos" and out["token_ids"][-1] in self.eos_ids:
            out = {"token_ids": out["token_ids"][:-1] or [0], "logprobs": out["logprobs"][:-1] or [-1.0]}
        if self.fault == "versions_short":
            out["versions"] = out["versions"][:-1]
        return out

    def generate(self, prompts: list, first: int, params: Any) -> list:
        seed = params.seed
        if self.fault == "seed_ignored":
            seed = 0
        elif self.fault == "unseeded":
            # Each repeat of a seed samples anew. Not the clock: a random seed could leave the
            # EOS probe of another rule without an EOS and fail a test this case does not own.
            self.seen[seed] = self.seen.get(seed, -1) + 1
            seed += 7919 * self.seen[seed]
        return super().generate(prompts, first, dataclasses.replace(params, seed=seed))

    def logprobs(self, rows: list) -> list[list[float]]:
        if self.fault == "logprobs_off_by_one":  # the logprob of the token before each one
            rows = [(p[:-1], [p[-1], *c[:-1]]) if c else (p, c) for p, c in rows]
        return super().logprobs(rows)

    def receive_weights(self, spec: Any, step: int, buckets: list) -> int:
        if self.fault == "only_collective" and spec.transport != "collective":
            return 0  # takes the call, loads nothing: only its collective path is real
        version, loaded = self.loaded_version, super().receive_weights(spec, step, buckets)
        if self.fault == "versions_not_refit":  # loads the weights, keeps reporting the old version
            self.loaded_version = version
        return loaded

    def load(self, state: dict[str, Any]) -> None:
        if self.fault == "refit_ignores_weights":
            return
        if self.fault == "refit_partial":
            state = {k: v for k, v in state.items() if ".layers.1." not in k}
            self.model.load_state_dict(state, strict=False)
            return
        if self.fault == "refit_stale":  # loads the weights of the refit before
            state, self.lagged = (self.lagged or self.base), state
        super().load(state)


# -- driver side: handles over the shared actors ------------------------------------------------

#: The shared worker groups, by role (set by the ``shared`` fixture).
SHARED: dict[Role, Any] = {}
#: Actors the ``leaks_actor`` case starts and never stops (killed by the ``shared`` fixture).
LEFTOVERS: list[Any] = []


class Leftover:
    """A helper actor; Ray may run it in a worker process that existed before the test."""

    def ping(self) -> bool:
        return True


class SharedPolicy(ReferencePolicy):
    fault = ""

    def logprobs(self, batch: Any) -> list[list[float]]:
        out = super().logprobs(batch)
        return [row[:-1] for row in out] if self.fault == "policy_wrong_shape" else out

    def shutdown(self) -> None:  # leaves the shared actor running; drops its channels
        if not self._closed:
            self._closed = True
            self.group.call("close_refit_channels", what="close channels")


class SharedGeneration(ReferenceGeneration):
    fault = ""

    def logprobs(self, batch: Any) -> list[list[float]]:
        out = super().logprobs(batch)
        return out[:-1] if self.fault == "wrong_shape_logprobs" else out

    def generate(self, prompt_ids: Any, params: Any) -> list[list[Any]]:
        out = super().generate(prompt_ids, params)
        if self.fault == "unequal_lengths":
            return [[{**s, "logprobs": s["logprobs"][:-1]} for s in g] for g in out]
        if self.fault == "wrong_n":
            return [g[:-1] for g in out]
        if self.fault == "positive_logprobs":
            return [[{**s, "logprobs": [-x for x in s["logprobs"]]} for s in g] for g in out]
        return out

    shutdown = SharedPolicy.shutdown


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str


class ToyEnv(PromptAndScoreEnv):
    """Asks for a digit; reward 1 if the completion contains it."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.calls = 0

    def sample_prompts(self, n: int, step: int) -> list[Prompt]:
        self.calls += 1
        salt = self.calls if self.fault == "env_nondeterministic" else 0
        return [Prompt(f"{(step + i + salt) % 10}=", str((step + i + salt) % 10)) for i in range(n)]

    def score(self, prompts: Any, completions: Any) -> list[list[float]]:
        bad = math.nan if self.fault == "env_nan_reward" else None
        return [
            [bad if bad is not None else float(p.answer in c) for c in group]
            for p, group in zip(prompts, completions, strict=True)
        ]

    def collect_rollouts(self, request: Any) -> list[list[Any]]:
        out = super().collect_rollouts(request)
        if self.fault == "env_wrong_group_size":
            return [g[:-1] for g in out]
        if self.fault == "env_missing_logprobs":
            return [[{k: v for k, v in r.items() if k != "logprobs"} for r in g] for g in out]
        return out


class BrokenPlugin(ReferencePlugin):
    """The reference peer on the shared actors, with one fault (see the module doc)."""

    def __init__(self, name: str, fault: str = "", *, env: bool = False, receive: Any = None) -> None:
        self.name, self.fault = name, fault
        self.roles = frozenset({Role.POLICY, Role.GENERATION} | ({Role.ENV} if env else set()))
        self.receive = receive

    def __repr__(self) -> str:
        return f"BrokenPlugin('{self.name}')"

    @hookimpl
    def rlcore_declare_backend(self) -> BackendDeclaration:
        decl = super().rlcore_declare_backend()
        if self.receive is None:
            return decl
        return BackendDeclaration(**{**vars(decl), "receive_transports": self.receive})

    def _start(self, ctx: Any, worker: type, handle: type, empty: bool) -> Any:
        ctx.cancel.raise_if_cancelled(ctx.task)
        ctx.deadline.raise_if_expired(ctx.task)
        if self.fault == "leaks_actor":  # a helper actor its shutdown forgets
            import ray

            LEFTOVERS.append(ray.remote(num_cpus=0)(Leftover).remote())
        group = SHARED[ctx.role]
        args = (self.fault,) if ctx.role is Role.POLICY else (self.fault, empty)
        group.call("reset", *args, what="reset")
        cls = SharedPolicy if ctx.role is Role.POLICY else SharedGeneration
        h = cls(group, group.call("weight_specs", what="specs")[0])
        h.fault = self.fault
        return h

    @hookimpl
    def rlcore_init_env(self, ctx: Any) -> ToyEnv:
        ctx.cancel.raise_if_cancelled(ctx.task)
        return ToyEnv(self.fault)


@dataclass(frozen=True)
class Case:
    """One broken backend: what it breaks, which suite tests must fail, and the words
    the owning test's message must contain (besides the backend's name)."""

    plugin: Any
    rule: str
    fails: frozenset[str]
    owner: str
    words: tuple[str, ...]

    @property
    def name(self) -> str:
        return str(self.plugin.name)


GEN = ("test_generate_samples", "test_generate_stops_at_eos", "test_generate_is_seeded",
       "test_generate_logprobs_at_temperature_1")
TRIPS = ("test_refit_round_trip", "test_refit_fed_round_trip")
VERSIONS = "test_weight_versions_before_refit"
SEM = "test_train_step_semantics[float32]"


def case(fault: str, rule: str, fails: tuple[str, ...], words: tuple[str, ...], **kw: Any) -> Case:
    return Case(BrokenPlugin(f"broken-{fault.replace('_', '-')}", fault, **kw), rule,
                frozenset(fails), fails[0], words)


CASES = [
    case("wrong_shape_logprobs", "generation logprobs(): one row per pair",
         ("test_logprobs_shape", "test_logprobs_agree", "test_generate_logprobs_at_temperature_1",
          *TRIPS),
         ("logprobs()", "one row per pair")),
    case("policy_wrong_shape", "policy logprobs(): one logprob per completion token",
         ("test_logprobs_shape", "test_logprobs_agree", "test_generate_logprobs_at_temperature_1", *TRIPS),
         ("policy backend", "logprobs()", "one per token")),
    case("unequal_lengths", "generate(): one logprob per token id", GEN,
         ("generate()", "logprobs (one per token)")),
    case("temperature_scaled", "generate() logprobs at temperature 1",
         ("test_generate_logprobs_at_temperature_1",),
         ("generate()", "temperature 0.7", "temperature 1")),
    case("refit_ignores_weights", "refit loads the weights it receives", TRIPS,
         ("did not change what the engine computes",)),
    case("refit_partial", "refit loads every weight", TRIPS,
         ("did not change what the engine computes",)),
    case("refit_stale", "refit loads this step's weights", TRIPS,
         ("did not change what the engine computes",)),
    case("only_collective", "every declared transport works (disk, shm declared; only collective real)",
         TRIPS, ("over disk", "did not change what the engine computes")),
    case("http_transport", "declared transports exist (http was removed)",
         ("test_declaration_is_valid", "test_registers_cleanly", "test_logprobs_shape",
          "test_logprobs_agree", "test_env_collect_rollouts", *GEN, *TRIPS,
          *(f"test_init_and_shutdown[{r.value}]" for r in Role)),  # nothing registers
         ("'http' is not a valid Transport",), receive={"disk", "http"}),
    case("cuda_ipc_on_cpu", "declared transports run on this host (cuda_ipc without CUDA)", TRIPS,
         ("'cuda_ipc'", "no CUDA"), receive=set(REFERENCE_TRANSPORTS) | {Transport.CUDA_IPC}),
    # (the short samples of the seeding and temperature tests happen not to reach EOS)
    case("tokens_after_eos", "sampling stops after EOS",
         ("test_generate_samples", "test_generate_stops_at_eos"), ("generate()", "after EOS")),
    case("drops_eos", "EOS is kept as the last token", ("test_generate_stops_at_eos",),
         ("EOS rule of generate()", "without ending with EOS")),
    case("never_eos", "sampling can end with EOS", ("test_generate_stops_at_eos",),
         ("EOS rule of generate()", "ended with EOS")),
    case("seed_ignored", "different seeds give different samples", ("test_generate_is_seeded",),
         ("seeding rule", "identical samples")),
    case("unseeded", "the same seed gives the same samples", ("test_generate_is_seeded",),
         ("seeding rule", "gave different samples")),
    case("wrong_n", "generate(): n samples per prompt", GEN, ("generate()", "n=4 samples")),
    case("too_many_tokens", "generate(): at most max_tokens tokens", GEN,
         ("generate()", "1 to max_tokens=16 tokens")),
    case("positive_logprobs", "logprobs are log-probabilities (<= 0)", GEN,
         ("generate()", "log-probabilities (<= 0")),
    case("logprobs_off_by_one", "generation logprobs(): of each completion token given what precedes it",
         ("test_logprobs_agree", "test_generate_logprobs_at_temperature_1", *TRIPS),
         ("different logprobs of the same tokens",)),
    case("policy_logprobs_scaled", "policy logprobs() at temperature 1",
         ("test_logprobs_agree", "test_generate_logprobs_at_temperature_1", *TRIPS),
         ("different logprobs of the same tokens", "temperature 1")),
    case("train_step_noop", "train_step() changes the policy", TRIPS,
         ("train_step must change the policy's weights",)),
    case("loss_sign_flipped", "a step moves logprobs in the direction of the advantages",
         (SEM,), ("loss", "sign")),
    case("grads_not_reset", "a step's gradient is its own batch's", (SEM,),
         ("gradients of an earlier step carried over",)),
    case("tokens_are_rows", "train_step() reports the batch's completion tokens", (SEM,),
         ("tokens=4", "10 completion tokens")),
    case("lr_fixed", "train_step() steps at the lr it is given", (SEM,), ("lr=0.001", "lr=0.002")),
    case("clip_fraction_never", "train_step() reports the share of clipped tokens", (SEM,),
         ("clip_fraction=0.0000", "stale old logprobs")),
    case("export_float64", "the refit export is in the declared dtype", (SEM, *TRIPS),
         ("model.dtype=float32", "float64")),
    case("leaks_actor", "shutdown() releases every Ray actor it started",
         ("test_init_and_shutdown[policy]", "test_init_and_shutdown[generation]", *TRIPS),
         ("Ray actor Leftover", "still alive")),
    case("versions_not_refit", "a refit of step t moves the engine's weight version to t", TRIPS,
         ("reports weight versions [0]", "expected 1")),
    case("versions_short", "generate(): one weight version per token", (*GEN, VERSIONS),
         ("generate()", "versions (one per token)")),
    case("env_wrong_group_size", "collect_rollouts(): samples_per_prompt per group",
         ("test_env_collect_rollouts",), ("collect_rollouts()", "2 rollouts"), env=True),
    case("env_nan_reward", "collect_rollouts(): finite rewards", ("test_env_collect_rollouts",),
         ("collect_rollouts()", "finite float reward"), env=True),
    case("env_missing_logprobs", "collect_rollouts(): logprobs of every rollout",
         ("test_env_collect_rollouts",), ("collect_rollouts()", "prompt_ids, token_ids, logprobs, reward"),
         env=True),
    case("env_nondeterministic", "collect_rollouts(): a step's prompts are deterministic",
         ("test_env_collect_rollouts",), ("collect_rollouts()", "different prompts"), env=True),
]

#: The unbroken reference on the shared actors: passes every selected test.
CASES.append(
    case("checkpoint_load_ignored", "load_checkpoint() restores the saved state",
         ("test_checkpoint_round_trip",), ("after load_checkpoint", "the weights did not come back")),
)

HONEST = Case(BrokenPlugin("broken-none"), "none", frozenset(), "", ())

#: The suite tests run against every case (the cheap ones that exercise the handles).
SELECTED = (
    "test_declaration_is_valid", "test_registers_cleanly", "test_init_and_shutdown",
    "test_logprobs_shape", "test_logprobs_agree", *GEN, "test_env_collect_rollouts",
)
#: The cases the training test runs for (it is the only test these faults reach).
TRAINING = ("none", "loss-sign-flipped", "grads-not-reset", "tokens-are-rows", "lr-fixed",
            "clip-fraction-never", "export-float64")
#: The cases the checkpoint round trip runs for.
CHECKPOINTS = ("none", "checkpoint-load-ignored")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One Ray cluster and one reference policy and generation actor for every case."""
    import ray

    from rlcore.config import ClusterConfig, ModelConfig
    from rlcore.models.tiny import ensure_model
    from rlcore.runtime.cluster import Cluster
    from rlcore.runtime.worker_group import WorkerGroup

    ray_pickle = ray.cloudpickle
    ray_pickle.register_pickle_by_value(sys.modules[__name__])
    cluster = Cluster(ClusterConfig(num_cpus=2)).start()
    model = str(ensure_model(ModelConfig(), tmp_path_factory.mktemp("cache")))
    groups = []
    try:
        for role, worker in ((Role.POLICY, FaultyPolicyWorker), (Role.GENERATION, FaultyGenerationWorker)):
            groups.append(WorkerGroup(worker, 1, name=f"broken-{role.value}", args=(model, False),
                                      num_cpus=0.25, dist_backend=None))
            SHARED[role] = groups[-1]
        yield
    finally:
        SHARED.clear()
        for actor in LEFTOVERS:
            ray.kill(actor)
        LEFTOVERS.clear()
        for g in groups:
            g.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def outcomes(shared: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Run the suite once over every case; {backend: {test: report}} of the failures and passes."""
    from test_conformance import run_pytest

    root = tmp_path_factory.mktemp("broken")
    holder = types.ModuleType("_rlcore_broken_cases")
    holder.CASES = [*CASES, HONEST]  # type: ignore[attr-defined]
    sys.modules[holder.__name__] = holder
    test_file = root / "test_broken_suite.py"
    test_file.write_text(textwrap.dedent("""
        from _rlcore_broken_cases import CASES
        from rlcore.testing import BackendConformance

        for i, c in enumerate(CASES):
            name = "Test_" + c.name.replace("-", "_")
            globals()[name] = type(name, (BackendConformance,), {
                "plugin": c.plugin, "use_reference_peer": False, "settle_s": 0.5,
                "eos_probe": (4, 16, 1.5),
                # A sender that fails mid-refit leaves the receiver waiting for its bytes
                # until refit.timeout_s (and its shutdown behind it): keep that short.
                "config_overrides": ("refit.timeout_s=10",),
            })
    """))
    def classes(names: Any) -> str:
        return " or ".join(f"Test_broken_{name.replace('-', '_')}" for name in names)

    # The refit round trips (the costliest tests) run for the honest reference and the
    # faults that reach them (a model, refit or transport fault), the training test for
    # the training faults; every other test for every case.
    tripped = ["none", *(c.name.removeprefix("broken-") for c in CASES if c.fails & set(TRIPS))]
    versioned = ["none", *(c.name.removeprefix("broken-") for c in CASES if c.name.startswith("broken-versions"))]
    select = (
        f"{' or '.join(SELECTED)} or (({' or '.join(TRIPS)}) and ({classes(tripped)}))"
        f" or (test_train_step_semantics and ({classes(TRAINING)}))"
        f" or (test_checkpoint_round_trip and ({classes(CHECKPOINTS)}))"
        f" or ({VERSIONS} and ({classes(versioned)}))"
    )
    reports = run_pytest(root, test_file, args=("-k", select))
    out: dict[str, dict[str, Any]] = {}
    for rep in reports:
        cls, test = rep.nodeid.split("::")[-2:]
        backend = cls.removeprefix("Test_").replace("_", "-")
        if rep.failed or (rep.when == "call" and rep.passed):
            out.setdefault(backend, {})
            if rep.failed or test not in out[backend]:
                out[backend][test] = rep
    return out


@pytest.mark.slow
@pytest.mark.parametrize("c", CASES, ids=lambda c: c.name)
def test_broken_backend_is_caught(outcomes: dict[str, dict[str, Any]], c: Case) -> None:
    got = outcomes.get(c.name, {})
    failed = {t for t, rep in got.items() if rep.failed}
    assert failed == set(c.fails), f"{c.name} ({c.rule}): failed {sorted(failed)}"
    message = str(got[c.owner].longrepr)
    assert f"'{c.name}'" in message, message
    for word in c.words:
        assert word in message, f"{word!r} not in: {message}"


@pytest.mark.slow
def test_the_reference_itself_passes(outcomes: dict[str, dict[str, Any]]) -> None:
    """The unbroken shared reference passes every selected test (the cases differ from
    it by their one fault only)."""
    got = outcomes.get("broken-none", {})
    assert got and not [t for t, rep in got.items() if rep.failed], sorted(got)

