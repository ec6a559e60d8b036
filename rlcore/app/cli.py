"""The ``rlcore`` command line: ``plugins``, ``plan``, ``run``, ``export``, ``samples``, ``new-backend``.

Only this module prints. It imports the heavy parts (Ray, torch) only inside
``run``; ``rlcore plugins`` and ``rlcore plan`` stay light.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlcore.declarations import Role
from rlcore.errors import BackendNotFoundError, ConfigError, PlanError, RlcoreError
from rlcore.lora import ADAPTER_TRANSPORT

if TYPE_CHECKING:
    from rlcore.declarations import BackendDeclaration
    from rlcore.setup.registry import PluginFailure, Registry

#: Exit codes (README, "Exit codes"): bad input refused before anything started; a
#: failure once the run had started (setup, a step, a refit, its check, training health).
#: Interrupts exit 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).
EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 3
#: OS errors that say the disk cannot take what a run writes: a run that meets one outside
#: the run directory's own writers (which raise RunDirError) still ends in one line.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


#: Width of output that is not a terminal (a pipe, a file): wide enough that tables are
#: never cut (rich would otherwise assume 80 columns and shorten names to "arithme…").
PIPE_WIDTH = 1000
#: Columns ``rlcore plugins`` fits in (a terminal narrower than this gets its own width).
PLUGINS_WIDTH = 100


def _console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else PIPE_WIDTH
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=width)


# ---------------------------------------------------------------- plugins


def cmd_plugins(args: argparse.Namespace) -> int:
    """``rlcore plugins [NAME] [--json]``: backends, wrappers, skipped plugins, disabled ones;
    with NAME, that backend's declaration and options.

    Versions are those of the code Python imports: a plugin whose distribution is
    installed twice is listed as skipped, naming every copy and the imported one.
    """
    from rlcore.setup.registry import load_registry

    registry = load_registry()
    if args.name is not None:
        return _plugin_detail(registry, args.name, as_json=args.json)
    if args.json:
        print(json.dumps(_plugins_payload(registry), indent=2))
        return 0
    con = _console()
    # At most PLUGINS_WIDTH columns: cells wrap between words; a long name folds, never cut.
    table = Table(title="rlcore backends (entry-point group rlcore.backends)", width=min(con.width, PLUGINS_WIDTH))
    # Widths that hold the longest word of each column (shared_memory, rlcore-arithmetic).
    for col, least, most in (("backend", 10, 12), ("roles", 11, 11), ("transports", 13, 13), ("declares", 16, None),
                             ("contract", 8, 8), ("distribution", 17, 17)):
        table.add_column(col, overflow="fold", min_width=least, max_width=most)
    for name, info in sorted(registry.backends.items()):
        d = info.declaration
        assert d is not None
        transports = sorted({*map(str, d.send_transports), *map(str, d.receive_transports)})
        table.add_row(
            name,
            ", ".join(sorted(r.value for r in d.roles)),
            ", ".join(transports) or "-",
            "; ".join(_declares(d)),
            d.contract_version,
            f"{info.distribution or '?'} {info.version or ''}".strip(),
        )
    con.print(table)
    con.print("rlcore plugins NAME lists a backend's options; --json gives every declaration field")
    for w in registry.wrappers:
        con.print(f"wrapper plugin: {w.name} ({w.distribution or '?'})")
    for f in registry.failures:
        con.print(_failure_line(f))
    for name in registry.disabled:
        con.print(f"[yellow]not loaded (allowlist): {name}[/yellow]")
    if not registry.backends:
        con.print("no backends installed: pip install one, e.g. ./plugins/fsdp")
    return 0


def _declares(d: BackendDeclaration) -> list[str]:
    """What a backend declares beyond roles and transports, in a few words each."""
    parts = [f"overlap {'yes' if d.overlap.non_colocated else 'no'}/{'yes' if d.overlap.colocated else 'no'}"]
    parts += ["refit-fed"] if d.refit_fed else []
    parts += [f"endpoint {_endpoint_cell(d)}"] if d.openai_endpoint else []
    if d.checkpoint is not None:
        parts.append("checkpoints" + (" (staged)" if d.checkpoint.staged else ""))
    parts += [f"max_staleness {d.max_staleness}"] if d.max_staleness else []
    parts += ["adapters"] if d.trains_adapters else []
    parts += [f"loss options: {', '.join(sorted(d.loss_options))}"] if d.loss_options else []
    parts += ["extra draws"] if d.extra_draws else []
    parts += [f"max_workers {d.max_workers}"] if d.max_workers is not None else []
    return parts


def _plugin_detail(registry: Registry, name: str, *, as_json: bool) -> int:
    """``rlcore plugins NAME``: one backend's declaration and its options (type, default,
    range, doc), within :data:`PLUGINS_WIDTH` columns."""
    import textwrap

    from rlcore.app.option_docs import option_docs

    info = registry.backends.get(name)
    if info is None or info.declaration is None:
        known = ", ".join(sorted(registry.backends)) or "none"
        _console(stderr=True).print(f"error: no backend named {name!r} is installed (installed: {known})")
        return 2
    d = info.declaration
    options = option_docs(d.options) if d.options is not None else []
    if as_json:
        print(json.dumps({"declaration": d.to_dict(), "options": [dataclasses.asdict(o) for o in options]}, indent=2))
        return 0
    con = _console()
    head = [
        f"{name} ({info.distribution or '?'} {info.version or ''}): {d.description}",
        f"  roles: {', '.join(sorted(r.value for r in d.roles))}; contract {d.contract_version}",
        "  declares: " + "; ".join(_declares(d)),
    ]
    for text in head:
        for line in textwrap.wrap(text, width=PLUGINS_WIDTH, subsequent_indent="    "):
            con.print(escape(line), highlight=False)
    if d.options is None:
        con.print("  options: not declared (any <role>.options mapping is passed through unchecked)")
        return 0
    section = "policy" if Role.POLICY in d.roles else next(iter(sorted(r.value for r in d.roles)))
    con.print(f"options ({section}.options.NAME, or the section of the role it serves):")
    for o in options:
        head = f"  {o.name}: {o.type} = {o.default}" + (f"  ({o.range})" if o.range and o.range != "any number" else "")
        con.print(escape(head), highlight=False)
        doc = o.doc.replace("``", "`")
        for line in textwrap.wrap(doc, width=PLUGINS_WIDTH - 6):
            con.print(escape(f"      {line}"), highlight=False)
    return 0


def _plugins_payload(registry: Registry) -> dict[str, Any]:
    """``rlcore plugins --json``: each version is that of the code Python imports."""
    return {
        "backends": [
            {
                "name": name,
                "plugin": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "declaration": info.declaration.to_dict() if info.declaration else None,
            }
            for name, info in sorted(registry.backends.items())
        ],
        "wrappers": [
            {"plugin": w.name, "distribution": w.distribution, "version": w.version}
            for w in registry.wrappers
        ],
        "failures": [{"plugin": f.name, **f.to_dict()} for f in registry.failures],
        "disabled": list(registry.disabled),
    }


def _failure_line(f: PluginFailure) -> str:
    """One line (rich markup) for a skipped plugin: its names, the distribution and
    version whose code Python imports (every claimant's for a backend declared twice)."""
    imported = [c for c in f.copies if c.imported]
    dist = ", ".join(f"{c.distribution or '?'} {c.version or ''}".strip() for c in imported)
    dist = dist or f"{f.distribution or '?'} {f.version or ''}".strip()
    names = ", ".join(f.plugins)
    return f"[red]skipped plugin {escape(names)} ({escape(dist)}), {f.stage}:[/red] {escape(f.message)}"


def _endpoint_cell(d: BackendDeclaration) -> str:
    if not d.openai_endpoint:
        return "no"
    if not d.openai_endpoint_when:
        return "yes"
    return "when " + " and ".join(c.describe() for c in d.openai_endpoint_when)


# ---------------------------------------------------------------- plan


def build_plan_from_args(config_path: str | None, overrides: Sequence[str]) -> tuple[Any, Any]:
    """Load the config and the plugins it allows; run every check ``rlcore run`` makes
    before it starts anything (:func:`rlcore.setup.preflight.check_before_start`); the
    config and the run prepared as ``rlcore run`` would run it (its ``plan`` printed)."""
    from rlcore.config import load_config
    from rlcore.setup.preflight import check_before_start
    from rlcore.setup.registry import load_registry

    config = load_config(config_path, overrides)
    return config, check_before_start(config, load_registry(config.plugins.allow))


def render_plan(plan: Any, con: Console, measured: dict[str, Any] | None = None) -> None:
    """``rlcore plan``'s text; ``measured``: :func:`measured_critical_path`'s (``--measured``)."""
    from rlcore.setup.plan import CRITICAL_PATH_BASIS

    table = Table(title="setup tasks")
    table.add_column("task")
    table.add_column("backend")
    table.add_column("starts after")
    table.add_column("waits inside its init for")
    for t in plan.tasks:
        waits = [f"{w.target} (from {w.producer})" for w in plan.waits if w.task == t.name]
        table.add_row(t.name, t.backend or "(core)", ", ".join(plan.predecessors(t.name)) or "start", ", ".join(waits) or "-")
    con.print(table)
    con.print("[bold]why each edge exists[/bold]")
    for e in plan.edges:
        con.print(f"  {e.src} -> {e.dst}: {e.reason}")
    if plan.waits:
        con.print("[bold]waits inside an init (no edge)[/bold]")
        for w in plan.waits:
            con.print(f"  {w.task} waits for {w.kind} '{w.target}' from {w.producer}: {w.reason}")
    pairs = plan.overlapping_pairs()
    con.print("[bold]may overlap[/bold]: " + ("; ".join(f"{a} || {b}" for a, b in pairs) or "nothing"))
    hint = "" if measured is not None else "; --measured RUN_DIR times it with a run's setup"
    con.print(f"[bold]critical path[/bold] ({CRITICAL_PATH_BASIS}{hint}): " + " -> ".join(plan.critical_path))
    if measured is not None:
        took = measured["durations_s"]
        chain = " -> ".join(f"{n} {took.get(n, 0.0):.2f}s" for n in measured["critical_path"])
        con.print(
            f"[bold]critical path[/bold] (measured in {escape(measured['run_dir'])}): "
            f"{chain} = {measured['critical_path_s']:.2f}s"
        )
        if measured["not_measured"]:
            con.print(f"  not timed in that run (counted as 0 s): {', '.join(measured['not_measured'])}")
        for note in measured["notes"]:
            con.print(f"  [yellow]note[/yellow]: {escape(note)}")
    transport = str(plan.refit_transport)
    if plan.refit_content is not None and plan.refit_content.kind == "adapters":
        transport = f"{ADAPTER_TRANSPORT} (the adapters, in memory; {transport} is not used)"
    con.print(f"[bold]refit transport[/bold]: {transport}")
    for part in (plan.refit_content, plan.schedule):
        if part is not None:
            head, _, rest = part.describe().partition(": ")
            con.print(f"[bold]{head}[/bold]: {escape(rest)}")
    if plan.devices is not None:
        kind = "shared by the colocated roles" if plan.devices.colocated else "one role each"
        con.print(f"[bold]GPUs[/bold]: {plan.devices.gpus} ({kind}, one Ray placement group)")
        for line in plan.devices.lines():
            con.print(f"  {line}")


def cmd_plan(args: argparse.Namespace) -> int:
    """``rlcore plan CONFIG [key=value ...] [--measured RUN_DIR] [--json]``: the setup plan
    ``rlcore run`` would run, after every check it makes before it starts; nothing starts.

    The tasks and why each waits for another, what may overlap, the refit transport and
    content, the loop's schedule, the GPUs, the cluster and the checkpoints. The critical
    path is structural: the longest chain of the plan's graph, each task counted once,
    not timed. ``--measured RUN_DIR`` also weighs the plan's chains by the task times that
    run measured (its ``metrics.jsonl``) and names the chain that took longest there.
    """
    from rlcore.runtime.join import choose_cluster

    config, prepared = build_plan_from_args(args.config, args.overrides)
    plan, choice = prepared.plan, choose_cluster(config.cluster)
    checkpoints = checkpoint_plan(prepared)
    measured = measured_critical_path(plan, Path(args.measured)) if args.measured is not None else None
    if args.json:
        cluster = {"address": choice.address, "attached": choice.attached, "why": choice.why}
        payload = {**plan.to_dict(), "measured_critical_path": measured, "cluster": cluster, "checkpoints": checkpoints}
        print(json.dumps(payload, indent=2))
    else:
        render_plan(plan, _console(), measured)
        _console().print(f"[bold]cluster[/bold]: {escape(choice.describe())}")
        if checkpoints is not None:
            _console().print(f"[bold]checkpoints[/bold]: {escape(checkpoints['describe'])}")
    return 0


def measured_critical_path(plan: Any, run_dir: Path) -> dict[str, Any]:
    """``rlcore plan --measured RUN_DIR``: the plan's longest chain over its edges, weighted
    by the task times of ``run_dir``'s setup (the last setup line of its ``metrics.jsonl``,
    as the run's own ``timing/setup/critical_path_s``). Tasks that run did not time count
    as 0 s and are listed; a task whose backend in the run's ``config.yaml`` is not this
    plan's is named in ``notes``.

    Raises:
        ConfigError: (key ``--measured``) no run directory, or no finished setup in it, or
            none of the plan's tasks timed there.
    """
    from rlcore.app.records import read_metrics
    from rlcore.setup.metrics import TOTAL_KEY, recorded_durations

    where = f"--measured {run_dir}"
    if not run_dir.is_dir():
        raise ConfigError(f"{where}: no such run directory; give the directory of a run (its --out)", key="--measured")
    try:
        records = read_metrics(run_dir / "metrics.jsonl")
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}: cannot read its metrics.jsonl ({err}); give the directory of a run", key="--measured") from None
    setup = next((r for r in reversed(records) if TOTAL_KEY in r), None)
    if setup is None:
        raise ConfigError(
            f"{where}: its metrics.jsonl has no setup line ({TOTAL_KEY}): that run's setup never finished",
            key="--measured",
        )
    durations = recorded_durations(setup, plan.names)
    if not durations:
        raise ConfigError(
            f"{where}: that run timed none of this plan's tasks ({', '.join(plan.names)}); it ran another config",
            key="--measured",
        )
    seconds, chain = plan.timed_critical_path(durations)
    return {
        "run_dir": str(run_dir),
        "critical_path": chain,
        "critical_path_s": seconds,
        "durations_s": durations,
        "not_measured": [n for n in plan.names if n not in durations],
        "notes": _other_backends(plan, run_dir),
    }


def _other_backends(plan: Any, run_dir: Path) -> list[str]:
    """One line per task whose backend in ``run_dir``'s ``config.yaml`` is not this plan's
    (its times are another backend's); none when the file is missing or unreadable."""
    import yaml

    try:
        ran = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []
    notes = []
    for t in plan.tasks:
        section = ran.get(t.role) if isinstance(ran, dict) else None
        was = section.get("backend") if isinstance(section, dict) else None
        if t.backend is not None and was is not None and was != t.backend:
            notes.append(f"{t.name} ran backend '{was}' in {run_dir}; this config selects '{t.backend}'")
    return notes


def checkpoint_plan(prepared: Any) -> dict[str, Any] | None:
    """What the run saves and when (``checkpoint.*`` and the policy's declaration), or
    ``None`` when it saves nothing."""
    from rlcore.app.checkpointing import save_overlaps, save_stages
    from rlcore.app.resume import checkpoint_root, policy_format

    c = prepared.config.checkpoint
    fmt = policy_format(prepared)
    if c.every_steps == 0 or fmt is None:
        return None
    overlap = save_overlaps(prepared.config, prepared.declarations[Role.POLICY])
    staged = save_stages(prepared.config, prepared.declarations[Role.POLICY])
    where = c.dir or str(checkpoint_root(prepared.config, Path("<run dir>")))
    how = "beside the next step's rollouts" if overlap else "before the next step"
    if staged:
        how = "staged: the loop waits for the copy to host memory, the files are written beside the next steps"
    return {
        "every_steps": c.every_steps, "keep": c.keep, "keep_every": c.keep_every, "dir": where,
        "format": fmt.format,
        "format_version": fmt.version, "overlap": overlap, "staged": staged, "on_sigterm": c.on_sigterm,
        "describe": (
            f"every {c.every_steps} steps and after the last, the last {c.keep} kept"
            + (f" (and those of every multiple of {c.keep_every} for good)" if c.keep_every else "")
            + f", in {where}; "
            f"{fmt.backend} writes {fmt.format} v{fmt.version}, {how}"
            + (f"; SIGTERM saves the step in progress (within {c.sigterm_grace_s:g}s)" if c.on_sigterm else "")
        ),
    }


# ---------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    """``rlcore run [CONFIG] [key=value ...]``: set up the backends CONFIG selects, run the
    GRPO loop, write a run directory (``metrics.jsonl``, ``trace.json``, ``run.json``...).
    CONFIG defaults to the quickstart (``examples/quickstart.yaml``).

    SIGINT/SIGTERM stop it cleanly (exit 130/143, one line saying what was interrupted);
    a second signal, or 9 s of teardown, kills its processes at once. Exit 2: bad input,
    refused before anything started; 3: the run failed once started.
    """
    from rlcore.app.interrupts import (
        RunInterrupted,
        SignalGuard,
        end_leftovers,
        signal_name,
        signum_of,
    )
    from rlcore.app.run import run_job
    from rlcore.app.runlog import routed_to_run_log
    from rlcore.config import DEFAULT_EXAMPLE, default_config_path

    out, resume = _resume_target(args)
    # A resumed run's config is its own (config.yaml in the run directory) unless one is given.
    config_path = args.config or (str(Path(out) / "config.yaml") if resume and out else None) or default_config_path()
    if config_path is None:
        raise ConfigError(
            f"no config given and examples/{DEFAULT_EXAMPLE} not found; pass a config file"
        )
    with SignalGuard():
        try:
            with routed_to_run_log(_console()):  # other libraries' output: the run's run.log
                run_dir = run_job(str(config_path), args.overrides, out=out, console=_console(), resume=resume)
        except RunInterrupted as err:
            left = end_leftovers()  # the CLI's process is the run: nothing of it may outlive it
            if left:
                err.problems.append(f"ended leftover processes {', '.join(left)}")
            _console(stderr=True).print(escape(err.line()))
            return err.exit_code
        except KeyboardInterrupt as err:  # before the run directory existed: nothing to stop
            signum = signum_of(err)
            _console(stderr=True).print(f"interrupted ({signal_name(signum)}) before the run started")
            return 128 + signum
    _console().print(f"run directory: {run_dir}")
    return 0


def _resume_target(args: argparse.Namespace) -> tuple[str | None, bool]:
    """``--resume DIR`` (or ``--out DIR --resume``): the run directory and whether it resumes."""
    if args.resume is None:
        return args.out, False
    if args.resume and args.out and Path(args.resume) != Path(args.out):
        raise ConfigError(
            f"--resume {args.resume} and --out {args.out} name two run directories; give one",
            key="--resume",
        )
    out = args.resume or args.out
    if not out:
        raise ConfigError(
            "--resume needs the run directory to continue: rlcore run --resume DIR (or --out DIR --resume)",
            key="--resume",
        )
    if not Path(out).expanduser().is_dir():
        raise ConfigError(f"--resume {out}: no such run directory", key="--resume")
    return out, True


# ---------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace) -> int:
    """``rlcore export DIR [--step N] --to HF_DIR [--adapter]``: write a run's checkpoint
    (the newest that verifies, or step N's) as a Hugging Face model directory; with
    ``--adapter``, a LoRA run's adapters as a peft adapter directory.

    SIGINT/SIGTERM tear it down as they do ``rlcore run`` (exit 130/143), leaving nothing
    at HF_DIR."""
    from rlcore.app.export import export_checkpoint
    from rlcore.app.interrupts import SignalGuard, end_leftovers, signal_name, signum_of

    with SignalGuard():
        try:
            exported = export_checkpoint(
                Path(args.dir), Path(args.to), step=args.step, console=_console(), adapter=args.adapter
            )
        except KeyboardInterrupt as err:
            signum = signum_of(err)
            left = end_leftovers()
            extra = f"; ended leftover processes {', '.join(left)}" if left else ""
            _console(stderr=True).print(f"export interrupted ({signal_name(signum)}); {args.to} not written{extra}")
            return 128 + signum
    _console().print(f"{'peft adapter' if args.adapter else 'Hugging Face model'}: {exported.path}")
    return 0


# ---------------------------------------------------------------- samples


def cmd_samples(args: argparse.Namespace) -> int:
    """``rlcore samples DIR [-n N] [--step S]``: the newest lines of a run's samples.jsonl."""
    from rlcore.app.samples import FILE, newest

    run_dir = Path(args.dir)
    if not run_dir.is_dir():
        _console(stderr=True).print(f"error: {run_dir} is not a run directory")
        return 2
    lines = newest(run_dir, args.n, args.step)
    if not lines:
        where = f" of step {args.step}" if args.step is not None else ""
        _console(stderr=True).print(
            f"no samples{where} in {run_dir / FILE} (logging.samples_every=0 writes none)"
        )
        return 1
    con = _console()
    for line in lines:
        con.print(
            f"[bold]step {line['step']}[/bold]  reward {_reward(line['reward'])}  weights v{line['weight_version']}",
            highlight=False,
        )
        con.print(f"  prompt:     {escape(str(line['prompt']))!s}", highlight=False)
        con.print(f"  completion: {escape(str(line['completion']))!s}", highlight=False)
    return 0


def _reward(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "none (failed)"


# ---------------------------------------------------------------- new-backend


def cmd_new_backend(args: argparse.Namespace) -> int:
    """``rlcore new-backend NAME [--roles R,...] [--dir DIR]``: write the plugin package
    ``rlcore-NAME`` (declaration, init hooks, an engine or env, rlcore's conformance suite
    wired into its tests); ``pip install -e`` it and ``rlcore plugins`` lists it. An
    existing directory is never overwritten. More: docs/writing-a-backend.md."""
    from rlcore.app.scaffold import write_backend_package

    path = write_backend_package(args.name, Path(args.dir), roles=args.roles)
    _console().print(f"wrote plugin package {path}; install it with: pip install -e {path}")
    return 0


# ---------------------------------------------------------------- main


def _split_overrides(values: list[str]) -> tuple[str | None, list[str]]:
    """``rlcore run [CONFIG] [key=value ...]``: the config is the first non-override."""
    config = None
    overrides = []
    for v in values:
        if config is None and "=" not in v and not overrides:
            config = v
        else:
            overrides.append(v)
    return config, overrides


def plain_text(doc: str | None) -> str:
    """A docstring as ``--help`` text: reStructuredText's ``literals`` and
    :role:`targets` as `literals` and `targets` (the last part of a ``~`` target), each
    paragraph filled to 79 columns."""
    import inspect
    import re
    import textwrap

    def target(m: re.Match[str]) -> str:
        tilde, name = m.group(1), m.group(2)
        return f"`{name.rsplit('.', 1)[-1] if tilde else name}`"

    text = re.sub(r":[\w:.-]+:`(~?)([^`]*)`", target, inspect.cleandoc(doc or "")).replace("``", "`")
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
    return "\n\n".join(textwrap.fill(p, 79, break_on_hyphens=False) for p in paragraphs if p)


def _command(sub: Any, name: str, func: Any, help: str) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` says its function's docstring, as plain text."""
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=plain_text(func.__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlcore",
        description="rlcore: set up RL post-training backends, run the GRPO loop, sync the weights.",
        epilog="rlcore COMMAND --help says more; `rlcore run` with no CONFIG runs examples/quickstart.yaml.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = _command(sub, "plugins", cmd_plugins, "list installed backends and their declarations; NAME: one backend's options")
    p.add_argument("name", nargs="?", default=None, metavar="NAME", help="a backend: its declaration and options")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = _command(sub, "plan", cmd_plan, "print the setup plan of a config")
    p.add_argument("config", help="YAML config")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument(
        "--measured", default=None, metavar="RUN_DIR",
        help="a finished run's directory: also the critical path by the task times that run measured",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = _command(sub, "run", cmd_run, "set up, run the GRPO loop, write a run directory")
    p.add_argument(
        "args", nargs="*", metavar="[CONFIG] [key=value ...]",
        help="a YAML config (default: examples/quickstart.yaml) and key=value overrides, "
        "e.g. grpo.steps=5 model.dtype=bfloat16",
    )
    p.add_argument("--out", default=None, help="run directory (default: <output_dir>/<name>-<time>); must be new or empty")
    p.add_argument(
        "--resume", nargs="?", const="", default=None, metavar="DIR",
        help="continue the run in DIR (or --out) from its last complete checkpoint; its config.yaml "
        "is the config unless CONFIG is given",
    )

    p = _command(sub, "export", cmd_export, "write a run's checkpoint as a Hugging Face model directory")
    p.add_argument("dir", metavar="DIR", help="run directory, its checkpoints directory, or one step-N checkpoint")
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the newest that verifies)")
    p.add_argument("--to", required=True, metavar="HF_DIR", help="the model directory to write; must be new or empty")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its adapters as a peft adapter directory instead of the merged model")

    p = _command(sub, "samples", cmd_samples, "print the newest samples a run wrote (its samples.jsonl)")
    p.add_argument("dir", metavar="DIR", help="run directory")
    p.add_argument("-n", type=int, default=8, help="how many of the newest samples (0: all; default 8)")
    p.add_argument("--step", type=int, default=None, help="only this step's samples")

    p = _command(sub, "new-backend", cmd_new_backend, "write a ready backend plugin package")
    p.add_argument("name", help="backend name, e.g. mybackend")
    p.add_argument("--dir", default=".", help="parent directory of the new package")
    p.add_argument("--roles", default="generation", help="comma-separated roles it serves")
    return parser


def parse_command_line(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``rlcore ARGS`` parsed as :func:`main` runs it, nothing run (``args.config`` and
    ``args.overrides`` for ``run`` and ``plan``); a bad command line exits 2 with argparse's
    message, as the command does."""
    parser = build_parser()
    # Overrides may come after options (`rlcore run --out D a=1`): argparse's
    # subcommands can't intermix positionals, so collect the leftovers here.
    args, extra = parser.parse_known_args(list(argv) if argv is not None else None)
    if args.command in ("run", "plan"):
        bad = [e for e in extra if e.startswith("-")]
        if bad:
            parser.error(f"unrecognized arguments: {' '.join(bad)}")
        if args.command == "run":
            args.config, args.overrides = _split_overrides(args.args + extra)
        else:
            args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_command_line(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except (ConfigError, BackendNotFoundError, PlanError) as err:
        # Found before anything started: one line that names the key and the fix.
        _console(stderr=True).print("[red]error:[/red] " + escape(" ".join(str(err).split("\n"))))
        return EXIT_BAD_INPUT
    except RlcoreError as err:
        # Once the run has started, a RunDirError (a full disk) among them: the run has been
        # torn down and what it wrote is valid, so one line says which file and why.
        _console(stderr=True).print("[red]error:[/red] " + escape(str(err)))
        return EXIT_RUN_FAILED
    except OSError as err:
        if args.command not in ("run", "export") or err.errno not in DISK_ERRNOS:
            raise
        where = f"writing {err.filename}: " if err.filename else ""
        _console(stderr=True).print(
            "[red]error:[/red] " + escape(f"{where}{err.strerror or err} [Errno {err.errno}]")
        )
        return EXIT_RUN_FAILED


def entrypoint() -> None:
    from rlcore.runtime.head_watch import HEAD_WATCH

    code = main()
    if code > 128 or HEAD_WATCH.lost:
        # Interrupted, or the cluster's head gone: everything is shut down and written.
        # Leave without the interpreter's finalization, which could still meet a thread the
        # run abandoned (Ray's own shutdown, waiting on a dead GCS, at exit).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
