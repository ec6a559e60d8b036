from typing import Any

from rlcore.declarations import validate_declaration
from rlcore_arithmetic.options import ArithmeticOptions
from rlcore_arithmetic.plugin import ArithmeticEnv, rlcore_declare_backend
from rlcore_arithmetic.task import Prompt, make_prompts, parse_answer, reward


def test_prompts_are_seeded_and_correct() -> None:
    a = make_prompts(20, seed=3, ops="+-*")
    assert a == make_prompts(20, seed=3, ops="+-*")
    assert a != make_prompts(20, seed=4, ops="+-*")
    for p in a:
        assert eval(p.text.rstrip("=")) == p.answer


def test_reward_partial_credit_ordering() -> None:
    p = Prompt("3+4=", 7)
    assert reward(p, "7") == 1.0
    assert reward(p, "7</s>") == 1.0
    assert reward(p, "8") < 1.0 and reward(p, "8") > reward(p, "30") >= 0.3
    assert reward(p, "x7") == 0.0 and reward(p, "") == 0.0
    assert parse_answer("-3abc") == -3


def test_env_scores_groups() -> None:
    env = ArithmeticEnv(ArithmeticOptions())
    prompts = env.sample_prompts(2, step=0)
    scores = env.score(prompts, [[str(p.answer), "no"] for p in prompts])
    assert [s[0] for s in scores] == [1.0, 1.0] and [s[1] for s in scores] == [0.0, 0.0]
    assert env.sample_prompts(4, 1) != env.sample_prompts(4, 2)


def test_declaration_valid() -> None:
    d = validate_declaration(rlcore_declare_backend(), plugin="arithmetic", distribution="rlcore-arithmetic")
    assert d.name == "arithmetic" and d.option_names() == ["max_operand", "ops", "seed"]


def test_rollouts_keep_the_samples_weight_versions() -> None:
    """The env samples through the run's generation; each rollout keeps the weight version
    of each of its tokens when the sample carries them (and has none when it does not)."""
    from rlcore.handles import RolloutRequest

    class Tokenizer:
        def __call__(self, text: str) -> Any:
            return type("Enc", (), {"input_ids": [ord(c) for c in text]})()

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(i) for i in ids)

    class Generation:
        def generate(self, prompt_ids: list[list[int]], params: Any) -> list[list[dict[str, Any]]]:
            answer = [ord("7"), ord("!")]
            return [
                [{"token_ids": answer, "logprobs": [-0.1, -0.2], "versions": [4, 5]},
                 {"token_ids": answer, "logprobs": [-0.1, -0.2]}]
                for _ in prompt_ids
            ]

    env = ArithmeticEnv(ArithmeticOptions())
    request = RolloutRequest(
        step=1, prompts=2, samples_per_prompt=2, max_new_tokens=4, temperature=1.0, seed=0,
        generation=Generation(), tokenizer=Tokenizer(),  # type: ignore[arg-type]
    )
    groups = env.collect_rollouts(request)
    assert [[r.get("versions") for r in g] for g in groups] == [[[4, 5], None]] * 2
    prompts = env.sample_prompts(2, 1)
    assert [g[0]["prompt_ids"] for g in groups] == [[ord(c) for c in p.text] for p in prompts]


def test_extra_draws_give_other_prompts_repeatably() -> None:
    env = ArithmeticEnv(ArithmeticOptions(max_operand=50))
    own = env.sample_prompts(6, 3)
    extra = env.sample_extra_prompts(6, 3, 1)
    assert extra == env.sample_extra_prompts(6, 3, 1)
    assert extra != own and extra != env.sample_extra_prompts(6, 3, 2) and extra != env.sample_prompts(6, 4)
    assert rlcore_declare_backend().extra_draws
