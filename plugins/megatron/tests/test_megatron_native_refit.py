"""The native-layout refit path on CPU: fingerprints, the path choice, the copy itself.

A Megatron policy and generation of the same layout (same model, TP=1, same dtype)
agree on a native layout when a ``cuda_ipc`` channel opens and then move the
Megatron tensors as they are; any difference (an end that offers none, another
layout) falls back to the Hugging Face plan, and the policy's ``send_weights``
says which path ran. Here both workers live in one process on CPU: the real
transport (TCPStore side channel, messages, checks) with the IPC layer alone a test
double (:class:`ThreadIpc` of ``tests/refit/test_refit_cuda_ipc.py``: ends in two
threads share CPU tensors) and the channel registry kept per worker (one process
holds one end per channel otherwise). The GPU run, over real CUDA IPC between two
processes, is ``test_megatron_colocated_gpu.py``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlcore.refit.channels import ChannelSpec
from rlcore.refit.specs import plan_buckets
from rlcore.refit.sync import _path
from rlcore.refit.transports import cuda_ipc
from rlcore.runtime.addresses import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "refit"))
import test_megatron_colocated  # noqa: E402
from test_refit_cuda_ipc import ThreadIpc  # noqa: E402

#: the fixture of the colocated CPU tests: a float32 policy and generation in this process
workers = test_megatron_colocated.workers

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # megatron-core's own

ROWS = [([1, 5, 6, 7], [8, 9, 10]), ([1, 11], [12, 13, 14, 15])]


#: which worker the current thread acts for (set by :func:`both`)
_role = threading.local()


class PerRole:
    """A dict per worker (the parts of ``dict`` the cuda_ipc registry uses): the role's
    threads see what its earlier threads left, as one process would."""

    def __init__(self) -> None:
        self.dicts: dict[str, dict] = {"policy": {}, "generation": {}}

    def _d(self) -> dict:
        return self.dicts[_role.name]

    def __contains__(self, key: object) -> bool:
        return key in self._d()

    def __setitem__(self, key: str, value: Any) -> None:
        self._d()[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        return self._d().get(key, default)

    def pop(self, key: str, default: Any = None) -> Any:
        return self._d().pop(key, default)

    def setdefault(self, key: str, default: Any) -> Any:
        return self._d().setdefault(key, default)


def both(policy_fn: Callable[[], Any], gen_fn: Callable[[], Any]) -> list[Any]:
    """Run the two ends at once, each in its own thread; their results (errors re-raised)."""
    out: list[Any] = [None, None]

    def call(i: int, fn: Callable[[], Any]) -> None:
        _role.name = ("policy", "generation")[i]
        try:
            out[i] = fn()
        except BaseException as err:
            out[i] = err

    threads = [threading.Thread(target=call, args=(i, fn), daemon=True) for i, fn in enumerate((policy_fn, gen_fn))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a refit end hung"
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


@pytest.fixture
def ipc(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda_ipc's registries per worker, its IPC layer the thread double."""
    registry: dict[int, Any] = {}
    for name in ("_ends", "_pending_persistent", "_pending_layout"):
        monkeypatch.setattr(cuda_ipc, name, PerRole())
    monkeypatch.setattr(cuda_ipc, "default_ipc", lambda: ThreadIpc(registry))


class Channel:
    """One cuda_ipc channel between the two workers (opened at once, closed at the end)."""

    def __init__(self, policy: Any, gen: Any) -> None:
        self.policy, self.gen = policy, gen
        self.spec = ChannelSpec("cuda_ipc", f"native{free_port()}", 2, addr="127.0.0.1", port=free_port(), timeout_s=30)
        self.buckets = plan_buckets(policy.weight_specs(), 1 << 20)
        self.step = 0
        both(lambda: policy.open_refit_channel(self.spec), lambda: gen.open_refit_channel(self.spec, 1))
        self.paths = both(lambda: policy.refit_path(self.spec), lambda: gen.refit_path(self.spec))

    def refit(self) -> Any:
        self.step += 1
        step = self.step
        sent, _ = both(
            lambda: self.policy.send_weights(self.spec, step, self.buckets),
            lambda: self.gen.receive_weights(self.spec, step, self.buckets),
        )
        return sent

    def close(self) -> None:
        both(lambda: self.policy.close_refit_channels(), lambda: self.gen.close_refit_channels())


def _randomize(policy: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _same(policy: Any, gen: Any, rows: int | None = None) -> bool:
    """Every parameter equal bit for bit; ``rows``: the vocabulary matrices' first rows
    only (the Hugging Face plan moves the unpadded vocabulary)."""
    pol, g = dict(policy.model.named_parameters()), dict(gen.model.named_parameters())

    def cut(name: str, t: torch.Tensor) -> torch.Tensor:
        return t[:rows] if rows is not None and ("word_embeddings" in name or "output_layer" in name) else t

    return pol.keys() == g.keys() and all(torch.equal(cut(n, pol[n]), cut(n, g[n])) for n in pol)


def test_parameters_are_views_of_one_buffer_per_dtype_in_native_order(workers: tuple) -> None:
    """Both roles hold every parameter in one buffer (float32 here), adjacent in native
    order (what lets a native refit merge its copies), and keep them there after loading
    and a train step (they write in place)."""
    policy, gen = workers
    policy.train_step(ROWS, [1.0, -1.0], None, 0.2, 1e-3)
    for w in (policy, gen):
        assert len(w._flat) == 1
        buf = w._flat[0]
        offset = 0
        for name, p in w._native:
            assert p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), name
            assert p.storage_offset() == offset and p.is_contiguous(), name
            offset += -(-p.numel() // 32) * 32  # 128-byte aligned float32
        assert [n for n, _ in w._native] == [n for n, _ in w.model.named_parameters()]
    assert policy.native_specs() == gen.native_specs()


def test_the_fingerprint_names_the_layout(workers: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same model at TP=1 in one dtype gives one fingerprint on both roles; another
    tensor-parallel rank or size, another dtype, another padded vocabulary or tensor
    name gives another."""
    from rlcore.refit.specs import TensorSpec

    policy, gen = workers
    base = policy.layout_fingerprint()
    assert gen.layout_fingerprint() == base and len(base) == 64
    for attr, value in (("tp_rank", 1), ("tp_size", 2), ("dtype", "bfloat16")):
        with monkeypatch.context() as m:
            m.setattr(gen, attr, value)
            assert gen.layout_fingerprint() != base, attr
    plan = gen._native_plan[0]
    first = plan[0]
    for changed in (
        TensorSpec(first.name, (first.shape[0] + 128, *first.shape[1:]), first.dtype),  # padded vocabulary
        TensorSpec("embedding.other.weight", first.shape, first.dtype),
    ):
        with monkeypatch.context() as m:
            m.setattr(gen, "_native_plan", [[changed, *plan[1:]]])
            assert gen.layout_fingerprint() != base


def test_same_layout_refits_natively_and_bit_exact(workers: tuple, ipc: None) -> None:
    """Both ends offer the same layout: the channel agrees on it at open, the policy reports
    the native path, and the generation holds the policy's parameters bit for bit (the
    padded vocabulary rows too) and scores like it; a second refit after new weights too."""
    policy, gen = workers
    ch = Channel(policy, gen)
    try:
        assert ch.paths[0] == ch.paths[1] == ("native", policy.layout_fingerprint())
        for seed in (1, 2):
            _randomize(policy, seed)
            sent = ch.refit()
            assert sent == {"bytes": sum(s.nbytes for s in policy.native_specs()), "path": "native"}
            assert _path([sent]) == "native"
            assert _same(policy, gen)
            assert gen.logprobs(ROWS) == policy.logprobs(ROWS)
            assert gen.serving and gen.stale is None
    finally:
        ch.close()


@pytest.mark.parametrize("differ", ["offers_none", "other_layout"])
def test_another_layout_falls_back_to_the_hugging_face_plan(
    workers: tuple, ipc: None, monkeypatch: pytest.MonkeyPatch, differ: str
) -> None:
    """A receiver that offers no native layout (vLLM, SGLang, or one turned off) or
    another one: both ends say why, the policy streams the Hugging Face plan (bytes, the
    report's ``hf``) and the weights still arrive exactly."""
    policy, gen = workers
    if differ == "offers_none":
        monkeypatch.setattr(gen, "native_refit", False)
        why = "receiver rank 1 offered no native layout"
    else:
        monkeypatch.setattr(gen, "layout_fingerprint", lambda: "f" * 64)
        why = "receiver rank 1 holds another layout"
    ch = Channel(policy, gen)
    try:
        (p_path, p_why), (g_path, g_why) = ch.paths
        assert p_path == g_path == "hf" and p_why.startswith(why)
        assert g_why == ("this receiver offered none" if differ == "offers_none" else "not every end offered the same native layout")
        _randomize(policy, 3)
        sent = ch.refit()
        assert sent == sum(s.nbytes for s in policy.weight_specs())
        assert _path([sent, 0]) == "hf"
        assert _same(policy, gen, rows=policy.spec.vocab_size)
        assert not _same(policy, gen)  # the padded rows are the native refit's, not this one's
    finally:
        ch.close()


def test_a_native_refit_failing_before_its_copy_keeps_the_old_weights(
    workers: tuple, ipc: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policy's native stream breaks half-way: the sender aborts, the generation
    writes nothing and keeps serving its old weights; the next refit works."""
    policy, gen = workers
    ch = Channel(policy, gen)
    try:
        _randomize(policy, 4)
        ch.refit()
        old = {n: p.detach().clone() for n, p in gen.model.named_parameters()}
        _randomize(policy, 5)
        original = type(policy).native_stream

        def broken(self: Any) -> Iterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(original(self)):
                if i == 3:
                    raise RuntimeError("export failed half-way")
                yield item

        monkeypatch.setattr(type(policy), "native_stream", broken)
        with pytest.raises(Exception, match="export failed half-way|before any byte was written"):
            ch.refit()
        assert all(torch.equal(old[n], p) for n, p in gen.model.named_parameters())
        assert gen.serving and gen.stale is None
        monkeypatch.setattr(type(policy), "native_stream", original)
        ch.refit()
        assert _same(policy, gen)
    finally:
        ch.close()
