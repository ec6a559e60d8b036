"""Policy and generation as two processes on one GPU, without Ray (GPU test and bench).

:class:`ProcActor` runs a :class:`Host` in a ``spawn``-ed process and calls its
methods by name, in order, like a Ray actor would: ``submit`` then ``result``
(so both ends of a refit run at once), or ``call``. A :class:`Host` holds one
Megatron worker (policy or generation) on ``cuda:0`` with its own one-rank
NCCL default group and parallel state, as the backend's Ray actors do, plus
what the checks and the benchmark read from it (parameters, memory, timings).

Used by ``test_megatron_colocated_gpu.py`` and ``bench/colocated_gpu.py``.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any


class RemoteError(RuntimeError):
    """A method failed in the actor's process (the message holds its traceback)."""


class Host:
    """One process's worker and the helpers the drivers call on it."""

    def __init__(self) -> None:
        import torch

        torch.cuda.set_device(0)
        self.worker: Any = None

    # -- workers -----------------------------------------------------------------

    def start_policy(self, model_dir: str, dtype: str, seed: int, std: float | None = None) -> dict:
        """A TP=1 policy worker with megatron-core's random init (``std``: redraw matrices)."""
        import torch

        from rlcore.runtime.addresses import free_port
        from rlcore_megatron.options import MegatronOptions
        from rlcore_megatron.worker import MegatronPolicyWorker

        w = MegatronPolicyWorker(0, 1)
        w.init_process_group("127.0.0.1", free_port(), "nccl", 300.0)
        info = w.load(model_dir, dtype, MegatronOptions(seed=seed, micro_batch_size=8), "cuda", random_init=True)
        if std is not None:
            with torch.no_grad():
                for p in w.model.parameters():
                    if p.dim() > 1:
                        p.normal_(0, std)
        self.worker = w
        return info

    def start_generation(self, model_dir: str, dtype: str, seed: int, batch: int, seq: int, kv_gib: float) -> dict:
        """A refit-fed TP=1 generation worker (megatron-core's dynamic engine on CUDA)."""
        from rlcore.runtime.addresses import free_port
        from rlcore_megatron.options import MegatronOptions
        from rlcore_megatron.worker import MegatronGenerationWorker

        w = MegatronGenerationWorker(0, 1)
        w.init_process_group("127.0.0.1", free_port(), "nccl", 300.0)
        options = MegatronOptions(max_batch_size=batch, max_sequence_length=seq, seed=seed, kv_cache_gib=kv_gib)
        info = w.start(model_dir, dtype, options, "cuda")
        self.worker = w
        return info

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def set_native_refit(self, on: bool) -> None:
        """Offer the native layout on the channels opened from now on (off: the Hugging
        Face path between two identical layouts)."""
        self.worker.native_refit = on

    def timed(self, method: str, *args: Any, **kwargs: Any) -> tuple[float, Any]:
        """``(seconds, result)`` of a worker method, between two device waits."""
        import torch

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = getattr(self.worker, method)(*args, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    def timed_at(self, method: str, *args: Any, **kwargs: Any) -> tuple[float, float, Any]:
        """``(start, end, result)`` of a worker method on the host's monotonic clock (the same
        in every process of the machine), between two device waits."""
        import torch

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = getattr(self.worker, method)(*args, **kwargs)
        torch.cuda.synchronize()
        return t0, time.perf_counter(), out

    def poison_export(self, at: int, how: str) -> None:
        """The next export (Hugging Face or native stream, whichever the refit runs) fails
        after ``at`` tensors: ``raise`` an error, or yield a tensor of the wrong ``shape``.
        Later exports are the worker's own again."""
        w = self.worker
        originals = {m: getattr(type(w), m) for m in ("export_stream", "native_stream")}

        def poisoned(method: str) -> Any:
            for m, fn in originals.items():  # once
                setattr(w, m, fn.__get__(w))
            for i, (name, t) in enumerate(originals[method](w)):
                if i == at:
                    if how == "raise":
                        raise RuntimeError(f"export failed at tensor {i} ({name})")
                    t = t[:1]
                yield name, t

        w.export_stream = lambda: poisoned("export_stream")
        w.native_stream = lambda: poisoned("native_stream")

    def params(self) -> dict[str, Any]:
        """The model's parameters as CPU copies, by Megatron name."""
        return {n: p.detach().cpu().clone() for n, p in self.worker.model.named_parameters()}

    def optimizer_state(self) -> list[Any]:
        """The optimizer's tensors as CPU copies, in parameter order."""
        import torch

        return [
            v.detach().cpu().clone()
            for state in self.worker.optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        ]

    # -- memory and copies -----------------------------------------------------------

    def memory(self) -> dict[str, int]:
        import torch

        torch.cuda.synchronize()
        return {
            "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
            "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
        }

    def reset_peak(self) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def channel_state(self, key: str) -> dict[str, int]:
        """This process's cuda_ipc end of channel ``key``: storages shared (sender) or
        opened (receiver), staging buffer bytes; all 0 once closed."""
        from rlcore.refit.transports import cuda_ipc

        end = cuda_ipc._ends.get(key)
        if end is None:
            return {"shared": 0, "opened": 0, "staging": 0}
        return {
            "shared": len(getattr(end, "shared", {})),
            "opened": len(getattr(end, "opened", {})),
            "staging": int(end.staging[1].numel()) if getattr(end, "staging", None) else 0,
        }

    # -- benchmark pieces ------------------------------------------------------------------

    def copy_ceilings(self, repeats: int) -> dict[str, float]:
        """Medians (seconds) of copying the exported weights on this GPU, in this process:
        ``one_copy`` (all bytes as one buffer), ``per_tensor`` (one ``copy_`` per tensor),
        ``foreach`` (``torch._foreach_copy_``); and ``bytes``, ``tensors``."""
        import statistics

        import torch

        tensors = [t.contiguous() for _, t in self.worker.export_stream()]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        outs = [torch.empty_like(t) for t in tensors]

        def median(fn: Any) -> float:
            times = []
            for _ in range(repeats + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            return statistics.median(times[1:])

        out = {
            "bytes": float(nbytes),
            "tensors": float(len(tensors)),
            "one_copy": median(lambda: dst.copy_(src)),
            "per_tensor": median(lambda: [o.copy_(t) for o, t in zip(outs, tensors, strict=True)]),
            "foreach": median(lambda: torch._foreach_copy_(outs, tensors)),
        }
        tensors.clear()
        outs.clear()
        src.resize_(0)
        dst.resize_(0)
        self.empty_cache()
        return out

    def export_only(self) -> float:
        """Seconds to run the export alone (nothing sent), between two device waits."""
        import torch

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in self.worker.export_stream():
            pass
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def raw_open(self, spec: Any, rank: int, specs: list, flat: bool) -> None:
        """Join a channel whose ends are plain Hugging Face-layout tensors (the transport
        alone, no Megatron conversion on either side; the sender's are persistent): one
        allocation per tensor, or (``flat``) views of one buffer in plan order on both sides."""
        import torch

        from rlcore.refit import channels
        from rlcore.refit.transports import cuda_ipc

        if flat:
            dtype = getattr(torch, specs[0].dtype)
            assert all(s.dtype == specs[0].dtype for s in specs)
            buf = torch.ones(sum(s.numel for s in specs), dtype=dtype, device="cuda")
            tensors, off = [], 0
            for s in specs:
                tensors.append(buf[off : off + s.numel].view(s.shape))
                off += s.numel
        else:
            tensors = [torch.ones(s.shape, dtype=getattr(torch, s.dtype), device="cuda") for s in specs]
        self.raw = getattr(self, "raw", {})
        self.raw[spec.key] = ([s.name for s in specs], tensors)
        channels.open_channel(spec, rank)
        if rank == 0:
            cuda_ipc.register_persistent(spec, tensors)

    def raw_send(self, spec: Any, step: int, buckets: list) -> tuple[float, int]:
        import torch

        from rlcore.refit import channels

        names, tensors = self.raw[spec.key]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = channels.send_weights(spec, step, zip(names, tensors, strict=True), buckets)
        return time.perf_counter() - t0, n

    def raw_receive(self, spec: Any, step: int, buckets: list, mode: str) -> tuple[float, int]:
        """Receive into the same-layout tensors: one ``copy_`` per tensor as it is yielded
        (``per_tensor``), or once the last view arrived (before the stream ends: the views die
        then) one ``_foreach_copy_`` (``foreach``) or :func:`rlcore.refit.transports.cuda_ipc.copy_views`
        (``merged``: runs adjacent on both sides become one copy). Seconds and copies issued."""
        import torch

        from rlcore.refit import channels
        from rlcore.refit.transports import cuda_ipc

        _, dsts = self.raw[spec.key]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stream = channels.receive_weights(spec, 1, step, buckets)
        copies = 0
        if mode == "per_tensor":
            for dst, (_, t) in zip(dsts, stream, strict=True):
                dst.copy_(t)
            copies = len(dsts)
        else:
            views: list[Any] = []
            for _, t in stream:
                views.append(t)
                if len(views) == len(dsts):
                    if mode == "foreach":
                        torch._foreach_copy_(dsts, views)
                        copies = 1
                    else:
                        copies = cuda_ipc.copy_views(dsts, views)
                    views = []
        torch.cuda.synchronize()
        return time.perf_counter() - t0, copies

    def raw_close(self, spec: Any) -> None:
        from rlcore.refit import channels

        channels.close_channel(spec)
        getattr(self, "raw", {}).pop(spec.key, None)
        self.empty_cache()

    def channel_timings(self, key: str) -> dict[str, float]:
        """The parts of this end's last cuda_ipc refit (:attr:`rlcore.refit.transports.cuda_ipc._End.timings`)."""
        from rlcore.refit.transports import cuda_ipc

        return dict(cuda_ipc._ends[key].timings)

    def device_uuid(self) -> str:
        import torch

        return str(torch.cuda.get_device_properties(0).uuid)

    def free(self) -> None:
        """Drop the worker (teardown) and give its memory back."""
        if self.worker is not None:
            self.worker.teardown()
            self.worker = None
        self.empty_cache()


def _serve(conn: Any, env: dict[str, str]) -> None:
    os.environ.update(env)
    host = Host()
    while True:
        msg = conn.recv()
        if msg is None:
            break
        method, args, kwargs = msg
        try:
            conn.send(("ok", getattr(host, method)(*args, **kwargs)))
        except BaseException as err:  # reported to the driver, which raises it
            conn.send(("err", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    try:
        host.free()
    finally:
        conn.close()


class ProcActor:
    """A :class:`Host` in its own process (``spawn``), called in submission order."""

    def __init__(self, name: str, env: dict[str, str] | None = None) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, dict(env or {})), name=name, daemon=True)
        self.proc.start()
        child.close()
        self.name = name

    def submit(self, method: str, *args: Any, **kwargs: Any) -> None:
        self.conn.send((method, args, kwargs))

    def result(self, timeout: float = 600.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout:.0f}s")
        status, value = self.conn.recv()
        if status == "err":
            raise RemoteError(f"{self.name}: {value}")
        return value

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.submit(method, *args, **kwargs)
        return self.result()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def both(
    a: ProcActor, b: ProcActor, method: str | tuple[str, str], a_args: tuple, b_args: tuple, *, check: bool = True
) -> list[Any]:
    """``method`` (or one method each) on both actors at once (two ends of a channel), once
    both answered: their results, or (``check=False``) each result or the
    :class:`RemoteError` it raised."""
    ma, mb = (method, method) if isinstance(method, str) else method
    a.submit(ma, *a_args)
    b.submit(mb, *b_args)
    out: list[Any] = []
    for actor in (a, b):
        try:
            out.append(actor.result())
        except RemoteError as err:
            out.append(err)
    errors = [x for x in out if isinstance(x, RemoteError)]
    if check and errors:
        raise RemoteError("; ".join(map(str, errors)))
    return out
