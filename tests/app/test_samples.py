"""``samples.jsonl`` (:mod:`rlcore.app.samples`): which samples a step writes, decoded and
bounded, and ``rlcore samples`` reading the newest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore.app.cli import main
from rlcore.app.samples import due, newest, sample_lines, write_samples


class Letters:
    """A tokenizer of letters: id i is chr(97 + i); 0 is special."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(97 + i) for i in ids if not (skip_special_tokens and i == 0))


def rollout(prompt: list[int], tokens: list[int], reward: float, versions: list[int] | None = None) -> Any:
    r = {"prompt_ids": prompt, "token_ids": tokens, "logprobs": [-1.0] * len(tokens), "reward": reward}
    if versions is not None:
        r["versions"] = versions
    return r


def test_one_sample_per_prompt_first_decoded_with_its_oldest_weights() -> None:
    groups = [
        [rollout([1, 2], [3, 0], 0.5), rollout([1, 2], [4], 0.1)],
        [rollout([5], [6], 1.0, versions=[3, 2])],
    ]
    lines = sample_lines(7, groups, Letters(), version=4, per_step=3)
    assert [(x["prompt"], x["completion"], x["reward"], x["weight_version"]) for x in lines] == [
        ("bc", "d", 0.5, 4), ("f", "g", 1.0, 2), ("bc", "e", 0.1, 4),
    ]
    assert all(x["step"] == 7 for x in lines)
    assert len(sample_lines(7, groups, Letters(), version=4, per_step=1)) == 1


def test_due_every_n_steps_and_never_at_zero() -> None:
    assert [s for s in range(1, 10) if due(s, 3)] == [3, 6, 9]
    assert not any(due(s, 0) for s in range(1, 10))


def test_newest_and_the_cli(tmp_path: Path, capsys: Any) -> None:
    write_samples(tmp_path, [{"step": s, "prompt": "p", "completion": f"c{s}", "reward": 0.25, "weight_version": s}
                             for s in (1, 1, 2)])
    assert [x["completion"] for x in newest(tmp_path, 2)] == ["c1", "c2"]
    assert [x["completion"] for x in newest(tmp_path, 0, step=1)] == ["c1", "c1"]
    assert main(["samples", str(tmp_path), "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "step 2  reward 0.250  weights v2" in out and "completion: c2" in out
    assert main(["samples", str(tmp_path), "--step", "5"]) == 1
    assert "no samples of step 5" in capsys.readouterr().err
