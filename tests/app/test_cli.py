"""The CLI as a person uses it: exit codes and messages."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from rlcore.app.cli import _split_overrides, main
from rlcore.declarations import CONTRACT_VERSION

REPO = Path(__file__).resolve().parents[2]


def test_unknown_key_names_closest(capsys, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy:\n  backend: fsdp\ngeneration:\n  backend: vllm\n  refit_fd: true\n")
    assert main(["plan", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "generation.refit_fd" in err and "generation.refit_fed" in err


def test_wrong_type_override_names_key_value_and_type(capsys) -> None:
    assert main(["plan", str(REPO / "examples" / "quickstart.yaml"), "grpo.steps=many"]) == 2
    err = capsys.readouterr().err
    assert "grpo.steps" in err and "many" in err and "int" in err


def test_unknown_backend_names_key_and_choices(capsys, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy:\n  backend: fsdp\ngeneration:\n  backend: vllm\nenv:\n  backend: arithmatic\n")
    assert main(["plan", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "env.backend" in err and "arithmetic" in err


def test_missing_config_file(capsys) -> None:
    assert main(["plan", "does-not-exist.yaml"]) == 2
    assert "does-not-exist.yaml" in capsys.readouterr().err


def test_run_arguments_split() -> None:
    assert _split_overrides(["c.yaml", "a=1", "b=2"]) == ("c.yaml", ["a=1", "b=2"])
    assert _split_overrides(["a=1"]) == (None, ["a=1"])


def test_plugins_json_lists_installed_env(capsys) -> None:
    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = {b["name"]: b for b in data["backends"]}
    assert names["arithmetic"]["distribution"] == "rlcore-arithmetic"
    assert names["arithmetic"]["declaration"]["roles"] == ["env"]


def test_plan_json_of_quickstart(capsys) -> None:
    pytest.importorskip("rlcore_fsdp")
    pytest.importorskip("rlcore_vllm")
    assert main(["plan", str(REPO / "examples" / "quickstart.yaml"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in plan["tasks"]] == ["init:policy", "init:generation", "init:env", "refit:initial"]
    assert not [e for e in plan["edges"] if e["to"].startswith("init:")]  # all inits overlap
    assert {e["from"] for e in plan["edges"] if e["to"] == "refit:initial"} == {"init:policy", "init:generation"}
    assert plan["refit_transport"] == "collective"


def test_plan_shows_what_the_run_saves(capsys) -> None:
    """``rlcore plan`` says when checkpoints are saved, in what format, and whether beside the
    next rollouts; with colocated roles that hand the devices over, not beside them."""
    pytest.importorskip("rlcore_fsdp")
    pytest.importorskip("rlcore_vllm")
    quickstart = str(REPO / "examples" / "quickstart.yaml")
    assert main(["plan", quickstart, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"] is None
    assert main(["plan", quickstart, "checkpoint.every_steps=10", "checkpoint.keep=3"]) == 0
    assert (
        "checkpoints: every 10 steps and after the last, the last 3 kept, in <run dir>/checkpoints; fsdp writes "
        "fsdp-sharded-dcp v1, staged: the loop waits for the copy to host memory, the files are written beside "
        "the next steps; SIGTERM saves the step in progress (within 120s)"
    ) in " ".join(capsys.readouterr().out.split())
    assert main(["plan", quickstart, "checkpoint.every_steps=10", "checkpoint.keep=3", "checkpoint.staged=false"]) == 0
    assert "fsdp-sharded-dcp v1, beside the next step's rollouts;" in " ".join(capsys.readouterr().out.split())
    assert main(["plan", quickstart, "checkpoint.every_steps=10", "checkpoint.overlap=false", "--json"]) == 0
    saves = json.loads(capsys.readouterr().out)["checkpoints"]
    assert saves["overlap"] is False and saves["format"] == "fsdp-sharded-dcp" and saves["every_steps"] == 10
    assert saves["staged"] is True
    assert main(["plan", quickstart, "checkpoint.every_steps=10", "checkpoint.keep_every=50", "--json"]) == 0
    saves = json.loads(capsys.readouterr().out)["checkpoints"]
    assert saves["keep_every"] == 50 and "(and those of every multiple of 50 for good)" in saves["describe"]


def test_plan_shows_the_schedule(capsys) -> None:
    """``rlcore plan`` says how the loop overlaps generation with training; nothing starts."""
    pytest.importorskip("rlcore_fsdp")
    pytest.importorskip("rlcore_vllm")
    quickstart = str(REPO / "examples" / "quickstart.yaml")
    assert main(["plan", quickstart]) == 0
    assert (
        "schedule: synchronous (grpo.max_staleness 0): generation waits through each train step "
        "and refit; fsdp allows grpo.max_staleness up to 8"
    ) in capsys.readouterr().out
    assert main(["plan", quickstart, "grpo.max_staleness=1"]) == 0
    assert (
        "schedule: asynchronous, grpo.max_staleness 1 (fsdp trains on samples up to 8 versions old); "
        "refits land between two engine steps, requests in flight (vllm: when options.serve_openai == False), "
        "per-token versions"
    ) in capsys.readouterr().out
    assert main(["plan", quickstart, "grpo.max_staleness=1", "generation.options.serve_openai=true"]) == 0
    assert (
        "refits land while the engine pauses its requests in flight (vllm: when options.serve_openai == True)\n"
    ) in capsys.readouterr().out
    assert main(["plan", quickstart, "grpo.max_staleness=1", "--json"]) == 0
    schedule = json.loads(capsys.readouterr().out)["schedule"]
    assert schedule["asynchronous"] and schedule["max_staleness"] == 1 and schedule["policy_max"] == 8


@pytest.mark.parametrize(
    ("example", "overrides", "words"),
    [
        ("quickstart.yaml", ["grpo.max_staleness=9"],
         "policy backend 'fsdp' declares max_staleness 8: it trains on samples up to 8 versions old; "
         "set grpo.max_staleness <= 8"),
        ("gpu/megatron_colocated.yaml", ["grpo.max_staleness=1"],
         "megatron declares memory_handoff: the roles take turns on the devices, so generation cannot "
         "run while the policy trains; set placement.memory_handoff=false"),
    ],
    ids=["beyond-the-policy", "colocated-handoff"],
)
def test_plan_refuses_a_staleness_the_run_cannot_give(capsys, example: str, overrides: list[str], words: str) -> None:
    pytest.importorskip("rlcore_fsdp")
    pytest.importorskip("rlcore_megatron")
    assert main(["plan", str(REPO / "examples" / example), *overrides]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich folds long lines
    assert "config key 'grpo.max_staleness'" in err and words in err


def test_overrides_after_options(monkeypatch, tmp_path: Path) -> None:
    seen = {}

    def fake_run_job(config, overrides, *, out, console, resume):
        seen.update(config=config, overrides=overrides, out=out, resume=resume)
        return tmp_path

    monkeypatch.setattr("rlcore.app.run.run_job", fake_run_job)
    assert main(["run", "c.yaml", "--out", "d", "a=1", "b=2"]) == 0
    assert seen == {"config": "c.yaml", "overrides": ["a=1", "b=2"], "out": "d", "resume": False}
    d = str(tmp_path)
    assert main(["run", "c.yaml", "--out", d, "--resume"]) == 0
    assert seen["resume"] is True and seen["out"] == d and seen["config"] == "c.yaml"
    # --resume DIR: the run directory's own config.yaml unless a config is given.
    assert main(["run", "--resume", d, "grpo.steps=40"]) == 0
    assert seen == {"config": f"{d}/config.yaml", "overrides": ["grpo.steps=40"], "out": d, "resume": True}


def test_plugins_in_a_pipe_prints_whole_names() -> None:
    """Not a terminal: rich would assume 80 columns and cut names ("arithme…")."""
    import subprocess
    import sys

    rlcore = Path(sys.executable).with_name("rlcore")
    # The code under test (PYTHONPATH: a checkout other than the installed one).
    env = {"PATH": "/usr/bin:/bin", "COLUMNS": "60", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([str(rlcore), "plugins"], capture_output=True, text=True, check=True, env=env).stdout
    assert "…" not in out
    for name in ("arithmetic", "rlcore-arithmetic", "shared_memory"):
        assert name in out
    # 100 columns at most, cells wrapped between words (a name is never split).
    assert max(len(line) for line in out.splitlines()) <= 100
    # Each backend's contract version, and an endpoint that depends on the config says when.
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("│ vllm "))
    block = [lines[start]] + [line for line in lines[start + 1:] if line.startswith("│  ")][:6]
    declares = " ".join(line.split("│")[4].strip() for line in block)  # the column, its lines joined
    assert "endpoint when options.serve_openai == True" in " ".join(declares.split())
    assert f"│ {CONTRACT_VERSION} " in lines[start]


def test_plugins_name_lists_the_options_with_types_defaults_ranges_and_docs(capsys) -> None:
    assert main(["plugins", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "  micro_batch_size: int = 32  (at least 1)" in out
    assert "  lora.rank: int = 8  (at least 1)" in out and "Rank of each adapter" in out
    assert "declares: overlap yes/yes" in out and "adapters" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert main(["plugins", "fsdp", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["declaration"]["trains_adapters"] is True
    assert {"name": "lora.alpha", "type": "float", "default": "16.0", "range": "greater than 0",
            "doc": "Scale numerator: the product is scaled by ``alpha / rank``."} in payload["options"]
    assert main(["plugins", "nope"]) == 2
    assert "no backend named 'nope' is installed" in capsys.readouterr().err


def test_plugins_in_a_narrow_terminal_folds_names(monkeypatch, capsys) -> None:
    from rich.console import Console

    import rlcore.app.cli as cli

    monkeypatch.setattr(cli, "_console", lambda stderr=False: Console(width=60, force_terminal=True))
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out


def _subcommands() -> list[str]:
    """Every subcommand the parser has (a new one is in the help test without listing it)."""
    import argparse

    from rlcore.app.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(action.choices)


def test_help_of_every_subcommand_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` shows no reStructuredText (double backquotes, roles), each subcommand's says
    what it does (its docstring), and ``rlcore run``'s says what CONFIG defaults to."""
    commands = _subcommands()
    assert {"plugins", "plan", "run", "export", "samples", "new-backend"} <= set(commands)
    for command in [[], *([c] for c in commands)]:
        with pytest.raises(SystemExit) as done:
            main([*command, "--help"])
        assert done.value.code == 0, command
        out = capsys.readouterr().out
        assert "``" not in out and not re.search(r":\w+:`", out), (command, out)
        if command:
            # The description (the first line after the usage) starts with the command's own name.
            assert f"`rlcore {command[0]}" in out, (command, out)
    run_help = " ".join(_help(["run"]).split())
    assert "default: examples/quickstart.yaml" in run_help
    assert "CONFIG defaults to the quickstart (`examples/quickstart.yaml`)" in run_help
    assert "structural" in _help(["plan"]) and "--measured RUN_DIR" in _help(["plan"])


def _help(command: list[str]) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        main([*command, "--help"])
    return buf.getvalue()


def test_plain_text_turns_restructuredtext_into_plain_text() -> None:
    from rlcore.app.cli import plain_text

    doc = """A :class:`~rlcore.app.session.Session` from :func:`rlcore.open`, ``quoted``.

        A second   paragraph,
        refilled."""
    assert plain_text(doc) == "A `Session` from `rlcore.open`, `quoted`.\n\nA second paragraph, refilled."


# ---------------------------------------------------------------- rlcore plan: the critical path


def _run_dir(path: Path, durations: dict[str, float], backends: dict[str, str] | None = None) -> Path:
    """A run directory as a run leaves it, as far as ``rlcore plan --measured`` reads it: the
    setup's line of ``metrics.jsonl`` (written by the run's MetricsWriter, keys of
    ``setup_metrics``), a step line after it, and ``config.yaml``."""
    from rlcore.app.records import MetricsWriter
    from rlcore.setup.metrics import TOTAL_KEY, task_key

    path.mkdir()
    with MetricsWriter(path / "metrics.jsonl") as w:
        w.write({**{task_key(n): d for n, d in durations.items()}, TOTAL_KEY: max(durations.values()),
                 "timing/setup/cluster_start_time_s": 4.0}, step=0)
        w.write({"train/loss": 0.1, "reward/mean": 0.5}, step=1)
    roles = backends or {"policy": "fsdp", "generation": "vllm", "env": "arithmetic"}
    (path / "config.yaml").write_text("".join(f"{r}:\n  backend: {b}\n" for r, b in roles.items()))
    return path


def test_plan_says_its_critical_path_is_structural(capsys) -> None:
    pytest.importorskip("rlcore_fsdp")
    pytest.importorskip("rlcore_vllm")
    quickstart = str(REPO / "examples" / "quickstart.yaml")
    assert main(["plan", quickstart]) == 0
    out = capsys.readouterr().out
    assert "critical path (structural, from the declared order; --measured RUN_DIR times it" in out, out
    assert out.count("critical path") == 1  # no measured one without --measured
    assert main(["plan", quickstart, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["critical_path"] == ["init:policy", "refit:initial"]  # each task counts 1: the first chain
    assert plan["critical_path_basis"] == "structural, from the declared order"
    assert plan["measured_critical_path"] is None


def test_plan_measured_in_a_run_dir_takes_the_chain_that_took_longest(capsys, tmp_path: Path) -> None:
    """The structural path is init:policy's; the run measured init:generation as longer, so
    the measured critical path is generation's, with the run's seconds."""
    pytest.importorskip("rlcore_fsdp")
    pytest.importorskip("rlcore_vllm")
    quickstart = str(REPO / "examples" / "quickstart.yaml")
    run = _run_dir(tmp_path / "run", {"init:policy": 7.5, "init:generation": 12.8, "init:env": 0.5, "refit:initial": 0.1})
    assert main(["plan", quickstart, "--measured", str(run)]) == 0
    out = capsys.readouterr().out
    assert "critical path (structural, from the declared order): init:policy -> refit:initial\n" in out, out
    assert f"critical path (measured in {run}): init:generation 12.80s -> refit:initial 0.10s = 12.90s" in out, out
    assert "note" not in out and "not timed" not in out

    assert main(["plan", quickstart, "--measured", str(run), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["critical_path"] == ["init:policy", "refit:initial"]
    measured = plan["measured_critical_path"]
    assert measured["run_dir"] == str(run) and measured["critical_path"] == ["init:generation", "refit:initial"]
    assert measured["critical_path_s"] == pytest.approx(12.9)
    assert measured["durations_s"]["init:policy"] == 7.5 and measured["not_measured"] == []

    # A faster generation puts policy back on the measured path: the times decide, not the order.
    fast = _run_dir(tmp_path / "fast", {"init:policy": 7.5, "init:generation": 3.0, "init:env": 0.5, "refit:initial": 0.1})
    assert main(["plan", quickstart, "--measured", str(fast), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["measured_critical_path"]["critical_path"] == ["init:policy", "refit:initial"]


def test_plan_measured_names_what_that_run_did_not_time_or_ran_elsewhere(capsys, tmp_path: Path) -> None:
    pytest.importorskip("rlcore_fsdp")
    pytest.importorskip("rlcore_vllm")
    quickstart = str(REPO / "examples" / "quickstart.yaml")
    run = _run_dir(tmp_path / "run", {"init:policy": 2.0, "refit:initial": 0.1}, {"policy": "megatron", "generation": "vllm"})
    assert main(["plan", quickstart, "--measured", str(run)]) == 0
    out = capsys.readouterr().out
    assert "not timed in that run (counted as 0 s): init:generation, init:env" in out, out
    assert f"note: init:policy ran backend 'megatron' in {run}; this config selects 'fsdp'" in out, out

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.1}\n')
    for where, words in ((tmp_path / "nowhere", "no such run directory"), (empty, "no setup line")):
        assert main(["plan", quickstart, "--measured", str(where)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --measured {where}: ") and words in err, err
