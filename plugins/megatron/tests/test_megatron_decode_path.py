"""The dynamic engine's decode path, on CPU: FlexAttention over the paged KV cache
(:mod:`rlcore_megatron.flex_decode`, eager here: the compiled kernel is the GPU tests') against
the torch paged attention, the step mask shared by a step's layers, and what
:mod:`rlcore_megatron.decode_graphs` decides (which steps replay, when graphs are dropped, a
failed capture) over a stand-in capture; the capture itself needs CUDA
(``test_megatron_decode_gpu.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore_megatron import decode_graphs, flex_decode, paged_attention

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # eager FlexAttention says it is slow


def _paged_case(seed: int, block: int, blocks: int, lengths: list[int], heads: int, kv_heads: int, dim: int):  # type: ignore[no-untyped-def]
    """A cache with large stale values past every length, requests on shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(blocks, block, kv_heads, dim, generator=g)
    v_cache = torch.randn(blocks, block, kv_heads, dim, generator=g)
    per_request = max(1, max(-(-n // block) for n in lengths))
    table = torch.full((len(lengths), per_request), -1, dtype=torch.int32)
    free = torch.randperm(blocks, generator=g).tolist()
    for r, n in enumerate(lengths):
        mine = [free.pop() for _ in range(-(-n // block))]
        table[r, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        for p in range(n, len(mine) * block):
            k_cache[mine[p // block], p % block] = 1e4
            v_cache[mine[p // block], p % block] = -1e4
    q = torch.randn(len(lengths), heads, dim, generator=g)
    return q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32), table


def _torch_path(q, k_cache, v_cache, lengths, table):  # type: ignore[no-untyped-def]
    cu = torch.arange(len(lengths) + 1, dtype=torch.int32)
    kv = paged_attention.PagedKV(k_cache, v_cache, cu, lengths, table, 1, max(1, int(lengths.max())))
    return paged_attention.paged_attention(q, kv, q.shape[-1] ** -0.5)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    block=st.sampled_from([4, 8, 256]),
    lengths=st.lists(st.integers(0, 600), min_size=1, max_size=6),
    group=st.sampled_from([1, 2, 4]),
    kv_heads=st.sampled_from([1, 2, 8]),
)
def test_flex_decode_equals_the_torch_path(seed: int, block: int, lengths: list[int], group: int, kv_heads: int) -> None:
    """Any lengths (none, within one block, on a block's edge, several blocks), grouped-query
    heads, 128-token pieces of 256-token blocks or smaller blocks: the torch path's output; a
    request without keys gets zeros, and stale keys past a length are never read."""
    lengths = [min(n, 4 * block) for n in lengths]
    need = sum(-(-n // block) for n in lengths)
    q, k, v, n_k, table = _paged_case(seed, block, need + 2, lengths, kv_heads * group, kv_heads, 8)
    mask = flex_decode.step_mask(n_k, table, k.shape[0], block)
    got = flex_decode.paged_decode(q, k, v, mask, 8**-0.5, compiled=False)
    want = _torch_path(q, k, v, n_k, table)
    assert torch.isfinite(got).all()
    keyed = n_k > 0
    if keyed.any():
        assert (got[keyed] - want[keyed]).abs().max() < 1e-5
    assert (got[~keyed] == 0).all()


def test_the_step_mask_names_each_piece_once() -> None:
    """256-token blocks are two 128-token pieces: a request of 300 keys on blocks 5 and 2 reads
    pieces 10, 11 and 4 (the last in part); their owner and place are recorded, nothing of the
    padding row or the unused pieces is anyone's, and the batch is padded to a power of two
    whose extra rows read nothing."""
    table = torch.tensor([[5, 2], [-1, -1]], dtype=torch.int32)
    mask = flex_decode.step_mask(torch.tensor([300, 0], dtype=torch.int32), table, 8, 256)
    assert (mask.piece, mask.requests) == (128, 2)
    assert mask.count.shape[0] == flex_decode.MIN_BATCH and mask.count.flatten().tolist() == [3] + [0] * 15
    assert mask.index[0, 0, 0, :3].tolist() == [10, 11, 4]
    assert mask.owner[[10, 11, 4]].tolist() == [0, 0, 0] and mask.logical[[10, 11, 4]].tolist() == [0, 1, 2]
    assert (mask.owner[:16][[i for i in range(16) if i not in (10, 11, 4)]] == -1).all()


@pytest.mark.parametrize(("requests", "batch"), [(1, 16), (16, 16), (17, 32), (300, 512), (512, 512)])
def test_a_step_is_padded_to_a_power_of_two(requests: int, batch: int) -> None:
    """Few compiles: any number of requests runs as one of a handful of batch sizes."""
    assert flex_decode.padded_batch(requests) == batch


def test_one_step_mask_serves_every_layer_of_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Made at the step's first layer; a layer number not above the last starts a new step."""
    made: list[int] = []
    real = flex_decode.step_mask
    monkeypatch.setattr(flex_decode, "step_mask", lambda *a: made.append(1) or real(*a))
    monkeypatch.setattr(paged_attention._step, "layer", None, raising=False)
    table = torch.tensor([[0]], dtype=torch.int32)
    lengths = torch.tensor([3], dtype=torch.int32)
    shape = (2, 4, 2, 8)
    masks = [paged_attention._decode_mask(layer, lengths, table, shape) for layer in (1, 2, 3)]
    assert len(made) == 1 and masks[0] is masks[1] is masks[2]
    again = paged_attention._decode_mask(1, lengths, table, shape)  # the next step
    assert len(made) == 2 and again is not masks[0]
    other = torch.tensor([[1]], dtype=torch.int32)
    paged_attention._decode_mask(2, lengths, other, shape)  # another step's table mid-way
    assert len(made) == 3


# -- decode_graphs over a stand-in capture ------------------------------------------------


@dataclass(frozen=True)
class Dims:
    tokens: int


class Context:
    """What DecodeGraphs reads of megatron-core's dynamic context."""

    def __init__(self) -> None:
        self.memory_buffer = torch.zeros(4)
        self.token_to_input_ids = torch.zeros(4)
        self.graph_attn_metadata: dict[str, Any] = {}
        self.decode_only, self.graphed, self.padded_batch_dimensions = True, True, Dims(8)

    def is_static_batching(self) -> bool:
        return False

    def is_decode_only(self) -> bool:
        return self.decode_only

    def using_cuda_graph_this_step(self) -> bool:
        return self.graphed


class Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.calls = 0

    def forward(self, hidden_states: Any, inference_context: Any = None) -> torch.Tensor:
        self.calls += 1
        if not isinstance(hidden_states, torch.Tensor):  # megatron-core's block unwraps it so
            hidden_states = hidden_states.unwrap()
        return hidden_states * 2


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = Decoder()


class Replay:
    def __init__(self, run: Any) -> None:
        self.run, self.replays = run, 0

    def replay(self) -> None:
        self.replays += 1
        self.run()


@pytest.fixture
def graphed(monkeypatch: pytest.MonkeyPatch) -> tuple[Model, decode_graphs.DecodeGraphs, list]:
    """A model whose decoder goes through DecodeGraphs; a capture records its inputs and
    "replays" by running the eager forward on them (what a CUDA graph computes)."""
    model = Model()
    graphs = decode_graphs.install(model)
    captured: list = []

    def capture(self: decode_graphs.DecodeGraphs, leaves: list, spec: Any) -> Any:
        inputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        outputs: list = [None]

        def run() -> None:
            args, kwargs = decode_graphs.tree_unflatten(inputs, spec)
            outputs[0] = self.eager_forward(*args, **kwargs)

        captured.append(inputs)
        self.stats.captures += 1
        replay = Replay(run)
        entry = decode_graphs._Graph(replay, inputs, outputs, None)
        return entry

    monkeypatch.setattr(decode_graphs.DecodeGraphs, "_capture", capture)
    monkeypatch.setattr(decode_graphs, "tree_unflatten", _unflatten_outputs(decode_graphs.tree_unflatten))
    return model, graphs, captured


def _unflatten_outputs(real: Any) -> Any:
    def unflatten(leaves: Any, spec: Any) -> Any:
        return leaves[0] if spec is None else real(leaves, spec)

    return unflatten


class Wrapped:
    """megatron-core's WrappedTensor: unwrapped once."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._t = [tensor]

    def unwrap(self) -> torch.Tensor:
        return self._t.pop()


def test_install_is_idempotent_and_found_again() -> None:
    model = Model()
    graphs = decode_graphs.install(model)
    assert decode_graphs.install(model) is graphs is decode_graphs.of(model)
    assert decode_graphs.of(object()) is None


def test_decode_steps_of_one_padded_size_capture_once_and_replay_with_new_inputs(graphed: tuple) -> None:
    model, graphs, captured = graphed
    ctx = Context()
    first = model.decoder(hidden_states=Wrapped(torch.tensor([1.0])), inference_context=ctx)
    second = model.decoder(hidden_states=Wrapped(torch.tensor([5.0])), inference_context=ctx)
    assert first.item() == 2.0 and second.item() == 10.0  # the replay read the new input
    assert len(captured) == 1 and graphs.stats.replays == 2
    ctx.padded_batch_dimensions = Dims(16)
    model.decoder(hidden_states=torch.tensor([1.0]), inference_context=ctx)
    assert len(captured) == 2  # another padded size: its own graph


def test_prefill_mixed_and_ungraphed_steps_run_eagerly(graphed: tuple) -> None:
    model, graphs, captured = graphed
    ctx = Context()
    ctx.decode_only = False
    assert model.decoder(hidden_states=Wrapped(torch.tensor([3.0])), inference_context=ctx).item() == 6.0
    ctx.decode_only, ctx.graphed = True, False
    model.decoder(hidden_states=torch.tensor([3.0]), inference_context=ctx)
    model.decoder(hidden_states=torch.tensor([3.0]))  # no inference context: training, logprobs
    assert captured == [] and graphs.stats.eager_steps == 3


def test_graphs_are_dropped_when_the_context_or_the_weights_move(graphed: tuple) -> None:
    """megatron-core's resume allocates the context anew: a graph of the old addresses must
    never replay; in-place changes (a refit, a reset) keep the graphs."""
    model, graphs, captured = graphed
    ctx = Context()
    model.decoder(hidden_states=torch.tensor([1.0]), inference_context=ctx)
    ctx.memory_buffer.fill_(3.0)
    with torch.no_grad():
        model.decoder.weight.mul_(2)
    model.decoder(hidden_states=torch.tensor([1.0]), inference_context=ctx)
    assert len(captured) == 1
    ctx.memory_buffer = torch.zeros(4)  # reallocated
    model.decoder(hidden_states=torch.tensor([1.0]), inference_context=ctx)
    assert len(captured) == 2 and graphs.stats.resets == 1
    model.decoder.weight.data = torch.ones(1)  # a parameter replaced, not written in place
    model.decoder(hidden_states=torch.tensor([1.0]), inference_context=ctx)
    assert len(captured) == 3
    graphs.clear()  # a colocated sleep
    model.decoder(hidden_states=torch.tensor([1.0]), inference_context=ctx)
    assert len(captured) == 4


def test_a_failed_capture_turns_graphs_off_and_the_step_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = Model()
    graphs = decode_graphs.install(model)

    def fail(self: Any, leaves: list, spec: Any) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode_graphs.DecodeGraphs, "_capture", fail)
    ctx = Context()
    out = model.decoder(hidden_states=Wrapped(torch.tensor([4.0])), inference_context=ctx)
    assert out.item() == 8.0  # the unwrapped input, run eagerly
    assert not graphs.enabled and "stream is capturing" in (graphs.stats.disabled or "")
    assert "cuda_graphs=0" in caplog.text
    model.decoder(hidden_states=torch.tensor([1.0]), inference_context=ctx)
    assert graphs.stats.eager_steps == 1 and model.decoder.calls == 2


def test_a_flex_attention_failure_falls_back_to_the_torch_path_for_good(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A FlexAttention that cannot run here (its compile failing on this torch or GPU) costs
    one warning, not the run: that step and every later one take the torch path."""
    monkeypatch.setattr(paged_attention, "_decode_path", "flex")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no flex decoding kernel for this device")

    monkeypatch.setattr(flex_decode, "paged_decode", broken)
    q, k, v, n_k, table = _paged_case(3, 4, 6, [5, 2], 4, 2, 8)

    class Layer:
        config = object()
        softmax_scale = None
        layer_number = 1

    got = paged_attention._flash_decode_and_prefill(Layer(), q[:, None], k, v, 1, 8, None, None, n_k, table, True)
    assert (got[:, 0] - _torch_path(q, k, v, n_k, table)).abs().max() < 1e-5
    assert paged_attention._decode_path == "torch" and "no flex decoding kernel" in caplog.text
