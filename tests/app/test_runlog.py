"""``run.log``: other libraries' output off ``rlcore run``'s console (rlcore/app/runlog.py).

In this process, with no cluster: a library's warning and its logger's lines land in the
run directory's ``run.log`` and not on the console, rlcore's lines and errors stay there;
Ray's forwarded worker output goes to the file, a worker's traceback and Ray's own error
messages to the console too; everything is put back at the end. The quickstart's console
as a whole: tests/e2e/test_e2e_console.py.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from rlcore.app import runlog
from rlcore.app.rundir import check_run_dir, make_run_dir
from rlcore.app.runlog import error_lines, routed_to_run_log

#: A library module of its own (not rlcore's) that warns when called.
LIBRARY = """
import warnings

def old_api():
    warnings.warn("old_api is deprecated, use new_api", FutureWarning, stacklevel=1)
"""


@contextlib.contextmanager
def console_handler() -> Iterator[logging.Handler]:
    """The CLI's ``logging.basicConfig``: a handler on stderr at the root (made inside the
    test: capsys's stderr is in place only there). pytest's own handlers write elsewhere."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def _library() -> types.ModuleType:
    module = types.ModuleType("somelib")
    exec(compile(LIBRARY, "/site-packages/somelib/__init__.py", "exec"), module.__dict__)
    return module


def test_a_library_warning_and_log_lines_go_to_run_log_not_the_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shown = io.StringIO()
    showwarning = warnings.showwarning
    with (
        console_handler() as handler,
        routed_to_run_log(Console(file=shown, width=200)),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("always")
        logging.getLogger("somelib").warning("said before the run directory existed")
        runlog.attach(tmp_path)
        _library().old_api()
        logging.getLogger("somelib.io").warning("a library's notice")
        logging.getLogger("rlcore.app.session").warning("a warning of rlcore's own")
        logging.getLogger("rlcore_vllm.engine").warning("a plugin's warning")
        logging.getLogger("somelib").error("a library's error")
        assert handler.filters == [runlog.ours]
    console = capsys.readouterr()
    text = (tmp_path / "run.log").read_text()
    # The console: rlcore's lines and every error; nothing else of the library's.
    for line in ("a warning of rlcore's own", "a plugin's warning", "a library's error"):
        assert line in console.err and line in text, (console.err, text)
    for line in ("deprecated", "a library's notice", "said before"):
        assert line not in console.err + console.out, console
        assert line in text, text
    assert "FutureWarning" in text and text.index("said before") < text.index("deprecated")
    # The log is named once, when the run directory is known.
    named = [ln for ln in shown.getvalue().splitlines() if "run.log" in ln]
    assert named == [f"other libraries' output (Ray and its workers, warnings): {tmp_path / 'run.log'}"]
    # Put back: warnings shown as before, the console handler unfiltered.
    assert warnings.showwarning is showwarning and not handler.filters
    assert not any(isinstance(h, runlog._ToRunLog) for h in logging.getLogger().handlers)


def test_lines_of_a_run_that_never_had_a_directory_are_printed_at_its_end(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with console_handler(), routed_to_run_log(Console(file=io.StringIO())):
        logging.getLogger("somelib").warning("nowhere else to go")
        assert "nowhere else to go" not in capsys.readouterr().err
    assert "WARNING somelib: nowhere else to go" in capsys.readouterr().err


def test_ray_worker_output_goes_to_run_log_and_its_errors_to_the_console_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("ray")
    from ray._private import worker as ray_worker

    original = ray_worker.print_to_stdstream
    noise = [
        "(MainProcess pid=41) WARNING 12-07 21:53:01 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.",
        "[W1207 21:53:01.372740205 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy",
    ]
    crash = [
        "Traceback (most recent call last):",
        '  File "/site-packages/vllm/engine.py", line 12, in step',
        "    raise RuntimeError('the engine broke')",
    ]
    batch = {"ip": "127.0.0.1", "localhost": "127.0.0.1", "pid": 41, "job": "01000000",
             "actor_name": "VLLMWorker", "task_name": None, "is_err": True}
    with routed_to_run_log(Console(file=io.StringIO())):
        runlog.attach(tmp_path)  # takes Ray's forwarding over: what ray.init then uses
        assert ray_worker.print_to_stdstream != original
        ray_worker.print_to_stdstream({**batch, "lines": noise + crash}, ignore_prefix=False)
        # The traceback's end comes in the next batch: still shown.
        ray_worker.print_to_stdstream({**batch, "lines": ["RuntimeError: the engine broke", "after it"]},
                                      ignore_prefix=False)
        # Ray's own message about the cluster, as its error listener sends it.
        ray_worker.print_to_stdstream({"lines": ["A worker died or was killed while executing a task."],
                                       "pid": "raylet", "is_err": False}, ignore_prefix=False)
    assert ray_worker.print_to_stdstream is original  # put back
    console = capsys.readouterr()
    text = (tmp_path / "run.log").read_text()
    for line in noise + crash + ["RuntimeError: the engine broke", "after it"]:
        assert f"(VLLMWorker pid=41) {line}\n" in text, text
    assert "(raylet) A worker died or was killed while executing a task." in text
    for line in crash + ["RuntimeError: the engine broke"]:
        assert line in console.err, console.err
    assert "VLLMWorker pid=41" in console.err  # named as Ray names it
    assert "A worker died or was killed" in console.out
    for line in ("libtcmalloc", "NUMA", "after it"):
        assert line not in console.err + console.out, console


def test_error_lines_are_tracebacks_fatal_errors_and_error_records() -> None:
    lines = [
        "(MainProcess pid=7) WARNING 12-07 21:53:01 [vllm.py:725] Model Runner V2 requires Triton",
        "(MainProcess pid=7) ERROR 12-07 21:53:02 [core.py:9] EngineCore failed to start.",
        "ERROR:somelib:could not open the socket",
        "an ordinary line",
        "Fatal Python error: Segmentation fault",
        "",
        "Current thread 0x00007f (most recent call first):",
        '  File "/x.py", line 3 in f',
        "Extension modules: numpy",
        "an ordinary line again",
    ]
    assert error_lines(lines) == lines[1:3] + lines[4:9]


def test_a_run_log_left_by_a_run_that_completed_no_step_does_not_block_its_out(tmp_path: Path) -> None:
    from rlcore.config import load_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text('{"status": "failed", "steps_done": 0, "pid": 4194311, "host": "x"}')
    (run_dir / "run.log").write_text("(VLLMWorker pid=1) a line of the failed run\n")
    check_run_dir(run_dir, resume=False)  # accepted: run.log is a run's file
    config = load_config(str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"), [])
    with routed_to_run_log(Console(file=io.StringIO())):
        assert make_run_dir(config, str(run_dir)) == run_dir
    assert (run_dir / "run.log").read_text() == ""  # the new run's, from empty
    make_run_dir(config, str(tmp_path / "library"))  # rlcore.open in a library: no run.log
    assert not (tmp_path / "library" / "run.log").exists()
