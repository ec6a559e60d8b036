"""CUDA graphs of megatron-core's decoder for the dynamic engine's decode-only steps.

A decode step of a 1 B model is hundreds of small kernels; launched one by one from Python
the GPU waits on the launches, not on memory. megatron-core pads a decode step to one of a
few batch sizes when its context is given ``num_cuda_graphs`` (and then keeps the step's
attention metadata in fixed buffers), but its own capture (``cuda_graph_impl="local"``)
wraps every layer of the model for training as well. :class:`DecodeGraphs` captures the
decoder (every transformer layer and the final norm) once per padded batch size, the first
time a step of that size comes, and replays it afterwards: one launch per step. Embedding,
output layer and sampling stay eager.

A graph replays the addresses it captured: the context's buffers (KV cache, token and
attention metadata) and the model's parameters. Refits write the parameters in place and
the context keeps its buffers between steps, so graphs live across calls and refits; when
any of those addresses changes (megatron-core's ``resume`` allocates the context anew after
a sleep or an in-flight refit's hold) every graph is dropped and sizes are captured again as
they come. :meth:`DecodeGraphs.clear` frees them at once (a colocated sleep). If a capture
fails, graphs are turned off for this decoder, with a warning naming the error, and every
step runs eagerly: the same computation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

log = logging.getLogger(__name__)


@dataclass
class GraphStats:
    """What the decoder's graphs did (for benchmarks and the run's log).

    Attributes:
        captures: graphs captured (a size captured again after a reset counts again).
        capture_s: seconds spent capturing (warm-up run included).
        replays: decode steps replayed from a graph.
        eager_steps: steps of the decoder run eagerly (prefill, mixed, or graphs off).
        resets: times every graph was dropped (addresses changed or :meth:`DecodeGraphs.clear`).
        disabled: why graphs were turned off, or None.
    """

    captures: int = 0
    capture_s: float = 0.0
    replays: int = 0
    eager_steps: int = 0
    resets: int = 0
    disabled: str | None = None


@dataclass
class _Graph:
    graph: Any
    inputs: list[torch.Tensor]
    outputs: list[Any]
    out_spec: Any


@dataclass
class DecodeGraphs:
    """The decoder's forward, replayed from CUDA graphs on the dynamic engine's decode steps.

    Install with :func:`install`; the decoder's ``forward`` then goes through
    :meth:`__call__`. ``enabled`` False runs every step eagerly.
    """

    decoder: torch.nn.Module
    eager_forward: Any
    enabled: bool = True
    #: The decoder's parameters, listed once (a step reads where their data lies, not the tree).
    parameters: list[torch.nn.Parameter] = field(default_factory=list)
    stats: GraphStats = field(default_factory=GraphStats)
    _graphs: dict[Any, _Graph] = field(default_factory=dict)
    _addresses: tuple[int, ...] | None = None
    _pool: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = kwargs.get("inference_context")
        if not (self.enabled and _graphable(context)):
            self.stats.eager_steps += 1
            return self.eager_forward(*args, **kwargs)
        addresses = _addresses(context, self.parameters)
        if addresses != self._addresses:
            self.clear()
            self._addresses = addresses
        leaves, spec = tree_flatten((args, kwargs))
        leaves = [_unwrapped(x) for x in leaves]
        key = context.padded_batch_dimensions
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(leaves, spec)
            except Exception as err:  # noqa: BLE001 - any capture failure: run eagerly, say why
                self._disable(err)
                args, kwargs = tree_unflatten(leaves, spec)
                return self.eager_forward(*args, **kwargs)
            self._graphs[key] = entry
        else:
            for static, live in zip(entry.inputs, leaves, strict=True):
                if isinstance(live, torch.Tensor):
                    static.copy_(live)
        entry.graph.replay()
        self.stats.replays += 1
        return tree_unflatten(entry.outputs, entry.out_spec)

    def clear(self) -> None:
        """Drop every graph and its memory (the next decode steps capture again)."""
        if self._graphs or self._pool is not None:
            self.stats.resets += 1
        self._graphs.clear()
        self._pool = None
        self._addresses = None

    def _capture(self, leaves: list[Any], spec: Any) -> _Graph:
        """A warm-up run on a side stream (first kernels compiled, libraries' handles made),
        then the capture; the graph is not run here."""
        t0 = time.monotonic()
        inputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]

        def run() -> Any:
            args, kwargs = tree_unflatten(inputs, spec)
            return self.eager_forward(*args, **kwargs)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = run()
        self._pool = graph.pool()
        outputs, out_spec = tree_flatten(out)
        self.stats.captures += 1
        self.stats.capture_s += time.monotonic() - t0
        return _Graph(graph, inputs, outputs, out_spec)

    def _disable(self, err: BaseException) -> None:
        self.enabled = False
        self.stats.disabled = f"{type(err).__name__}: {err}"
        self.clear()
        log.warning(
            "megatron generation: capturing a decode step in a CUDA graph failed (%s); decode "
            "steps run eagerly from now on (generation.options.cuda_graphs=0 skips the attempt)",
            self.stats.disabled,
        )


def install(model: torch.nn.Module) -> DecodeGraphs:
    """Route ``model.decoder``'s forward through a :class:`DecodeGraphs` (idempotent: an
    installed one is returned)."""
    decoder = model.decoder
    current = decoder.__dict__.get("forward")
    if isinstance(current, DecodeGraphs):
        return current
    graphs = DecodeGraphs(decoder, decoder.forward, parameters=list(decoder.parameters()))
    decoder.forward = graphs  # nn.Module.__call__ reads the instance attribute first
    return graphs


def of(model: Any) -> DecodeGraphs | None:
    """The :class:`DecodeGraphs` installed on ``model``'s decoder, or None."""
    decoder = getattr(model, "decoder", None)
    current = None if decoder is None else decoder.__dict__.get("forward")
    return current if isinstance(current, DecodeGraphs) else None


def _graphable(context: Any) -> bool:
    """A dynamic-batching decode-only step that megatron-core padded to a graph's size."""
    return (
        context is not None
        and not context.is_static_batching()
        and context.is_decode_only()
        and context.using_cuda_graph_this_step()
    )


def _unwrapped(value: Any) -> Any:
    """megatron-core hands the decoder its input in a ``WrappedTensor`` (so the decoder can
    drop the caller's reference); a graph takes the tensor."""
    unwrap = getattr(value, "unwrap", None)
    return unwrap() if callable(unwrap) and not isinstance(value, torch.Tensor) else value


#: The context's buffers a step reads (megatron-core 0.16 allocates them in
#: ``allocate_all_tensors``, again at every ``resume``; other tensors it makes per step).
_CONTEXT_BUFFERS = ("memory_buffer", "token_to_", "request_")


def _addresses(context: Any, parameters: list[torch.nn.Parameter]) -> tuple[int, ...]:
    """Where every buffer a captured step reads lives: the context's KV cache, token and
    request buffers, its graph attention metadata's buffers, and the decoder's parameters."""
    ptrs: list[int] = []
    for name, value in vars(context).items():
        if name.startswith(_CONTEXT_BUFFERS):
            items = value.values() if isinstance(value, dict) else (value,)
            ptrs.extend(t.data_ptr() for t in items if isinstance(t, torch.Tensor))
    for metadata in getattr(context, "graph_attn_metadata", {}).values():
        ptrs.extend(t.data_ptr() for n, t in vars(metadata).items() if n.endswith("_buf"))
    ptrs.extend(p.data_ptr() for p in parameters)
    return tuple(ptrs)
