"""Refit sessions belong to the run: one channel per pair and transport, dropped with the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlcore.config import load_config
from rlcore.errors import CancelToken, RefitError
from rlcore.refit import transports
from rlcore.refit.sessions import RefitSessions
from rlcore.setup.runner import refit_context


class Side:
    """A sender and receiver that record the channels they are asked to open (no workers)."""

    device_type = "cpu"
    refit_ranks = 2

    def __init__(self) -> None:
        self.opened: list[Any] = []

    def refit_address(self) -> tuple[str, int]:
        return "127.0.0.1", 29999

    def open_refit_channel(self, spec: Any) -> list[Any]:
        self.opened.append(spec)
        return []


def ctx(transport: str, sessions: RefitSessions, tmp_path: Path) -> Any:
    config = load_config(
        None, ["policy.backend=p", "generation.backend=g", f"setup.cache_dir={tmp_path}"]
    )
    return refit_context(config, step=1, transport=transport, cancel=CancelToken(), sessions=sessions)


@pytest.mark.parametrize("transport", ["collective", "disk", "shared_memory"])
def test_a_channel_opens_once_per_pair_and_transport(transport: str, tmp_path: Path) -> None:
    sessions = RefitSessions()
    pol, gen, other = Side(), Side(), Side()
    first = sessions.open(pol, gen, ctx(transport, sessions, tmp_path))
    again = sessions.open(pol, gen, ctx(transport, sessions, tmp_path))
    assert first is again and len(pol.opened) == len(gen.opened) == 1
    assert first.spec.transport == transport and first.spec.world_size == 3
    assert first.take_init_time() == first.init_time_s and first.take_init_time() == 0.0
    sessions.open(pol, other, ctx(transport, sessions, tmp_path))  # another pair: its own channel
    assert len(sessions) == 2 and sessions.spec_for(pol, gen, transport) == first.spec
    sessions.close()
    assert len(sessions) == 0 and sessions.spec_for(pol, gen, transport) is None


def test_two_runs_never_share_a_channel(tmp_path: Path) -> None:
    pol, gen = Side(), Side()
    a, b = RefitSessions(), RefitSessions()
    spec_a = a.open(pol, gen, ctx("disk", a, tmp_path)).spec
    spec_b = b.open(pol, gen, ctx("disk", b, tmp_path)).spec
    assert spec_a.key != spec_b.key


def test_a_transport_the_core_lacks_is_refused_by_name(tmp_path: Path) -> None:
    sessions = RefitSessions()
    with pytest.raises(RefitError, match="the core has no 'carrier_pigeon' refit transport"):
        sessions.open(Side(), Side(), ctx("carrier_pigeon", sessions, tmp_path))
    assert "collective" in {t.value for t in transports.implemented("cpu")}


def test_a_forgotten_channel_is_opened_anew(tmp_path: Path) -> None:
    sessions = RefitSessions()
    pol, gen = Side(), Side()
    first = sessions.open(pol, gen, ctx("disk", sessions, tmp_path))
    sessions.forget(pol, gen, "disk")
    second = sessions.open(pol, gen, ctx("disk", sessions, tmp_path))
    assert second is not first and second.spec.key != first.spec.key and len(pol.opened) == 2


def test_a_failed_refit_drops_its_channel(tmp_path: Path) -> None:
    from rlcore.refit.specs import TensorSpec
    from rlcore.refit.sync import refit

    class Failing(Side):
        def weight_specs(self) -> list[TensorSpec]:
            return [TensorSpec("w", (2,), "float32")]

        def send_weights(self, spec: Any, step: int, buckets: Any) -> list[Any]:
            raise RefitError("wire cut")

        receive_weights = send_weights

    sessions = RefitSessions()
    pol, gen = Failing(), Failing()
    with pytest.raises(RefitError, match="wire cut"):
        refit(pol, gen, ctx("disk", sessions, tmp_path))
    assert len(pol.opened) == 1 and sessions.spec_for(pol, gen, "disk") is None
