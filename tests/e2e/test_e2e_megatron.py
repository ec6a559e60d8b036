"""End to end on the Megatron backend: ``examples/megatron.yaml`` on real backends.

* the plan's shape (``rlcore plan --json``);
* one shared run (module fixture): setup overlap within 15 % of the critical
  path, every refit exact, the reward rises;
* Megatron policy -> vLLM generation: refit exact after every step;
* generation not refit-fed: the policy publishes the converted checkpoint, the
  generation starts at once, waits for it inside its init and serves the
  policy's weights from it (checked before ``refit:initial`` overwrites them).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("rlcore_megatron")

from rlcore.app.grpo import token_mult_prob_error  # noqa: E402
from rlcore.app.records import read_metrics  # noqa: E402
from rlcore.app.run import run_job  # noqa: E402
from rlcore.hookspecs import hookimpl  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "megatron.yaml")
STEPS = 14
PROBE = [([2, 8, 15, 8, 24], [10, 3]), ([2, 6, 15, 7, 24], [11, 3]), ([2, 5, 15, 4], [24, 3])]


def records(run_dir: Path) -> list[dict[str, Any]]:
    return read_metrics(run_dir / "metrics.jsonl")


def refit_errors(run_dir: Path) -> list[float]:
    return [
        r["refit/token_mult_prob_error"]
        for r in records(run_dir)
        if "refit/token_mult_prob_error" in r
    ]


def spans(run_dir: Path) -> dict[str, dict[str, Any]]:
    trace = json.loads((run_dir / "trace.json").read_text())
    return {
        e["name"]: e
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e["name"].startswith(("init:", "refit:"))
    }


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("megatron")
    cache = tmp_path_factory.mktemp("cache")
    return run_job(
        EXAMPLE, [f"grpo.steps={STEPS}", f"setup.cache_dir={cache}"], out=str(out / "run")
    )


def test_plan_shape() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rlcore", "plan", EXAMPLE, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    plan = json.loads(out.stdout)
    edges = {(e["from"], e["to"]) for e in plan["edges"]}
    assert {t["name"]: t["backend"] for t in plan["tasks"]} == {
        "init:policy": "megatron",
        "init:generation": "megatron",
        "init:env": "arithmetic",
        "refit:initial": None,
    }
    # No path between the two inits (no edge, no wait), refit:initial after both.
    assert edges == {("init:policy", "refit:initial"), ("init:generation", "refit:initial")}
    assert plan["waits"] == []
    assert ["init:policy", "init:generation"] in plan["overlapping"]
    assert plan["refit_transport"] == "collective"


def test_setup_overlap_is_within_15_percent_of_the_critical_path(megatron_run: Path) -> None:
    setup = records(megatron_run)[0]
    total = setup["timing/setup/total_setup_time_s"]
    critical = setup["timing/setup/critical_path_s"]
    assert total <= 1.15 * critical, setup
    assert total < setup["timing/setup/serial_sum_s"]
    s = spans(megatron_run)
    assert abs(s["init:policy"]["ts"] - s["init:generation"]["ts"]) < 0.5e6  # started together
    refit_start = s["refit:initial"]["ts"]
    for name in ("init:policy", "init:generation"):
        assert refit_start >= s[name]["ts"] + s[name]["dur"] - 1e3  # refit after both


def test_every_refit_is_exact(megatron_run: Path) -> None:
    steps = [r for r in records(megatron_run) if "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    errors = refit_errors(megatron_run)
    assert len(errors) == STEPS + 1 and all(1.0 <= e < 1.05 for e in errors), errors
    assert all(r["refit/transport"] == "collective" and r["refit/bytes"] > 0 for r in steps)
    # Generation's own sample logprobs agree with the policy's too.
    assert all(r["train/gen_vs_policy_mult_prob_error"] < 1.05 for r in steps)


def test_reward_rises(megatron_run: Path) -> None:
    rewards = [r["reward/mean"] for r in records(megatron_run) if "reward/mean" in r]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.2, rewards


def test_megatron_policy_to_vllm_refit_is_exact(tmp_path: Path) -> None:
    pytest.importorskip("rlcore_vllm")
    run = run_job(
        EXAMPLE,
        ["generation.backend=vllm", "grpo.steps=2", f"setup.cache_dir={tmp_path / 'cache'}"],
        out=str(tmp_path / "run"),
    )
    errors = refit_errors(run)
    assert len(errors) == 3 and all(1.0 <= e < 1.001 for e in errors), errors
    steps = [r for r in records(run) if "reward/mean" in r]
    assert all(r["refit/transport"] == "collective" for r in steps)
    assert all(r["train/gen_vs_policy_mult_prob_error"] < 1.05 for r in steps)


class BeforeFirstRefit:
    """Test-only wrapper plugin: at refit:initial, records both handles' info and how the
    generation's weights (from the checkpoint) compare with the policy's, before the refit."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    @hookimpl(wrapper=True)
    def rlcore_refit(self, policy: Any, generation: Any, ctx: Any) -> Any:
        if ctx.step == 0:
            self.seen = {
                "policy": dict(policy.info),
                "generation": dict(generation.info),
                "error": token_mult_prob_error(generation.logprobs(PROBE), policy.logprobs(PROBE)),
            }
        return (yield)


def test_checkpoint_mode_generation_waits_for_the_published_checkpoint(tmp_path: Path) -> None:
    from rlcore.config import load_config
    from rlcore.setup.prepared import prepare
    from rlcore.setup.registry import load_registry

    overrides = [
        "generation.refit_fed=false",
        "grpo.steps=1",
        f"setup.cache_dir={tmp_path / 'cache'}",
    ]
    plan = prepare(load_config(EXAMPLE, overrides), load_registry(None)).plan
    assert [(w.task, w.target, w.producer, w.kind) for w in plan.waits] == [
        ("init:generation", "megatron.checkpoint", "init:policy", "artifact")
    ]
    assert not plan.has_path("init:policy", "init:generation")  # a wait, not an edge
    probe = BeforeFirstRefit()
    run = run_job(EXAMPLE, overrides, out=str(tmp_path / "run"), extra_plugins=[("probe", probe)])
    pol, gen = probe.seen["policy"], probe.seen["generation"]
    published = Path(pol["checkpoint"])
    assert gen["checkpoint"] == str(published) and published.parent.name == "megatron.checkpoint"
    assert (published / "rlcore_megatron.json").is_file()
    assert not gen["refit_fed"]
    # It started before the checkpoint existed and went on only once it was published
    # (the clocks are the same: both inits run in this process).
    assert gen["started_at"] < pol["checkpoint_published_at"] <= gen["checkpoint_at"] + 0.5
    assert probe.seen["error"] < 1.001  # it serves the policy's weights, from the checkpoint
    s = spans(run)
    assert abs(s["init:policy"]["ts"] - s["init:generation"]["ts"]) < 0.5e6  # started at once
    errors = refit_errors(run)
    assert len(errors) == 2 and all(e < 1.05 for e in errors)
