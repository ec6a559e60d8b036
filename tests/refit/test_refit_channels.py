"""The core's refit pieces: spec checks, bucket plans, and each transport's channel
moving tensors bit-exactly between real processes."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os

import pytest

from rlcore.errors import RefitError
from rlcore.refit.channels import (
    ChannelSpec,
    close_channel,
    open_channel,
    receive_weights,
    send_weights,
)
from rlcore.refit.specs import TensorSpec, check_specs, plan_buckets, spec_of
from rlcore.runtime.addresses import free_port

torch = pytest.importorskip("torch")


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(51, 16, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
        # 6 bytes: the float32 after it sits at an unaligned offset in its bucket.
        "model.layers.0.odd.bias": torch.randn(3, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(16, generator=g),
        "lm_head.weight": torch.randn(51, 16, generator=g),
        "model.count": torch.arange(7, dtype=torch.int64),
    }


def test_check_specs_names_every_problem() -> None:
    sent = [spec_of(n, t) for n, t in _weights().items()]
    check_specs(sent, sent, sender="p", receiver="g")
    wrong = list(sent)
    wrong[0] = TensorSpec(wrong[0].name, (52, 16), "float32")
    wrong[1] = TensorSpec("model.layers.0.self_attn.q.weight", wrong[1].shape, wrong[1].dtype)
    with pytest.raises(RefitError) as info:
        check_specs(wrong, sent, sender="p", receiver="g")
    msg = str(info.value)
    assert "before writing anything" in msg
    assert "q_proj" in msg and "self_attn.q.weight" in msg and "(52, 16)" in msg


def test_plan_buckets_bounds_and_order() -> None:
    specs = [TensorSpec(f"t{i}", (n,), "float32") for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    buckets = plan_buckets(specs, 80)
    assert [s.name for b in buckets for s in b] == [s.name for s in specs]
    for b in buckets:
        assert sum(s.nbytes for s in b) <= 80 or len(b) == 1
    assert [s.name for s in buckets[-2]] == ["t4"]  # 400 bytes: alone
    with pytest.raises(RefitError, match="bucket"):
        plan_buckets(specs, 0)


def _receiver(spec: ChannelSpec, rank: int, buckets, out) -> None:
    try:
        open_channel(spec, rank)
        import io

        got = dict(receive_weights(spec, rank, 1, buckets))
        buf = io.BytesIO()
        torch.save({k: v.clone() for k, v in got.items()}, buf)  # bytes: the child may exit first
        out.put((rank, buf.getvalue()))
    except BaseException as err:  # report, never hang the parent
        out.put((rank, repr(err)))


@contextlib.contextmanager
def _receivers(target, ranks, *args):  # noqa: ANN001, ANN202
    """Start ``target(spec-and-args..., out)`` per rank in spawned processes; yield ``out``;
    join them (killed after 30 s) whatever happens."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(args[0], r, *args[1:], out)) for r in ranks]
    for p in procs:
        p.start()
    try:
        yield out
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("transport", ["collective", "disk", "shared_memory"])
def test_channel_round_trip_is_bit_exact(transport: str, tmp_path) -> None:
    weights = _weights()
    specs = [spec_of(n, t) for n, t in weights.items()]
    buckets = plan_buckets(specs, 2048)
    assert len(buckets) > 1
    root = str(tmp_path) if transport == "disk" else f"/dev/shm/rlcore-test-{os.getpid()}"
    spec = ChannelSpec(
        transport, f"t{os.getpid()}{transport}", world_size=3,
        addr="127.0.0.1", port=free_port(), root=None if transport == "collective" else root, timeout_s=30,
    )
    with _receivers(_receiver, (1, 2), spec, buckets) as out:
        open_channel(spec, 0)
        sent = send_weights(spec, 1, iter(weights.items()), buckets)
        assert sent == sum(s.nbytes for s in specs)
        results = dict(out.get(timeout=60) for _ in (1, 2))
    import io

    for rank in (1, 2):
        assert not isinstance(results[rank], str), results[rank]
        got = torch.load(io.BytesIO(results[rank]))
        assert list(got) == list(weights)
        for name, t in weights.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def _receiver_steps(spec, rank, buckets, steps, out) -> None:  # noqa: ANN001
    try:
        import io

        open_channel(spec, rank)
        for step in range(1, steps + 1):
            got = dict(receive_weights(spec, rank, step, buckets))
            buf = io.BytesIO()
            torch.save({k: v.clone() for k, v in got.items()}, buf)
            out.put((rank, step, buf.getvalue()))
    except BaseException as err:  # report, never hang the parent
        out.put((rank, 0, repr(err)))


def test_announced_collective_with_a_tiny_in_flight_budget(monkeypatch) -> None:
    """The NCCL mode (receivers wait for the sender's "bucket packed") over gloo, with at
    most one bucket in flight, for two steps on one channel: bit-exact, in order."""
    import io

    from rlcore.refit.transports import collective

    monkeypatch.setattr(collective, "IN_FLIGHT_BYTES", 1)
    steps = [_weights(1), _weights(2)]
    specs = [spec_of(n, t) for n, t in steps[0].items()]
    buckets = plan_buckets(specs, 1024)
    assert len(buckets) > 3
    spec = ChannelSpec(
        "collective", f"ann{os.getpid()}", world_size=3, addr="127.0.0.1", port=free_port(),
        timeout_s=30, announce=True,
    )
    with _receivers(_receiver_steps, (1, 2), spec, buckets, len(steps)) as out:
        try:
            open_channel(spec, 0)
            assert collective._open[spec.key].ready is not None
            for step, weights in enumerate(steps, 1):
                assert send_weights(spec, step, iter(weights.items()), buckets) == sum(s.nbytes for s in specs)
            results = [out.get(timeout=60) for _ in range(2 * len(steps))]
        finally:
            close_channel(spec)
    for rank, step, payload in results:
        assert not isinstance(payload, str), payload
        got = torch.load(io.BytesIO(payload))
        assert list(got) == list(steps[step - 1])
        for name, t in steps[step - 1].items():
            assert torch.equal(got[name], t), (rank, step, name)


def test_sender_stream_out_of_plan_is_an_error(tmp_path) -> None:
    weights = _weights()
    specs = [spec_of(n, t) for n, t in weights.items()]
    spec = ChannelSpec("disk", "oop", 2, root=str(tmp_path))
    shuffled = list(reversed(list(weights.items())))
    with pytest.raises(RefitError, match="out of plan"):
        send_weights(spec, 1, iter(shuffled), plan_buckets(specs, 1 << 20))
    assert not (tmp_path / "oop" / "step-000001").exists()  # nothing published


def test_sender_tensor_of_another_dtype_is_an_error(tmp_path) -> None:
    """Receivers size buffers from the plan: a bf16 tensor where the plan says fp32 must stop the send."""
    weights = _weights()
    specs = [spec_of(n, t) for n, t in weights.items()]
    wrong = dict(weights)
    wrong["model.norm.weight"] = wrong["model.norm.weight"].to(torch.bfloat16)
    spec = ChannelSpec("disk", "dtype", 2, root=str(tmp_path))
    with pytest.raises(RefitError, match="model.norm.weight.*plan says"):
        send_weights(spec, 1, iter(wrong.items()), plan_buckets(specs, 1 << 20))
    assert not (tmp_path / "dtype" / "step-000001").exists()


def test_three_replicas_receive_bit_identical_weights_through_one_fan_out(monkeypatch) -> None:
    """Refit to N = 3 generation replicas is one group of 1 + 3 ranks and one broadcast per
    bucket (a tree inside gloo, a pipelined ring inside NCCL), never a send per replica:
    every replica holds the sender's exact bytes. ``bench/refit_fanout.py`` times it."""
    import io

    from rlcore.refit.transports import collective

    calls: list[int] = []
    broadcast = collective._Collective.broadcast

    def counting(self, buf):  # noqa: ANN001, ANN202
        calls.append(buf.numel())
        return broadcast(self, buf)

    monkeypatch.setattr(collective._Collective, "broadcast", counting)
    weights = _weights(3)
    specs = [spec_of(n, t) for n, t in weights.items()]
    buckets = plan_buckets(specs, 1024)
    assert len(buckets) > 3
    replicas = (1, 2, 3)
    spec = ChannelSpec(
        "collective", f"fan{os.getpid()}", world_size=1 + len(replicas), addr="127.0.0.1",
        port=free_port(), timeout_s=30,
    )
    with _receivers(_receiver, replicas, spec, buckets) as out:
        try:
            open_channel(spec, 0)
            assert send_weights(spec, 1, iter(weights.items()), buckets) == sum(s.nbytes for s in specs)
            results = dict(out.get(timeout=60) for _ in replicas)
        finally:
            close_channel(spec)
    # One fan-out: one broadcast per bucket, of the bucket's bytes, whatever the replicas.
    assert calls == [sum(s.nbytes for s in b) for b in buckets]
    assert sorted(results) == list(replicas)
    for rank in replicas:
        assert not isinstance(results[rank], str), results[rank]
        got = torch.load(io.BytesIO(results[rank]))
        assert list(got) == list(weights)
        for name, t in weights.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, (rank, name)
            assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), (rank, name)
