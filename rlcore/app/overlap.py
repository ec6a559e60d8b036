"""What ``rlcore run``'s driver does in the background while Ray and the setup start.

The driver has work of its own that needs neither the cluster nor the started
backends: the tiny model when it is not cached yet (torch and transformers imported,
weights written), the tokenizer the GRPO loop encodes with (:func:`rlcore.models.tokenizer.load`:
seconds, transformers imported), the setup timeline plot (matplotlib). Done in line, each adds its seconds to
the time from command to first step. Here each runs in a daemon thread started as soon
as its inputs exist, checks passed, and the run joins it where it needs the result:

* :func:`prefetch_tokenizer` after the checks that need no cluster, so the model and
  the tokenizer are ready while ``ray.init`` runs (the inits then find the model
  published, and torch already imported);
* :class:`Background` for the setup plot, started once the first step is done (matplotlib's
  import and the drawing took 0.7 CPU-s from the first step's processes on a 2-core
  host) and joined before the run returns;
* :func:`concurrently` for two independent remote calls (the first refit's check asks
  the policy and the generation for the same logprobs).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from rlcore.config import ModelConfig
from rlcore.errors import CancelToken

log = logging.getLogger(__name__)

T = TypeVar("T")
U = TypeVar("U")


class Background:
    """``fn(*args, **kwargs)`` in a daemon thread, started at once (with ``defer``, at the
    first :meth:`start` or :meth:`result`); :meth:`result` joins it and returns its value
    or raises its error in the caller."""

    def __init__(self, name: str, fn: Callable[..., Any], *args: Any, defer: bool = False, **kwargs: Any) -> None:
        self.name = name
        self._future: Future[Any] = Future()
        self._started = False
        self._start_lock = threading.Lock()

        def run() -> None:
            try:
                self._future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # handed to whoever asks for the result
                self._future.set_exception(err)

        self._thread = threading.Thread(target=run, name=f"rlcore-{name}", daemon=True)
        if not defer:
            self.start()

    def start(self) -> None:
        """Start the thread (once; later calls do nothing)."""
        with self._start_lock:
            if not self._started:
                self._started = True
                self._thread.start()

    def result(self, timeout: float | None = None) -> Any:
        """The value (after waiting up to ``timeout`` seconds); re-raises the thread's error."""
        self.start()
        return self._future.result(timeout)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds, never raising; True if it has finished (or never
        started)."""
        if not self._started:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()


_tokenizers: dict[tuple[str, str], Background] = {}
_tokenizers_lock = threading.Lock()


def _key(model: ModelConfig, cache_dir: Path) -> tuple[str, str]:
    return (repr(model), str(cache_dir))


def prefetch_tokenizer(model: ModelConfig, cache_dir: Path, cancel: CancelToken | None = None) -> Background:
    """Start making the run's model (when it is the tiny one) and loading its tokenizer;
    :func:`tokenizer` collects the result. A second call for the same model reuses the first."""
    from rlcore.models.tiny import load_tokenizer

    with _tokenizers_lock:
        job = _tokenizers.get(_key(model, cache_dir))
        if job is None:
            job = Background("tokenizer", load_tokenizer, model, cache_dir, cancel=cancel)
            _tokenizers[_key(model, cache_dir)] = job
        return job


def tokenizer(model: ModelConfig, cache_dir: Path) -> Any:
    """The model's tokenizer: the prefetched one (waited for), else loaded now.

    A prefetch that failed (cancelled with an earlier run, say) is not reused: the tokenizer
    is loaded again here, so its error, if any, is this call's own.
    """
    with _tokenizers_lock:
        job = _tokenizers.pop(_key(model, cache_dir), None)
    if job is not None:
        try:
            return job.result()
        except Exception as err:  # noqa: BLE001 - retried below, where it raises for real
            log.debug("the tokenizer prefetch failed (%s); loading it again", err)
    from rlcore.models.tiny import load_tokenizer

    return load_tokenizer(model, cache_dir)


def discard_tokenizer(model: ModelConfig, cache_dir: Path) -> None:
    """Drop a prefetch nobody collected (a run that ended before it needed the tokenizer):
    the run leaves nothing registered in the process. Its daemon thread is not waited for
    (an interrupted run must end within seconds); it ends on its own."""
    with _tokenizers_lock:
        _tokenizers.pop(_key(model, cache_dir), None)


def concurrently(first: Callable[[], T], second: Callable[[], U]) -> tuple[T, U]:
    """``(first(), second())`` with ``second`` running in another thread meanwhile."""
    other = Background("second", second)
    value = first()
    return value, other.result()
