"""``rlcore.open`` and its :class:`~rlcore.app.session.Session`: what a loop relies on (issue 29).

Fast: bad input refused before anything starts (nothing created, no cluster, the signal
handlers as they were), and the session's services over scripted handles (the devices
handed to the role that needs them, the refit check, training health, a lost generation
replaced, the env's halves checked). Real runs on real backends: ``tests/e2e/test_loops.py``.
"""

from __future__ import annotations

import math
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from test_grpo import CharTokenizer, Model, Sevens, Sleeper

import rlcore
from rlcore.app.grpo import run_grpo
from rlcore.app.guards import GuardedEnv, GuardedGeneration, GuardedPolicy
from rlcore.app.health import TrainingHealthError
from rlcore.app.refit_check import probe_batch
from rlcore.app.session import Handoff, Session, _load, _Run
from rlcore.config import GRPOConfig, RefitConfig, RunConfig
from rlcore.errors import ConfigError, DivergenceError, ProtocolError, WorkerLost
from rlcore.handles import RefitReport, SamplingParams

QUICKSTART = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")


# ---------------------------------------------------------------- open: refused before anything starts


@pytest.mark.parametrize(
    ("config", "overrides", "kw", "key", "text"),
    [
        (QUICKSTART, {"grpo.steps": 0}, {}, "grpo.steps", "at least 1"),
        (QUICKSTART, ["policy.backend=fdsp"], {}, "policy.backend", "fsdp"),
        (QUICKSTART, {"env.backend": None}, {"needs_env": True}, "env.backend", "needs an env"),
        ({"policy": {"backend": "fsdp"}, "grpo": {"stepz": 3}}, (), {}, "grpo.stepz", "grpo.steps"),
        (OmegaConf.load(QUICKSTART), {"refit.check": "prob"}, {}, "refit.check", "sampled"),
    ],
    ids=["mapping-override", "string-override", "needs-env", "dict-config", "omegaconf-config"],
)
def test_open_refuses_bad_input_before_anything_starts(
    no_cluster: None, tmp_path: Path, config: Any, overrides: Any, kw: dict[str, Any], key: str, text: str
) -> None:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        rlcore.open(config, overrides, out=out, quiet=True, **kw)
    assert info.value.key == key and text in str(info.value), str(info.value)
    assert not out.exists()  # nothing created
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # the guard left


def test_open_takes_a_path_a_mapping_an_omegaconf_or_a_run_config() -> None:
    over = {"grpo.prompts_per_step": 3, "generation.backend": "megatron", "setup.task_deadline_s": {"init:policy": 60}}
    from_path = _load(QUICKSTART, over)
    assert from_path.grpo.prompts_per_step == 3 and from_path.generation.backend == "megatron"
    assert from_path.setup.task_deadline_s == {"init:policy": 60}
    for config in (OmegaConf.load(QUICKSTART), dict(OmegaConf.to_container(OmegaConf.load(QUICKSTART))), from_path):
        loaded = _load(config, ["grpo.steps=2", "env.options.max_operand=5"])
        assert loaded.name == "quickstart" and loaded.grpo.steps == 2 and loaded.env.options["max_operand"] == 5
    assert _load(from_path, ()).grpo.prompts_per_step == 3  # a RunConfig is taken as it is


# ---------------------------------------------------------------- the services, scripted handles


NO_ENV = object()


def session(policy: Any = None, generation: Any = None, env: Any = None, **kw: Any) -> Session:
    """A session over scripted handles (the Sevens env unless ``env``; none with NO_ENV)."""
    tok = CharTokenizer()
    config = RunConfig(grpo=GRPOConfig(prompts_per_step=2, samples_per_prompt=3, seed=5), refit=RefitConfig())
    return Session(
        config=config, tokenizer=tok,
        policy=GuardedPolicy(policy or Model(0.5), "pol"),
        generation=GuardedGeneration(generation or Model(0.5), "gen", eos_ids={3}),
        env=None if env is NO_ENV else GuardedEnv(env or Sevens(), "sevens"),
        probe=[([1, 50], [51, 3])],
        refit=lambda step: RefitReport(step, "disk", 1, 1, 0.01),
        **kw,
    )


def test_each_call_hands_the_devices_to_the_role_that_needs_them_once() -> None:
    journal: list[str] = []
    s = session(handoff=Handoff(Sleeper("policy", journal), Sleeper("generation", journal)))
    groups = s.rollouts(1)
    assert journal == ["policy.sleep", "generation.wake"]
    s.generate(1, [[1, 50]])
    s.policy.logprobs([([1, 50], [51])])  # the weights stay in place: no turn
    assert journal == ["policy.sleep", "generation.wake"]
    batch = [(r["prompt_ids"], r["token_ids"]) for g in groups for r in g]
    s.train(1, batch, [0.0] * len(batch))
    assert journal[2:] == ["generation.sleep", "policy.wake"]
    s.refit(1)
    s.check_refit(1)  # the probe: the generation answers
    assert journal[4:] == ["policy.sleep", "generation.wake"]
    s.to_generation()  # an explicit turn always runs
    assert journal[6:] == ["policy.sleep", "generation.wake"]


def test_rollouts_and_generate_default_to_the_configs_grpo_settings() -> None:
    requests: list[Any] = []

    class Recording(Sevens):
        def collect_rollouts(self, request: Any) -> Any:
            requests.append(request)
            return super().collect_rollouts(request)

    s = session(env=Recording())
    groups = s.rollouts(4)
    assert len(groups) == 2 and all(len(g) == 3 for g in groups) and s.now == "step 4"
    r = requests[0]
    assert (r.step, r.prompts, r.samples_per_prompt, r.seed) == (4, 2, 3, 5 * 1_000_003 + 4)
    assert r.generation is s.generation and r.tokenizer is s.tokenizer
    assert s.rollouts(4, prompts=1, samples_per_prompt=2, seed=9) and requests[1].seed == 9
    assert [len(g) for g in s.generate(2, [[1], [1, 2]])] == [1, 1]
    assert [len(g) for g in s.generate(2, [[1], [1, 2]], SamplingParams(2, 4, 1.0, 0))] == [2, 2]
    with pytest.raises(ConfigError, match="need an env"):
        session(env=NO_ENV).rollouts(1)


def test_check_refit_returns_the_error_or_raises_naming_both_backends_and_the_step() -> None:
    s = session()
    assert s.check_refit(2) == pytest.approx(1.0)
    off = session(generation=Model(0.7))
    with pytest.raises(DivergenceError, match=r"refit of step 2, .*'gen'.*'pol' disagree on the probe batch") as info:
        off.check_refit(2)
    assert info.value.step == 2 and info.value.mult_prob_error == pytest.approx(math.exp(0.2))
    with pytest.raises(DivergenceError, match=r"refit of step 2, .*tokens step 3 sampled"):
        off.check_refit(2, generation_logprobs=[[-0.7]], policy_logprobs=[[-0.5]], sampled_by=3)
    unchecked = session(generation=Model(0.7))
    unchecked.config.refit.max_mult_prob_error = None  # refit.max_mult_prob_error=null: measured only
    assert unchecked.check_refit(2) == pytest.approx(math.exp(0.2))
    with pytest.raises(ValueError, match="both"):
        s.check_refit(2, generation_logprobs=[[-0.5]])


def test_train_stops_a_non_finite_step_naming_backend_and_step() -> None:
    class Exploding(Model):
        def train_step(self, *a: Any, **kw: Any) -> dict[str, float]:
            assert kw == {"clip_eps": 0.2, "lr": 0.005}  # config.grpo's
            return {"loss": math.nan, "grad_norm": 1.0}

    with pytest.raises(TrainingHealthError) as info:
        session(policy=Exploding(0.5)).train(7, [([1], [2])], [1.0])
    assert (info.value.backend, info.value.step, info.value.metric) == ("pol", 7, "loss")


class FullStats(Model):
    """A policy that returns every metric the contract names."""

    def train_step(self, *a: Any, **kw: Any) -> dict[str, float]:
        return {"loss": 0.25, "grad_norm": 1.5, "clip_fraction": 0.125, "tokens": 12.0, "lr": kw["lr"]}


@pytest.mark.parametrize("refit_check", ["sampled", "probe"])
def test_train_names_its_metrics_as_rlcore_run_writes_them(refit_check: str) -> None:
    """A library loop's ``s.record({..., **stats})`` and ``rlcore run``'s ``metrics.jsonl``
    name the train step alike (``train/loss``, not ``loss``), with the same values; and
    ``rlcore run``'s loop, which checks every refit, never warns of an unchecked one."""
    stats = session(policy=FullStats(0.5)).train(1, [([1], [2])], [1.0])
    assert stats == {
        "train/loss": 0.25, "train/grad_norm": 1.5, "train/clip_fraction": 0.125, "train/tokens": 12.0,
        "train/lr": 0.005,
    }
    tok, lines = CharTokenizer(), []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_grpo(
            cfg=GRPOConfig(steps=3, prompts_per_step=1, samples_per_prompt=2), tokenizer=tok,
            policy=GuardedPolicy(FullStats(0.5), "pol"), generation=GuardedGeneration(Model(0.5), "gen", eos_ids={3}),
            env=GuardedEnv(Sevens(), "sevens"), refit=lambda step: RefitReport(step, "disk", 1, 1, 0.01),
            probe=probe_batch(tok, 1), on_step=lines.append, refit_check=refit_check,
        )
    assert [m["step"] for m in lines] == [1, 2, 3]
    for line in lines:
        assert {k: line.get(k) for k in stats} == stats, line
        assert not [k for k in line if k in ("loss", "grad_norm")], line


def test_refits_without_ever_a_check_warn_once_per_session() -> None:
    s = session()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.refit(1)
        assert caught == []  # one refit is no pattern yet
        for step in (2, 3, 4):
            s.refit(step)
    assert len(caught) == 1, [str(w.message) for w in caught]
    warned = caught[0]
    assert warned.category is UserWarning and warned.filename == __file__  # at the loop's refit call
    assert "refitted the weights of steps 1 and 2 and never checked a refit" in str(warned.message)
    assert "Session.check_refit(step)" in str(warned.message)

    for first in ("probe", "sampled"):  # a loop that checks, either way, is never warned
        checked = session()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            if first == "sampled":  # step 1 checks refit:initial on its samples, before refit(1)
                checked.check_refit(0, generation_logprobs=[[-0.5]], policy_logprobs=[[-0.5]], sampled_by=1)
            for step in (1, 2, 3):
                checked.refit(step)
                if first == "probe":
                    checked.check_refit(step)
    again = session()  # once per session, not once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.refit(1)
        again.refit(2)
    assert len(caught) == 1


def test_a_lost_generation_worker_is_replaced_and_the_call_runs_again() -> None:
    class DiesOnce(Model):
        def generate(self, *a: Any, **kw: Any) -> Any:
            if not self.calls:
                self.calls.append("died")
                raise WorkerLost("gen: generate: gen rank 0 died", worker="gen rank 0")
            return super().generate(*a, **kw)

    losses: list[tuple[str, int, str]] = []
    s = session(generation=DiesOnce(0.5), on_generation_loss=lambda err, step, phase: losses.append((err.worker, step, phase)))
    assert s.generate(3, [[1]])[0][0]["token_ids"] == [ord("7"), 3]
    assert losses == [("gen rank 0", 3, "generate")]
    with pytest.raises(WorkerLost):  # without replace: the loss ends the run
        session(generation=DiesOnce(0.5)).generate(3, [[1]])


def test_the_env_lends_its_halves_checked_to_a_loop_that_samples_itself() -> None:
    env = GuardedEnv(Sevens(), "sevens")
    prompts = env.sample_prompts(2, 1)
    assert [p.text for p in prompts] == ["3+4=", "3+4="]
    assert env.score(prompts, [["7", "8"], ["7"]]) == [[1.0, 0.0], [1.0]]

    class Broken(Sevens):
        def score(self, prompts: Any, completions: Any) -> Any:
            return [[math.nan] * len(g) for g in completions]

    with pytest.raises(ProtocolError, match="env backend 'broken' broke the contract of score.*finite"):
        GuardedEnv(Broken(), "broken").score(prompts, [["7"], ["7"]])

    class GymLike:
        def collect_rollouts(self, request: Any) -> Any:
            return []

    with pytest.raises(ConfigError, match="'gym' makes its own rollouts.*no score") as info:
        GuardedEnv(GymLike(), "gym").score(prompts, [["7"], ["7"]])  # type: ignore[arg-type]
    assert info.value.key == "env.backend"


def test_a_session_over_handles_records_and_traces_through_its_callbacks() -> None:
    lines: list[tuple[dict[str, Any], int]] = []
    spans: list[tuple[str, int | None]] = []
    s = session(record=lambda m, step: lines.append((m, step)), span=lambda n, a, b, step: spans.append((n, step)))
    s.record({"reward/mean": 0.5}, 2)
    s.span("generate", 0.0, 1.0, step=2)
    assert lines == [({"reward/mean": 0.5}, 2)] and spans == [("generate", 2)]
    s.close()
    s.close()  # nothing to tear down, twice


def test_open_keywords_type_every_option() -> None:
    """Editors and type checkers see open()'s keywords through OpenKeywords; it names
    exactly the options OpenOptions takes (a new option added to one alone fails here)."""
    import dataclasses

    from rlcore.app.session import OpenKeywords, OpenOptions

    assert set(OpenKeywords.__annotations__) == {f.name for f in dataclasses.fields(OpenOptions)}
    with pytest.raises(TypeError, match="outt"):
        rlcore.open(QUICKSTART, outt="/tmp/x")


# ---------------------------------------------------------------- the end of a run


def _ended_run(run_dir: Path, steps: int) -> tuple[Session, _Run, list[BaseException | None]]:
    """A session over a run that recorded ``steps`` steps with a reward (no cluster: the
    run's teardown is recorded, not done)."""
    run = _Run.__new__(_Run)  # the state _end and the plots read, nothing started
    run.config, run.run_dir = RunConfig(name="ended"), run_dir
    run.history = [{"step": i, "time": 100.0 + i, "reward/mean": 0.1 * i} for i in range(1, steps + 1)]
    finished: list[BaseException | None] = []
    run.finish = finished.append  # type: ignore[method-assign]
    s = Session(config=run.config)
    s._run = run
    return s, run, finished


def test_a_failed_run_writes_reward_png_of_its_steps(tmp_path: Path) -> None:
    s, _, finished = _ended_run(tmp_path, steps=3)
    err = RuntimeError("step 4 failed")
    s.__exit__(RuntimeError, err, None)  # the with block raised: the failure stays the run's
    assert finished == [err]
    png = tmp_path / "reward.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_run_ends_with_its_own_error_when_reward_png_cannot_be_written(tmp_path: Path) -> None:
    s, _, finished = _ended_run(tmp_path / "gone" / "run", steps=2)  # no such directory
    err = RuntimeError("step 3 failed")
    s.__exit__(RuntimeError, err, None)
    assert finished == [err]  # not the plot's error
    assert not (tmp_path / "gone").exists()


def test_a_run_that_failed_before_any_step_writes_no_reward_png(tmp_path: Path) -> None:
    s, _, finished = _ended_run(tmp_path, steps=0)
    s.__exit__(RuntimeError, RuntimeError("step 1 failed"), None)
    assert len(finished) == 1 and not (tmp_path / "reward.png").exists()
