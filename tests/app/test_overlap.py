"""The driver's background work (rlcore.app.overlap) and the tiny model's lock-free reuse."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rlcore.app import overlap
from rlcore.config import ModelConfig
from rlcore.models import tiny as tinymodel
from rlcore.publish import is_complete


def test_background_returns_the_value_and_reraises_the_error() -> None:
    assert overlap.Background("ok", lambda a, b=0: a + b, 2, b=3).result(timeout=10) == 5

    def fail() -> None:
        raise ValueError("broken in the background")

    job = overlap.Background("fail", fail)
    assert job.join(10)
    with pytest.raises(ValueError, match="broken in the background"):
        job.result()


def test_a_deferred_job_runs_only_once_started() -> None:
    ran = threading.Event()
    job = overlap.Background("later", ran.set, defer=True)
    assert job.join(0.1)  # nothing to wait for yet
    assert not ran.wait(0.3), "a deferred job ran before start()"
    job.start()
    job.start()  # idempotent: a second start would raise RuntimeError from threading
    assert ran.wait(10)
    # result() starts one that nobody started (a run that ended before its first step).
    assert overlap.Background("never started", lambda: 7, defer=True).result(timeout=10) == 7


def test_concurrently_runs_both_at_once() -> None:
    # Each side waits for the other to have started: run one after the other, the first
    # would wait out its deadline and return False.
    started = {"first": threading.Event(), "second": threading.Event()}

    def side(me: str, other: str) -> bool:
        started[me].set()
        return started[other].wait(10)

    assert overlap.concurrently(lambda: side("first", "second"), lambda: side("second", "first")) == (True, True)


def test_prefetched_tokenizer_is_the_model_tokenizer(tmp_path: Path) -> None:
    model = ModelConfig()
    job = overlap.prefetch_tokenizer(model, tmp_path)
    assert overlap.prefetch_tokenizer(model, tmp_path) is job  # asked twice, started once
    tok = overlap.tokenizer(model, tmp_path)
    assert tok is job.result()
    model_dir = tinymodel.ensure_model(model, tmp_path)
    assert is_complete(model_dir)
    assert tok.encode("1+2=") == tinymodel.build_tokenizer().encode("1+2=")


def test_failed_prefetch_is_loaded_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = ModelConfig()
    calls = []
    real = tinymodel.load_tokenizer

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk hiccup in the prefetch")
        return real(*args, **kwargs)

    monkeypatch.setattr(tinymodel, "load_tokenizer", flaky)
    overlap.prefetch_tokenizer(model, tmp_path).join(60)
    tok = overlap.tokenizer(model, tmp_path)
    assert len(calls) == 2 and tok.eos_token == "</s>"


def test_published_tiny_model_is_reused_without_the_write_lock(tmp_path: Path) -> None:
    model = ModelConfig()
    first = tinymodel.ensure_model(model, tmp_path)
    # While another thread holds the write lock (making a model, importing transformers),
    # a caller whose model is already published must not wait for it.
    found: list[Path] = []
    with tinymodel._WRITE_LOCK:
        t = threading.Thread(target=lambda: found.append(tinymodel.ensure_model(model, tmp_path)))
        t.start()
        t.join(10)
        assert found == [first]
