"""The ``cuda_ipc`` refit transport: policy and generation colocated on one GPU.

No byte of the weights crosses a wire. The sender (channel rank 0) shares GPU
memory with the receivers through CUDA IPC handles (torch's CUDA tensor sharing,
:func:`torch.multiprocessing.reductions.reduce_tensor`); each receiver opens a
handle once per channel and reads the sender's memory in place: the tensors it
yields are views of the sender's memory, and the consumer's copy into its live
model is the only copy of a refit.

What is shared, once per channel:

* **persistent storages**: memory the sender registers with
  :func:`register_persistent` (its parameters) before a refit. A streamed tensor
  that is a view of one of them (a Megatron weight exported as is) is passed as
  ``(storage, offset, stride)``: nothing is copied on the sender's side;
* **a staging buffer** for every other tensor (gathered, converted or cast by the
  export, or on another device): packed into one buffer on the sender's GPU at a
  fixed offset per tensor, reused from one refit to the next (grown, and shared
  again, only when a refit stages more than the last).

Side channel: a :class:`torch.distributed.TCPStore` hosted by the sender, the
same rendezvous the collective transport uses (``addr``/``port`` of
:class:`~rlcore.refit.specs.ChannelSpec`). It reaches Ray actors that are not
each other's parent or child (a ``multiprocessing`` connection would need one side
to listen and pass an authentication key around), every wait has the channel's
timeout, and a dead sender takes the store down with it, so receivers fail at once
instead of waiting. Messages are a few kilobytes of pickled metadata.

Protocol (``seq`` counts the channel's refits on every rank):

1. open: the sender puts its GPU's UUID; each receiver refuses unless its current
   GPU has the same UUID (indices differ between processes with their own
   ``CUDA_VISIBLE_DEVICES``; UUIDs name the physical device) and answers
   ``joined/<rank>``; the sender fails too when one refuses. Each end may have
   offered a *native layout* (:func:`offer_layout`: a fingerprint of how its
   backend holds the weights: names, shapes, dtypes, parallel layout); receivers put
   theirs (or nothing) under ``layout/<rank>`` before joining, and the sender puts
   the *agreed* layout under ``layout``: its own when every receiver offered the
   same, else nothing. Both ends read it before any refit (:func:`agreed_layout`);
   with one agreed, the backends may stream their own tensors under their own plan
   instead of the Hugging Face plan (no conversion on either side), and every
   message names the layout it follows, which the receiver checks against its own
   before it yields a tensor.
2. refit: the sender walks the plan (:func:`rlcore.refit.specs.buckets_in_order`
   checks every name, shape and dtype), stages what must be staged, waits for its
   device (``synchronize``: the export and the packs are done) and puts one message
   ``m/<seq>``: an entry per tensor and the handles not shared before. If its stream
   fails or leaves the plan, it puts an abort message instead, so no receiver
   writes a byte of a refit that failed on the sender's side.
3. each receiver opens the new handles, checks every entry against the plan
   (bounds in the shared memory included) before it yields the first tensor,
   yields views, records its completion event once the consumer is done (its
   copies are queued: an interprocess CUDA event, shared at open), and answers
   ``a/<seq>/<rank>`` (``ok`` or the error) at once. The sender returns once every
   receiver answered and every receiver's event completed (their copies are
   finished): until then nothing it shares may change. The answer's round trip thus
   overlaps the copies; each receiver deletes the previous message's keys after
   answering (off the sender's path).
   A message that repeats the last one (the steady state: same storages, offsets
   and plan) is answered with the views built last time; a consumer whose weights
   lie in one buffer in the sender's order copies with :func:`copy_views`, which
   merges adjacent copies (one copy for the whole model when both sides are flat).

Every wait is bounded by ``timeout_s`` (then the channel is marked broken and
refuses further refits: reopen it), and :func:`close_channel` ends a wait in
progress at once (cancellation, teardown).

Shutdown (:func:`close_channel`): receivers drop every view and opened handle (their
mappings close); the sender drops its references to shared memory and calls
``torch.cuda.ipc_collect`` (memory a receiver still had open when the sender
freed it is released then). A failed refit keeps no handle beyond the channel's.
"""

from __future__ import annotations

import datetime
import logging
import pickle
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from rlcore.declarations import Transport
from rlcore.errors import RefitError
from rlcore.refit.specs import ChannelSpec, TensorSpec, buckets_in_order
from rlcore.refit.transports.base import RefitTransport

if TYPE_CHECKING:
    from rlcore.refit.transports.base import ChannelRequest

log = logging.getLogger(__name__)

#: Alignment (bytes) of every tensor in the staging buffer.
ALIGN = 512
#: Entry ``sid`` of an empty tensor (nothing shared).
_EMPTY = -1


class IpcLayer(Protocol):
    """What the transport needs from the device: CUDA in :class:`CudaIpc`; tests may pass
    a double on machines without CUDA."""

    def device(self) -> Any:
        """The torch device this process's end works on."""

    def device_uuid(self) -> str:
        """The physical device's UUID."""

    def share(self, flat: Any) -> Any:
        """A picklable handle to ``flat`` (a uint8 tensor over a whole storage)."""

    def open(self, handle: Any) -> Any:
        """The tensor behind ``handle``, in this process (the receiver's side)."""

    def synchronize(self) -> None:
        """Wait until this process's work on the device is done."""

    def collect(self) -> None:
        """Release shared memory no receiver holds any more (sender, after close)."""

    def event(self) -> tuple[Any, Any]:
        """A receiver's completion event and a picklable handle to it (CUDA: an interprocess
        event). A layer without events makes receivers synchronize before they answer."""

    def open_event(self, handle: Any) -> Any:
        """The sender's side of a receiver's event."""

    def record(self, event: Any) -> None:
        """Receiver: mark the work queued so far (its copies from shared memory)."""

    def wait_event(self, event: Any) -> None:
        """Sender: wait until the receiver's work marked by its last record is done."""


class CudaIpc:
    """:class:`IpcLayer` over torch's CUDA tensor sharing, on the current CUDA device."""

    def device(self) -> Any:
        import torch

        return torch.device("cuda", torch.cuda.current_device())

    def device_uuid(self) -> str:
        import torch

        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    def share(self, flat: Any) -> Any:
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(flat)
        return rebuild.__name__, args

    def open(self, handle: Any) -> Any:
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        name, args = handle
        if name != rebuild_cuda_tensor.__name__ or not isinstance(args[6], int):
            raise RefitError(f"cuda_ipc: not a CUDA tensor handle ({name}); sender and receiver run other torch versions?")
        # args[6] is the sender's device index; the UUID check at open made sure the
        # receiver's current device is the same GPU, whatever its index is here.
        args = (*args[:6], torch.cuda.current_device(), *args[7:])
        return rebuild_cuda_tensor(*args)

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def collect(self) -> None:
        import torch

        torch.cuda.ipc_collect()

    def event(self) -> tuple[Any, Any]:
        import torch

        ev = torch.cuda.Event(interprocess=True)  # timing off, as IPC needs
        return ev, bytes(ev.ipc_handle())

    def open_event(self, handle: Any) -> Any:
        import torch

        return torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), handle)

    def record(self, event: Any) -> None:
        event.record()

    def wait_event(self, event: Any) -> None:
        event.synchronize()


def _flat(t: Any) -> Any:
    """A uint8 tensor over the whole storage of ``t``."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class _End:
    """What both ends hold: the store, the sequence number, waits with a deadline."""

    def __init__(self, spec: ChannelSpec, rank: int, ipc: IpcLayer) -> None:
        import torch.distributed as dist

        if spec.addr is None or spec.port is None:
            raise RefitError(f"cuda_ipc channel {spec.key} has no rendezvous address (addr/port)")
        self.spec, self.rank, self.ipc = spec, rank, ipc
        self.timeout_s = float(spec.timeout_s)
        from rlcore.runtime.rendezvous import tcp_store  # loopback-only on a single host

        store = tcp_store(spec.addr, spec.port, spec.world_size, rank == 0, self.timeout_s)
        self.store = dist.PrefixStore(f"rlcore-ipc-{spec.key}", store)
        self._tcp = store  # keep the server (rank 0) alive as long as the channel
        self.seq = 0
        #: seconds of the last refit's parts (sender: walk, synchronize, wait for the answers,
        #: copies (the receivers' events); receiver: wait for the message, views, consume, signal)
        self.timings: dict[str, float] = {}
        self.waiting: str | None = None  # the key a wait is blocked on
        self.closed = threading.Event()
        self.broken: str | None = None
        #: the native layout both sides agreed on at open ("" when none), and why not
        self.agreed = ""
        self.why_not_native = ""

    def get(self, key: str, what: str) -> bytes:
        """The value of ``key`` once some rank puts it: bounded by the channel's timeout,
        ended at once by :meth:`wake` (close), failing at once when the store's host is gone."""
        import torch.distributed as dist

        if self.closed.is_set():
            raise RefitError(f"cuda_ipc channel {self.spec.key} was closed before waiting for {what}")
        self.waiting = key
        try:
            value = bytes(self.store.get(key))
        except dist.DistStoreError as err:
            timed_out = "timeout" in str(err).lower()
            self.broken = f"timed out waiting for {what}" if timed_out else f"store failed: {err}"
            if timed_out:
                raise RefitError(
                    f"cuda_ipc channel {self.spec.key}: rank {self.rank} waited {self.timeout_s:.0f}s for {what} "
                    "(refit.timeout_s); the other side is stuck or gone"
                ) from err
            raise RefitError(
                f"cuda_ipc channel {self.spec.key}: rank {self.rank} lost the side channel waiting for {what} "
                f"(the sender's process is gone?): {err}"
            ) from err
        except (RuntimeError, OSError) as err:  # DistNetworkError and friends: the host died
            self.broken = f"store failed: {err}"
            raise RefitError(
                f"cuda_ipc channel {self.spec.key}: rank {self.rank} lost the side channel waiting for {what} "
                f"(the sender's process is gone?): {err}"
            ) from err
        finally:
            self.waiting = None
        if self.closed.is_set():
            raise RefitError(f"cuda_ipc channel {self.spec.key} was closed while waiting for {what}")
        return value

    def wake(self) -> None:
        """Closing: mark the end closed and end a wait in progress (its key is set)."""
        import torch.distributed as dist

        self.closed.set()
        key = self.waiting
        if key is not None:
            try:  # a client of its own: the end's client is blocked in the wait
                client = dist.TCPStore(
                    self.spec.addr, self.spec.port, None, False,  # type: ignore[arg-type]
                    timeout=datetime.timedelta(seconds=10), wait_for_workers=False,
                )
                dist.PrefixStore(f"rlcore-ipc-{self.spec.key}", client).set(
                    key, pickle.dumps({"abort": "the channel was closed"})
                )
            except Exception as err:  # the store is gone: the wait ends by itself
                log.debug("cuda_ipc %s: waking a wait failed: %s", self.spec.key, err)

    def check_usable(self) -> None:
        if self.broken is not None:
            raise RefitError(
                f"cuda_ipc channel {self.spec.key} is broken ({self.broken}); close it and open a new one"
            )


class SenderEnd(_End):
    """Channel rank 0: shares persistent storages and a staging buffer (see the module doc)."""

    def __init__(self, spec: ChannelSpec, ipc: IpcLayer, layout: str = "") -> None:
        super().__init__(spec, 0, ipc)
        self.device = ipc.device()
        self.is_cuda = self.device.type == "cuda"
        #: storage data_ptr -> (sid, flat tensor): shared with the receivers
        self.shared: dict[int, tuple[int, Any]] = {}
        #: storage data_ptr -> flat tensor: registered, shared at its first use
        self.persistent: dict[int, Any] = {}
        self.next_sid = 0
        self.staging: tuple[int, Any] | None = None  # (sid, buffer)
        self.slots: dict[int, int] = {}  # plan index -> byte offset in the staging buffer
        self.slots_plan: Any = None  # the plan the slots were given for (a native plan is another)
        self.plan_bytes = 0  # the bytes that plan describes
        self.release_next: list[int] = []  # sids the receivers drop at the next message
        self.store.set("uuid", ipc.device_uuid())
        refused = []
        for r in range(1, spec.world_size):
            answer = self.get(f"joined/{r}", f"receiver rank {r} to join")
            if answer != b"ok":
                refused.append(answer.decode(errors="replace"))
        theirs = {r: self.get(f"layout/{r}", f"receiver rank {r}'s layout").decode() for r in range(1, spec.world_size)}
        #: each receiver's completion event (receivers whose layer has none synchronize instead)
        self.events: dict[int, Any] = {}
        if not refused:
            for r in range(1, spec.world_size):
                handle = pickle.loads(self.get(f"event/{r}", f"receiver rank {r}'s event"))
                if handle is not None:
                    self.events[r] = ipc.open_event(handle)
        self.agreed, self.why_not_native = _agree(layout, theirs)
        self.store.set("layout", "" if refused else self.agreed)  # joined receivers wait for it
        if refused:
            raise RefitError("cuda_ipc channel refused: " + "; ".join(refused))

    def register(self, tensors: Iterable[Any]) -> int:
        """Remember the storages of ``tensors`` (on this end's device) as persistent."""
        n = 0
        for t in tensors:
            if t.device == self.device and t.numel():
                storage = t.untyped_storage()
                if storage.data_ptr() not in self.persistent and storage.data_ptr() not in self.shared:
                    self.persistent[storage.data_ptr()] = _flat(t)
                    n += 1
        return n

    def _share(self, flat: Any, handles: dict[int, Any]) -> int:
        sid, self.next_sid = self.next_sid, self.next_sid + 1
        handles[sid] = self.ipc.share(flat)
        return sid

    def send(
        self, named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]], layout: str = ""
    ) -> int:
        self.check_usable()
        if layout and layout != self.agreed:
            raise RefitError(
                f"cuda_ipc channel {self.spec.key}: the sender streams native layout {layout[:12]}, but the channel "
                f"agreed on {self.agreed[:12] or 'none'} at open ({self.why_not_native or 'agreed'}); "
                "stream the plan's tensors instead"
            )
        seq, self.seq = self.seq, self.seq + 1
        t0 = time.perf_counter()
        if self.slots_plan is not buckets and self.slots_plan != buckets:
            self.slots.clear()  # another plan: its indices name other tensors (the buffer stays, regrown if short)
            self.slots_plan = buckets
            self.plan_bytes = sum(s.nbytes for bucket in buckets for s in bucket)
        new: list[int] = []  # storages first used now: shared only once the stream went through
        try:
            message, pending = self._collect(named, buckets, new)
            message["layout"] = layout
        except BaseException as err:
            for ptr in new:  # never shared: no handle exists, nothing to release
                self.persistent[ptr] = self.shared.pop(ptr)[1]
            self._abort(seq, err)
            raise
        try:
            for ptr in new:
                sid, flat = self.shared[ptr]
                message["handles"][sid] = self.ipc.share(flat)
            self._stage(message, pending)
            t1 = time.perf_counter()
            self.ipc.synchronize()  # the export and the packs are done before anyone reads
        except BaseException as err:
            self.broken = f"refit message {seq} failed after sharing memory: {err}"
            self._abort(seq, err)
            raise
        t2 = time.perf_counter()
        self.store.set(f"m/{seq}", pickle.dumps(message))
        errors = []
        for r in range(1, self.spec.world_size):
            answer = self.get(f"a/{seq}/{r}", f"receiver rank {r} to finish refit message {seq}")
            if answer != b"ok":
                errors.append(f"rank {r}: {answer.decode(errors='replace')}")
        t3 = time.perf_counter()
        for event in self.events.values():  # the receivers answered at once; their copies end now
            self.ipc.wait_event(event)
        self.timings = {"walk": t1 - t0, "synchronize": t2 - t1, "wait": t3 - t2, "copies": time.perf_counter() - t3}
        # (the receivers delete this message's keys at the next one: off this side's critical path)
        if message["release"]:  # every receiver dropped them before answering
            self.ipc.collect()
        if errors:
            raise RefitError(f"cuda_ipc refit failed on the receiving side: {'; '.join(errors)}")
        return self.plan_bytes

    def _abort(self, seq: int, err: BaseException) -> None:
        """Tell the receivers that message ``seq`` will not come (they write nothing)."""
        self.store.set(f"m/{seq}", pickle.dumps({"abort": f"{type(err).__name__}: {err}"}))

    def _collect(
        self, named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]], new: list[int]
    ) -> tuple[dict[str, Any], list[tuple[int, Any]]]:
        """Walk the stream in plan order: one entry per tensor (staged ones filled in by
        :meth:`_stage`) and the tensors still to stage; ``new`` gets the persistent
        storages used for the first time."""
        entries: list[tuple[int, int, tuple[int, ...]]] = []
        pending: list[tuple[int, Any]] = []  # (plan index, tensor) without a staging slot
        stage_now: list[tuple[Any, Any]] = []  # (slot view, tensor), copied in one batch
        index = 0
        for _, tensors in buckets_in_order(named, buckets):
            for t in tensors:
                entry = self._direct(t, new)
                if entry is None:
                    off = self.slots.get(index)
                    if t.numel() == 0:
                        entry = (_EMPTY, 0, ())
                    elif off is not None and self.staging is not None:
                        view = self.staging[1][off : off + t.numel() * t.element_size()]
                        stage_now.append((view.view(t.dtype).view(t.shape), t))
                        entry = (self.staging[0], off // t.element_size(), _contiguous_stride(t.shape))
                    else:
                        pending.append((index, t))
                entries.append(entry)
                index += 1
            _copy_batch(stage_now)
            stage_now.clear()
        release, self.release_next = self.release_next, []
        return {"entries": entries, "handles": {}, "release": release}, pending

    def _direct(self, t: Any, new: list[int]) -> tuple[int, int, tuple[int, ...]] | None:
        if t.is_cuda != self.is_cuda or t.numel() == 0:
            return None
        offset = t.storage_offset()
        ptr = t.data_ptr() - offset * t.element_size()  # its storage's start
        found = self.shared.get(ptr)
        if found is None:
            if t.device != self.device:
                return None
            flat = self.persistent.pop(ptr, None)
            if flat is None:
                return None
            found = self.shared[ptr] = (self.next_sid, flat)
            self.next_sid += 1
            new.append(ptr)
        # (a storage's address is unique while it is alive, and the end keeps it alive)
        return found[0], offset, t.stride()

    def _stage(self, message: dict[str, Any], pending: list[tuple[int, Any]]) -> None:
        """Give the tensors without a slot one (growing the staging buffer: the old one's
        contents are carried over, the new one shared, the old one released)."""
        import torch

        if not pending:
            return
        fresh = not self.slots  # no slot in use (first refit, or the plan changed): start at 0
        size = self.staging[1].numel() if self.staging and not fresh else 0
        for index, t in pending:
            size = -(-size // ALIGN) * ALIGN
            self.slots[index] = size
            size += t.numel() * t.element_size()
        old = self.staging
        if fresh and old is not None and size <= old[1].numel():
            sid, buf = old  # the buffer the receivers already opened is large enough
            old = None
        else:
            buf = torch.empty(-(-size // ALIGN) * ALIGN, dtype=torch.uint8, device=self.device)
            if old is not None:
                if not fresh:
                    buf[: old[1].numel()].copy_(old[1])
                message["release"].append(old[0])
                self.shared.pop(old[1].data_ptr(), None)
            sid = self._share(buf, message["handles"])
            self.staging = (sid, buf)
            self.shared[buf.data_ptr()] = (sid, buf)
        entries = message["entries"]
        for i, entry in enumerate(entries):  # earlier slots now live in the new buffer
            if old is not None and entry is not None and entry[0] == old[0]:
                entries[i] = (sid, entry[1], entry[2])
        batch = []
        for index, t in pending:
            off = self.slots[index]
            view = buf[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            batch.append((view, t))
            entries[index] = (sid, off // t.element_size(), _contiguous_stride(t.shape))
        _copy_batch(batch)

    def close(self) -> None:
        self.wake()
        self.events = {}
        self.shared.clear()
        self.persistent.clear()
        self.staging = None
        self.slots.clear()
        try:
            self.ipc.synchronize()
            self.ipc.collect()
        except Exception as err:  # closing must not raise
            log.debug("cuda_ipc %s: collecting shared memory failed: %s", self.spec.key, err)
        self._tcp = self.store = None  # type: ignore[assignment]


class ReceiverEnd(_End):
    """Channel ranks 1..N: opens handles once, yields checked views of the sender's memory."""

    def __init__(self, spec: ChannelSpec, rank: int, ipc: IpcLayer, layout: str = "") -> None:
        super().__init__(spec, rank, ipc)
        self.opened: dict[int, Any] = {}
        #: (message bytes, plan, views, layout) of the last message: a refit that repeats it reuses the views
        self.cached: tuple[bytes, Any, list[list[Any]], str] | None = None
        sender = self.get("uuid", "the sender's device").decode()
        mine = ipc.device_uuid()
        if sender != mine:
            reason = (
                f"receiver rank {rank} is on GPU {mine}, the sender on GPU {sender}: cuda_ipc needs both on "
                "the same physical device (placement.colocated with the same GPUs); use "
                "refit.transport: collective"
            )
            self.store.set(f"layout/{rank}", "")
            self.store.set(f"joined/{rank}", reason)
            raise RefitError(f"cuda_ipc channel {spec.key} refused: {reason}")
        self.store.set(f"layout/{rank}", layout)
        #: recorded once the consumer's copies are queued; the sender waits for it (None: synchronize)
        self.event: Any = None
        handle = None
        if hasattr(ipc, "event"):
            self.event, handle = ipc.event()
        self.store.set(f"event/{rank}", pickle.dumps(handle))
        self.store.set(f"joined/{rank}", "ok")
        self.agreed = self.get("layout", "the sender's layout agreement").decode()
        if not self.agreed:
            self.why_not_native = "not every end offered the same native layout" if layout else "this receiver offered none"
        elif self.agreed != layout:  # the sender agrees only on what every receiver offered
            raise RefitError(f"cuda_ipc channel {spec.key}: the sender agreed on a layout rank {rank} never offered")

    def receive(self, buckets: Sequence[Sequence[TensorSpec]], layout: str = "") -> Iterator[tuple[str, Any]]:
        self.check_usable()
        seq, self.seq = self.seq, self.seq + 1
        answer = "ok"
        t0 = time.perf_counter()
        try:
            raw = self.get(f"m/{seq}", f"refit message {seq} from the sender")
            t1 = time.perf_counter()
            views: Any = self._message_views(raw, buckets, layout)
            t2 = time.perf_counter()
            for bucket, bucket_views in zip(buckets, views, strict=True):
                yield from zip((s.name for s in bucket), bucket_views, strict=True)
            views = bucket_views = None
            t3 = time.perf_counter()
            self.timings = {"wait": t1 - t0, "views": t2 - t1, "consume": t3 - t2}
        except BaseException as err:
            if not isinstance(err, GeneratorExit):
                self.cached = None
            answer = "the receiver stopped reading" if isinstance(err, GeneratorExit) else f"{type(err).__name__}: {err}"
            raise
        finally:
            if self.broken is None and self.store is not None:
                self._answer(seq, answer)

    def _message_views(self, raw: bytes, buckets: Sequence[Sequence[TensorSpec]], layout: str) -> Any:
        """The checked views of message ``raw`` (the last ones when it repeats the last message),
        after opening the handles it shares and dropping those it releases."""
        cached = self.cached
        if (
            cached is not None and cached[0] == raw and cached[3] == layout
            and (cached[1] is buckets or cached[1] == buckets)
        ):
            # the same tensors where they were last time (no handle opened or released):
            # the same checked views
            return cached[2]
        message: dict[str, Any] = pickle.loads(raw)
        if "abort" in message:
            raise RefitError(f"the sender aborted the refit before any byte was written: {message['abort']}")
        self.cached = None
        # handles first: a message refused below leaves this end holding what the sender shared
        for sid in message["release"]:
            self.opened.pop(sid, None)
        for sid, handle in message["handles"].items():
            self.opened[sid] = self.ipc.open(handle)
        if message.get("layout", "") != layout:
            raise RefitError(
                f"cuda_ipc: the sender streams {_layout_name(message.get('layout', ''))}, this receiver "
                f"expects {_layout_name(layout)}; nothing was written"
            )
        views = self._views(message, buckets)
        if not message["handles"] and not message["release"]:
            self.cached = (raw, buckets, views, layout)
        else:  # the next message repeats this one without the handles
            self.cached = (pickle.dumps({**message, "handles": {}, "release": []}), buckets, views, layout)
        return views

    def _answer(self, seq: int, answer: str) -> None:
        """Tell the sender this end is done with message ``seq`` (``ok`` or the error)."""
        try:
            # the consumer's copies from the sender's memory are done before it may change:
            # the sender waits for this event (or this side for its device) after the answer
            t4 = time.perf_counter()
            if self.event is not None:
                self.ipc.record(self.event)
            else:
                self.ipc.synchronize()
            self.timings["signal"] = time.perf_counter() - t4
            self.store.set(f"a/{seq}/{self.rank}", answer)
            if seq:  # the last message's keys: every end is past them (rank 1 deletes the message)
                if self.rank == 1:
                    self.store.delete_key(f"m/{seq - 1}")
                self.store.delete_key(f"a/{seq - 1}/{self.rank}")
        except Exception as err:  # the sender is gone: nothing to tell
            log.debug("cuda_ipc %s: answering failed: %s", self.spec.key, err)

    def _views(self, message: dict[str, Any], buckets: Sequence[Sequence[TensorSpec]]) -> list[list[Any]]:
        """Every tensor of the plan as a view of shared memory, checked before any is yielded."""
        import torch

        entries = message["entries"]
        n = sum(len(b) for b in buckets)
        if len(entries) != n:
            raise RefitError(f"cuda_ipc: the sender's message has {len(entries)} tensors, the plan {n}")
        out: list[list[Any]] = []
        it = iter(entries)
        for bucket in buckets:
            views = []
            for s in bucket:
                sid, offset, stride = next(it)
                dtype = getattr(torch, s.dtype)
                if sid == _EMPTY:
                    if s.numel:
                        raise RefitError(f"cuda_ipc: '{s.name}' arrived empty, the plan says {s.shape}")
                    views.append(torch.empty(s.shape, dtype=dtype, device=self.ipc.device()))
                    continue
                base = self.opened.get(sid)
                if base is None:
                    raise RefitError(f"cuda_ipc: '{s.name}' is in shared memory {sid}, which this receiver never opened")
                if len(stride) != len(s.shape):
                    raise RefitError(f"cuda_ipc: '{s.name}' has strides {stride} for shape {s.shape}")
                extent = offset + 1 + sum((d - 1) * st for d, st in zip(s.shape, stride, strict=True))
                if offset < 0 or min(stride, default=0) < 0 or extent * dtype.itemsize > base.numel():
                    raise RefitError(
                        f"cuda_ipc: '{s.name}' reaches byte {extent * dtype.itemsize} of shared memory {sid} "
                        f"({base.numel()} bytes)"
                    )
                view = torch.empty(0, dtype=dtype, device=base.device)
                views.append(view.set_(base.untyped_storage(), offset, s.shape, stride))
            out.append(views)
        return out

    def close(self) -> None:
        self.wake()
        self.cached = None
        self.opened.clear()
        self.event = None
        try:
            self.ipc.synchronize()
        except Exception as err:  # closing must not raise
            log.debug("cuda_ipc %s: synchronize at close failed: %s", self.spec.key, err)
        self._tcp = self.store = None  # type: ignore[assignment]


def _agree(mine: str, theirs: dict[int, str]) -> tuple[str, str]:
    """The sender's choice: ``(agreed layout, why none)`` from its own offer and each receiver's."""
    if not mine:
        return "", "the sender offered no native layout"
    for rank, layout in sorted(theirs.items()):
        if not layout:
            return "", f"receiver rank {rank} offered no native layout"
        if layout != mine:
            return "", f"receiver rank {rank} holds another layout ({layout[:12]}) than the sender ({mine[:12]})"
    return mine, ""


def _layout_name(layout: str) -> str:
    return f"native layout {layout[:12]}" if layout else "the plan's (Hugging Face) tensors"


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(stride))


#: copy_views' last plan: weak references to its tensors, their addresses, the runs found
_last_plan: tuple[tuple[Any, ...], list[int], list[tuple[int, int]]] | None = None


def copy_views(dsts: Sequence[Any], srcs: Sequence[Any]) -> int:
    """``dst.copy_(src)`` for every pair, with runs merged into one copy: consecutive pairs
    whose destinations follow each other in one storage, and whose sources do too, with the
    same dtype, both contiguous (a receiver whose weights lie in one buffer in the sender's
    order writes them in place with a single copy). The runs found are remembered for the
    same tensor objects (a receiver yields the same views while a refit repeats the last).
    Returns the number of copies issued."""
    import weakref

    import torch

    global _last_plan
    tensors = (*dsts, *srcs)
    ptrs = [t.data_ptr() for t in tensors]  # the same objects may have been given new memory
    last = _last_plan
    if (
        last is not None and last[1] == ptrs
        and all(r() is t for r, t in zip(last[0], tensors, strict=True))
    ):
        runs = last[2]
    else:
        runs = _runs(dsts, srcs)
        _last_plan = (tuple(weakref.ref(t) for t in tensors), ptrs, runs)
    for i, j in runs:
        d, s = dsts[i], srcs[i]
        if j - i == 1:
            d.copy_(s)
            continue
        last_d = dsts[j - 1]
        span = (last_d.data_ptr() - d.data_ptr()) // d.element_size() + last_d.numel()
        run_d = torch.empty(0, dtype=d.dtype, device=d.device).set_(d.untyped_storage(), d.storage_offset(), (span,), (1,))
        run_s = torch.empty(0, dtype=s.dtype, device=s.device).set_(s.untyped_storage(), s.storage_offset(), (span,), (1,))
        run_d.copy_(run_s)
    return len(runs)


def _runs(dsts: Sequence[Any], srcs: Sequence[Any]) -> list[tuple[int, int]]:
    """Index ranges ``[i, j)`` of :func:`copy_views`' runs."""
    runs = []
    i, n = 0, len(dsts)
    while i < n:
        d, s = dsts[i], srcs[i]
        j = i + 1
        if d.is_contiguous() and s.is_contiguous() and d.dtype == s.dtype and d.shape == s.shape:
            item = d.element_size()
            d_end = d.data_ptr() + d.numel() * item
            s_end = s.data_ptr() + s.numel() * item
            d_base, s_base = d.data_ptr() - d.storage_offset() * item, s.data_ptr() - s.storage_offset() * item
            while j < n:
                dj, sj = dsts[j], srcs[j]
                if not (
                    dj.data_ptr() == d_end and sj.data_ptr() == s_end and dj.dtype == d.dtype == sj.dtype
                    and dj.shape == sj.shape and dj.is_contiguous() and sj.is_contiguous()
                    and dj.data_ptr() - dj.storage_offset() * item == d_base
                    and sj.data_ptr() - sj.storage_offset() * item == s_base
                ):
                    break
                d_end += dj.numel() * item
                s_end += sj.numel() * item
                j += 1
        runs.append((i, j))
        i = j
    return runs


def _copy_batch(pairs: Sequence[tuple[Any, Any]]) -> None:
    """``dst.copy_(src)`` for every pair, batched (``torch._foreach_copy_``) where possible."""
    import torch

    if not pairs:
        return
    same = [(d, s) for d, s in pairs if s.device == d.device]
    other = [(d, s) for d, s in pairs if s.device != d.device]
    if same:
        torch._foreach_copy_([d for d, _ in same], [s for _, s in same])
    for d, s in other:
        d.copy_(s, non_blocking=False)


_ends: dict[str, _End] = {}
_pending_persistent: dict[str, list[Any]] = {}
_pending_layout: dict[str, str] = {}
_lock = threading.Lock()


def default_ipc() -> IpcLayer:
    """The IPC layer channels use (:class:`CudaIpc`); tests without CUDA replace it."""
    return CudaIpc()


def open_channel(spec: ChannelSpec, rank: int, ipc: IpcLayer | None = None) -> None:
    """Open this process's end of ``spec`` as ``rank`` (all ranks at once: the sender waits
    for every receiver's device check). Idempotent per channel key."""
    if spec.key in _ends:
        return
    layer = ipc if ipc is not None else default_ipc()
    with _lock:
        layout = _pending_layout.pop(spec.key, "")
    end: _End = SenderEnd(spec, layer, layout) if rank == 0 else ReceiverEnd(spec, rank, layer, layout)
    with _lock:
        _ends[spec.key] = end
        pending = _pending_persistent.pop(spec.key, None)
    if pending and isinstance(end, SenderEnd):
        end.register(pending)


def register_persistent(spec: ChannelSpec, tensors: Iterable[Any]) -> None:
    """Sender: storages of ``tensors`` stay allocated, at the same address, for the
    channel's life (a model's parameters, updated in place): a streamed tensor that is a
    view of one is shared without a copy. Anything else the stream yields is staged.
    Call it before or after :func:`open_channel`."""
    tensors = list(tensors)
    with _lock:
        end = _ends.get(spec.key)
        if end is None:
            _pending_persistent.setdefault(spec.key, []).extend(tensors)
            return
    if not isinstance(end, SenderEnd):
        raise RefitError(f"cuda_ipc channel {spec.key}: only the sender (rank 0) registers persistent storages")
    end.register(tensors)


def offer_layout(spec: ChannelSpec, layout: str) -> None:
    """Before :func:`open_channel`: this end holds its weights in the native layout named
    ``layout`` (a fingerprint its backend computes: every native tensor's name, shape and
    dtype, the parallel layout, the model). The channel agrees on it at open when the
    sender and every receiver offered the same (:func:`agreed_layout`)."""
    with _lock:
        if spec.key in _ends:
            raise RefitError(f"cuda_ipc channel {spec.key} is already open: offer a layout before opening it")
        _pending_layout[spec.key] = layout


def agreed_layout(spec: ChannelSpec) -> tuple[str, str]:
    """``(layout, why not)`` of this process's open end: the native layout every end
    offered at open, or ``""`` and the reason (an end offered none or another)."""
    end = _ends.get(spec.key)
    if end is None:
        raise RefitError(f"cuda_ipc channel {spec.key} is not open in this process")
    return end.agreed, end.why_not_native


def _end(spec: ChannelSpec, kind: type, who: str) -> Any:
    end = _ends.get(spec.key)
    if not isinstance(end, kind):
        raise RefitError(f"cuda_ipc channel {spec.key} is not open on the {who}")
    return end


def send_weights(
    spec: ChannelSpec, named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]], layout: str = ""
) -> int:
    """Share the stream (plan order) with the receivers; returns once every receiver has
    copied what it needs. Bytes described. ``layout``: the stream is the agreed native
    layout's tensors under its own plan (refused unless the channel agreed on it)."""
    return int(_end(spec, SenderEnd, "sender").send(named, buckets, layout))


def receive_weights(
    spec: ChannelSpec, buckets: Sequence[Sequence[TensorSpec]], layout: str = ""
) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, view of the sender's memory)`` in plan order, all checked first
    (``layout``: the native layout this receiver expects; the sender's message must name it).

    The views are valid until the generator finishes: copy them, do not keep them
    (the sender's next optimizer step writes that memory). Iterate to the end: the
    sender waits for this receiver's answer, which is sent when the generator ends.
    """
    return _end(spec, ReceiverEnd, "receiver").receive(buckets, layout)


def close_channel(spec: ChannelSpec) -> None:
    """Close this process's end: drop every view, handle and shared buffer."""
    with _lock:
        end = _ends.pop(spec.key, None)
        _pending_persistent.pop(spec.key, None)
        _pending_layout.pop(spec.key, None)
    if end is not None:
        end.close()  # type: ignore[attr-defined]


def ceiling(spec: ChannelSpec, rank: int, nbytes: int) -> float:
    """One device-to-device copy of ``nbytes`` from the sender's memory into the receiver's
    over this channel (handles opened first, not timed on the receiver); seconds.

    The sender shares a fresh buffer (released afterwards) and returns the whole
    exchange's time; a receiver times its copy alone, between two device waits.
    """
    import torch

    name = "raw"
    plan = [[TensorSpec(name, (nbytes,), "uint8")]]
    t0 = time.monotonic()
    if rank == 0:
        end = _end(spec, SenderEnd, "sender")
        buf = torch.ones(nbytes, dtype=torch.uint8, device=end.device)
        end.register([buf])
        try:
            end.send([(name, buf)], plan)
        finally:
            shared = end.shared.pop(buf.untyped_storage().data_ptr(), None)
            if shared is not None:
                end.release_next.append(shared[0])
            del buf, shared
        return time.monotonic() - t0
    end = _end(spec, ReceiverEnd, "receiver")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=end.ipc.device())
    elapsed = 0.0
    for _, view in end.receive(plan):
        end.ipc.synchronize()
        t1 = time.monotonic()
        dst.copy_(view)
        end.ipc.synchronize()
        elapsed = time.monotonic() - t1
    return elapsed


class CudaIpcTransport(RefitTransport):
    """CUDA IPC between processes on one GPU (see the module doc); the module's functions
    are its ends, and what a backend calls for more (:func:`register_persistent`,
    :func:`offer_layout`, :func:`agreed_layout`, :func:`copy_views`, a native ``layout``)."""

    transport = Transport.CUDA_IPC
    describe = (
        "CUDA IPC handles between processes on the same GPU (device UUIDs checked at open); "
        "the receiver copies straight from the sender's memory"
    )
    accelerator = "cuda"
    colocated_rank = 0  # the first choice on one GPU; never across GPUs
    device_ipc = True

    def channel(self, req: ChannelRequest) -> ChannelSpec:
        """Its side channel's store listens on the sender's node (``refit_address``, as the
        collective's rendezvous does)."""
        addr, port = req.policy.refit_address()
        return ChannelSpec("cuda_ipc", req.key, req.world_size, addr=addr, port=port, timeout_s=req.ctx.timeout_s)

    def open(self, spec: ChannelSpec, rank: int) -> None:
        open_channel(spec, rank)

    def close(self, spec: ChannelSpec) -> None:
        close_channel(spec)

    def send(
        self, spec: ChannelSpec, step: int, named: Iterable[tuple[str, Any]], buckets: Sequence[Sequence[TensorSpec]]
    ) -> int:
        return send_weights(spec, named, buckets)

    def receive(
        self, spec: ChannelSpec, rank: int, step: int, buckets: Sequence[Sequence[TensorSpec]], device: Any = None
    ) -> Iterator[tuple[str, Any]]:
        """Views of the sender's memory, valid until the generator ends (:func:`receive_weights`)."""
        yield from receive_weights(spec, buckets)

    def ceiling(self, spec: ChannelSpec, rank: int, step: int, nbytes: int) -> float:
        """One device-to-device copy through shared memory (:func:`ceiling`)."""
        return ceiling(spec, rank, nbytes)
