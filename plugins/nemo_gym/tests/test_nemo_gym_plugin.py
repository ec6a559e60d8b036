"""The nemo_gym backend without Gym's servers: declaration, light import, options,
row cycling, result parsing (rlcore's conformance suite, with real Gym servers, is
``test_nemo_gym_conformance.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gym_helpers import make_ctx

from rlcore.declarations import Role, validate_declaration
from rlcore.errors import ConfigError, RlcoreError
from rlcore.testing.fixtures import heavy_imports
from rlcore_nemo_gym.handle import rows_for_step, start_env, to_sample
from rlcore_nemo_gym.options import NemoGymOptions
from rlcore_nemo_gym.plugin import rlcore_declare_backend
from rlcore_nemo_gym.servers import find_gym_python

HEAVY = ("torch", "ray", "vllm", "transformers", "nemo_gym", "httpx", "omegaconf", "psutil")


def test_declaration_valid_and_waits_for_the_endpoint() -> None:
    d = validate_declaration(
        rlcore_declare_backend(), plugin="nemo_gym", distribution="rlcore-nemo-gym"
    )
    assert d.name == "nemo_gym" and d.roles == frozenset({Role.ENV})
    assert d.overlap.non_colocated and d.overlap.colocated
    assert [(n.name, n.kind) for n in d.needs] == [("generation.endpoint", "event")]
    assert "Gym servers call the policy model" in d.needs[0].reason
    assert d.options is NemoGymOptions and "env_name" in d.option_names()


def test_plugin_module_imports_nothing_heavy() -> None:
    loaded = heavy_imports("rlcore_nemo_gym.plugin", heavy=HEAVY)
    assert loaded == [], f"rlcore_nemo_gym.plugin imports {loaded}"


def test_unknown_option_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        make_ctx(tmp_path, {"env_nam": "x"})
    assert info.value.key == "env.options.env_nam" and "env.options.env_name" in str(info.value)
    with pytest.raises(ConfigError) as info:
        make_ctx(tmp_path, {"rollout_timeout_s": "soon"})
    assert "rollout_timeout_s" in str(info.value)


def test_missing_gym_venv_names_the_option_and_the_install(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        find_gym_python(str(tmp_path / "nope" / "python"))
    assert info.value.key == "env.options.gym_python"
    assert "install.sh" in str(info.value)
    ctx = make_ctx(tmp_path, {"gym_python": str(tmp_path / "nope" / "python")})
    with pytest.raises(ConfigError, match="gym_python"):
        start_env(ctx)
    assert not (tmp_path / "run" / "nemo_gym").exists()  # nothing was started


@pytest.mark.parametrize("backend", ["vllm", "megatron"])
def test_generation_without_its_endpoint_fails_at_plan_time(backend: str) -> None:
    """The real declarations say the endpoint exists only with serve_openai: the plan
    refuses Gym beside a generation without it, before anything starts."""
    from rlcore.config import load_config
    from rlcore.setup.prepared import prepare
    from rlcore.setup.registry import load_registry

    config = load_config(
        None,
        [f"policy.backend={'fsdp' if backend == 'vllm' else 'megatron'}", f"generation.backend={backend}",
         "env.backend=nemo_gym", "generation.refit_fed=true", "generation.options.serve_openai=false"],
    )
    with pytest.raises(ConfigError, match=f"'{backend}' serves one only when") as info:
        prepare(config, load_registry())
    assert info.value.key == "generation.options.serve_openai"


def test_rows_cycle_by_step() -> None:
    assert rows_for_step(5, 3, 1) == [0, 1, 2]
    assert rows_for_step(5, 3, 2) == [3, 4, 0]
    assert rows_for_step(5, 3, 3) == [1, 2, 3]
    assert rows_for_step(2, 3, 1) == [0, 1, 0]
    assert rows_for_step(5, 3, 7) == rows_for_step(5, 3, 7)


def _turn(prompt: list[int], gen: list[int]) -> dict[str, object]:
    return {
        "type": "message",
        "prompt_token_ids": prompt,
        "generation_token_ids": gen,
        "generation_log_probs": [-0.1 * (i + 1) for i in range(len(gen))],
    }


def test_to_sample_takes_the_last_model_turn() -> None:
    result = {
        "reward": 1,
        "response": {
            "output": [
                _turn([1, 2], [3, 4]),
                {"type": "function_call_output", "output": "sunny"},
                _turn([1, 2, 3, 4, 9, 9], [5]),
            ]
        },
    }
    s = to_sample(result)
    assert s == {
        "prompt_ids": [1, 2, 3, 4, 9, 9],
        "token_ids": [5],
        "logprobs": [-0.1],
        "reward": 1.0,
        "model_turns": 2,
    }


def test_to_sample_rejects_results_without_token_ids_or_reward() -> None:
    with pytest.raises(RlcoreError, match="token ids"):
        to_sample({"reward": 1.0, "response": {"output": [{"type": "message", "content": "hi"}]}})
    with pytest.raises(RlcoreError, match="reward"):
        to_sample({"response": {"output": [_turn([1], [2])]}})
    bad = _turn([1], [2, 3])
    bad["generation_log_probs"] = [-1.0]
    with pytest.raises(RlcoreError, match="logprobs"):
        to_sample({"reward": 0.0, "response": {"output": [bad]}})


def test_example_plan_starts_gym_at_once_and_waits_for_the_endpoint_inside() -> None:
    pytest.importorskip("rlcore_fsdp")
    pytest.importorskip("rlcore_vllm")
    from rlcore.config import load_config
    from rlcore.setup.prepared import prepare
    from rlcore.setup.registry import load_registry

    repo = Path(__file__).resolve().parents[3]
    config = load_config(repo / "examples" / "nemo_gym.yaml")
    plan = prepare(config, load_registry()).plan
    assert plan.predecessors("init:env") == []  # no edge into init:env (rule 5)
    [wait] = [w for w in plan.waits if w.task == "init:env"]
    assert (wait.target, wait.kind, wait.producer) == (
        "generation.endpoint",
        "event",
        "refit:initial",
    )
    assert plan.posts["refit:initial"] == ("generation.endpoint",)
