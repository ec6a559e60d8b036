"""Every command README.md and docs/*.md give works as written (issue 47): none would fail
with "command not found", a missing file, an unknown option or an unknown config key.

Nothing is run (a run takes minutes): each command is checked against what it calls. A
command is a line of a shell code block, or an inline code span that names a file
(``rlcore run examples/sglang.yaml``), starting with ``rlcore``, ``python examples/``,
``python -m pytest``, ``.venv/bin/`` or ``bash install.sh``; ``A && B`` is two, and ``ray job
submit ... -- CMD`` is CMD. Usage lines are commands too: ``[...]`` is given, ``...`` left
out, and an upper-case word is a placeholder (``CONFIG`` is the quickstart's config, ``N`` a
number, a path with one in it any file there). The checks:

- ``rlcore ...``: parsed by the CLI's own parser (:func:`rlcore.app.cli.parse_command_line`);
  for ``run`` and ``plan`` the config exists and loads with the overrides given.
- ``python examples/...``: the script exists; where it has ``parse(argv)`` (the example
  loops), its arguments parse, and its config and overrides load as above.
- ``python -m pytest``: every marker its ``-m`` names is registered, every path exists.
- ``.venv/bin/NAME``: the venv has NAME; ``bash install.sh ARGS``: install.sh takes ARGS
  (``--dry-run``: nothing is installed).
- In README.md, a command without ``.venv/bin/`` comes after the sentence that says to
  activate the venv: pasted into a fresh shell before it, it would not be found.

``.ci/run`` runs the README's test command exactly.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rlcore.app.cli import parse_command_line
from rlcore.config import load_config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
QUICKSTART = "examples/quickstart.yaml"
#: What a command starts with, for this test to check it.
PROGRAMS = ("rlcore", ".venv/bin/", "python", "bash")
#: A placeholder: an upper-case word (CONFIG, DIR, HF_DIR, N).
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]*\b")
#: Values for placeholders that must parse as something; the rest stand as they are.
VALUES = {"CONFIG": QUICKSTART, "N": "1", "S": "1"}
#: How README.md says to activate the venv; bare commands come after it.
ACTIVATE = "source .venv/bin/activate"
CODE_LANGS = {"", "bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Command:
    """One command as a doc gives it: where, its text and its words."""

    doc: Path
    offset: int  # where in the doc
    text: str
    words: tuple[str, ...]

    @property
    def line(self) -> int:
        return self.doc.read_text()[: self.offset].count("\n") + 1

    def __str__(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}: {self.text}"


#: The words of a code line the shell could not split (an unclosed quote).
UNSPLIT = "<unclosed quote>"


def _words(text: str) -> list[list[str]]:
    """``text`` as shell words, split at ``&&``, ``||``, ``;`` and ``|``, usage brackets
    and ``...`` taken out; from ``... -- CMD`` (``ray job submit``) only CMD. ValueError:
    a quote is not closed."""
    if not text.startswith(PROGRAMS) and " -- " not in text:
        return []
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in ("&&", "||", ";", "|"):
            commands.append([])
            continue
        word = _unbracketed(word)
        if word and word != "...":
            commands[-1].append(word)
    out = []
    for words in commands:
        if "--" in words and not words[0].startswith(PROGRAMS):
            words = words[words.index("--") + 1:]
        if words and _is_command(words):
            out.append(words)
    return out


def _unbracketed(word: str) -> str:
    """A usage line's word without its brackets (``[--out``, ``DIR]``, ``[CONFIG]``); a
    value's own brackets (``grpo.x=[1,2]``) stay."""
    if word.startswith("[") and word.count("[") > word.count("]"):
        return word[1:]
    if word.endswith("]") and word.count("]") > word.count("["):
        return word[:-1]
    if word.startswith("[") and word.endswith("]") and word.count("[") == 1 and word.count("]") == 1:
        return word[1:-1]
    return word


def _is_command(words: list[str]) -> bool:
    first = words[0]
    if first == UNSPLIT:
        return True
    if first == "rlcore" or first.startswith(".venv/bin/"):
        return True
    if first == "python":
        return len(words) > 1 and (words[1].startswith("examples/") or words[1:3] == ["-m", "pytest"])
    return first == "bash" and words[1:2] == ["install.sh"]


def commands() -> list[Command]:
    """Every command of README.md and docs/*.md (see the module's docstring)."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        fenced = list(re.finditer(r"^```([^\n]*)\n(.*?)^```", text, re.S | re.M))
        for block in fenced:
            if block.group(1).strip() not in CODE_LANGS:
                continue
            lines = block.group(2).replace("\\\n", " ").splitlines()
            offset = block.start(2)
            for line in lines:
                stripped = line.strip().removeprefix("$ ")
                try:
                    split = _words(stripped)
                except ValueError:
                    split = [[UNSPLIT]]
                found += [Command(doc, offset, stripped, tuple(words)) for words in split]
                offset += len(line) + 1
        prose = re.sub(r"^```.*?^```", lambda m: " " * len(m.group(0)), text, flags=re.S | re.M)
        for span in re.finditer(r"`([^`]+)`", prose):
            span_text = " ".join(span.group(1).split())
            try:
                split = _words(span_text)
            except ValueError:  # prose in backquotes, not a command
                continue
            for words in split:
                if any("/" in w or w.endswith((".yaml", ".py")) for w in words[1:]):
                    found.append(Command(doc, span.start(), span_text, tuple(words)))
    return found


COMMANDS = commands()


def _fill(words: tuple[str, ...]) -> list[str]:
    """Placeholders given a value where they must parse as one; ``key=value`` left out."""
    return [VALUES.get(w, w) for w in words if w != "key=value"]


def _existing(path: str) -> list[Path]:
    """The files ``path`` names (a placeholder in it: any file there), relative to the repository."""
    if PLACEHOLDER.search(path):
        return [Path(p) for p in sorted(glob.glob(str(REPO / PLACEHOLDER.sub("*", path))))]
    return [REPO / path] if (REPO / path).exists() else []


def _check_config(config: str | None, overrides: list[str]) -> None:
    """The config exists and loads with the overrides (unknown keys, bad values refused)."""
    if config is not None:
        assert _existing(config), f"{config} does not exist"
    load_config(str(REPO / (config or QUICKSTART)), [o for o in overrides if not PLACEHOLDER.fullmatch(o)])


def _check_rlcore(args: list[str]) -> None:
    try:
        parsed = parse_command_line(args)
    except SystemExit as err:
        pytest.fail(f"rlcore's parser refuses it (exit {err.code})")
    if parsed.command in ("run", "plan"):
        _check_config(parsed.config, parsed.overrides)


#: Subcommands that answer in seconds and start nothing: run as pasted, not only parsed.
CHEAP = ("plan", "plugins")


def _cheap(command: Command, args: list[str]) -> bool:
    """A command the test runs: ``--help``, or ``plan``/``plugins`` with no placeholder and
    no cluster to reach."""
    if any(PLACEHOLDER.search(w) for w in command.words) or any("cluster.address" in a for a in args):
        return False
    return "--help" in args or (bool(args) and args[0] in CHEAP)


def _run_as_pasted(command: Command, args: list[str]) -> None:
    """``rlcore ARGS`` in a fresh shell after the README's set-up and activation: the venv's
    ``bin`` first on ``PATH``, from the repository's root; it must exit 0."""
    env = {**os.environ, "PATH": f"{_venv_bin()}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["rlcore", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{(done.stdout + done.stderr)[-2000:]}"


def _load_module(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"doc_example_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_script(script: str, args: list[str]) -> None:
    paths = _existing(script)
    assert paths, f"{script} does not exist"
    for path in paths:
        if path.suffix != ".py":
            continue
        parse = getattr(_load_module(path), "parse", None)
        if parse is None:
            continue
        try:
            _, config, overrides = parse(args)
        except SystemExit as err:
            pytest.fail(f"{path.name} refuses its arguments (exit {err.code})")
        _check_config(str(Path(config).relative_to(REPO)) if Path(config).is_absolute() else config, overrides)


def _markers() -> set[str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return {m.split(":")[0].strip() for m in pyproject["tool"]["pytest"]["ini_options"]["markers"]}


def _check_pytest(args: list[str]) -> None:
    known = _markers()
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-m":
            words = set(re.findall(r"[A-Za-z_]+", args[i + 1])) - {"and", "or", "not"}
            assert words <= known, f"unregistered markers {sorted(words - known)} (registered: {sorted(known)})"
            i += 2
            continue
        if not arg.startswith("-"):
            assert _existing(arg.split("::")[0]), f"{arg} does not exist"
        i += 1


def _venv_bin() -> Path:
    """The venv the docs mean: the repository's .venv, or else the one running the tests."""
    own = REPO / ".venv" / "bin"
    return own if own.is_dir() else Path(sys.executable).parent


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.doc.name}:{c.line}:{' '.join(c.words[:3])}" for c in COMMANDS])
def test_each_command_of_the_docs_works_as_written(command: Command) -> None:
    assert command.words[0] != UNSPLIT, f"{command}: a quote is not closed"
    words = _fill(command.words)
    program, args = words[0], words[1:]
    if program.startswith(".venv/bin/"):
        name = program.removeprefix(".venv/bin/")
        assert (_venv_bin() / name).exists(), f"{command}: the venv has no {name}"
        program = "python" if name.startswith("python") else name
    if program == "rlcore":
        _check_rlcore(args)
        if _cheap(command, args):
            _run_as_pasted(command, args)
    elif program == "python" and args[:2] == ["-m", "pytest"]:
        _check_pytest(args[2:])
    elif program == "python" and args:
        _check_script(args[0], args[1:])
    elif program == "bash":
        done = subprocess.run(
            ["bash", *args, "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"


def test_the_docs_give_the_commands_a_newcomer_pastes() -> None:
    """The extraction finds what it must: the README's two set-up commands, its CLI tour,
    the example loop and the other examples (a change of format that hid them fails here)."""
    texts = {" ".join(c.words) for c in COMMANDS}
    for expected in (
        "bash install.sh", ".venv/bin/rlcore run", "bash install.sh --all",
        "rlcore plan CONFIG --json", "rlcore run examples/sglang.yaml",
        "python examples/loops/loo_reinforce.py examples/dataset.yaml --steps 8",
        "rlcore run --resume runs/q grpo.steps=200",
    ):
        assert expected in texts, f"{expected!r} not found among {sorted(texts)}"


def test_the_checks_catch_a_command_that_would_fail() -> None:
    """What each check is for: an unknown option, a missing config, an unknown key, a
    missing script, an unregistered marker."""
    with pytest.raises(pytest.fail.Exception, match="parser refuses"):
        _check_rlcore(["run", QUICKSTART, "--outt", "d"])
    with pytest.raises(AssertionError, match="does not exist"):
        _check_rlcore(["plan", "examples/nope.yaml"])
    with pytest.raises(Exception, match="grpo.stepz"):
        _check_rlcore(["run", QUICKSTART, "grpo.stepz=3"])
    with pytest.raises(AssertionError, match="does not exist"):
        _check_script("examples/loops/nope.py", [])
    with pytest.raises(pytest.fail.Exception, match="refuses its arguments"):
        _check_script("examples/loops/loo_reinforce.py", ["--stepz", "3"])
    with pytest.raises(AssertionError, match="unregistered markers"):
        _check_pytest(["-m", "not gpu and not sloww"])
    assert _words("bash install.sh && .venv/bin/rlcore run  # the main job") == [
        ["bash", "install.sh"], [".venv/bin/rlcore", "run"],
    ]


def test_bare_commands_in_the_readme_come_after_it_says_to_activate_the_venv() -> None:
    readme = REPO / "README.md"
    activate = readme.read_text().find(ACTIVATE)
    assert activate >= 0, f"README.md does not say {ACTIVATE!r}"
    early = [
        str(c) for c in COMMANDS
        if c.doc == readme and c.offset < activate and not c.words[0].startswith((".venv/bin/", "bash"))
    ]
    assert not early, "commands a fresh shell would not find (before the venv is activated):\n" + "\n".join(early)


def test_ci_runs_the_readmes_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    test_command = next(
        line for line in readme.splitlines() if line.startswith("bash install.sh") and "pytest" in line
    )
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert test_command in ci, f".ci/run does not run the README's test command {test_command!r}: {ci}"
    assert "--all" in test_command.split("&&")[0]  # the test command installs the server venvs too
    main_job = next(line for line in readme.splitlines() if line.startswith("bash install.sh") and "rlcore run" in line)
    assert main_job.split("&&")[0].split() == ["bash", "install.sh"]  # the main job's: .venv alone
