"""When a run saves its training state, and what the step waits for.

:class:`Checkpointer` saves every ``checkpoint.every_steps`` steps and after the last one
(:mod:`rlcore.app.checkpoints` writes and publishes the directory). One save runs at a
time. Where the policy declares ``CheckpointSupport(overlap=True)`` (its save only reads
its state) and ``checkpoint.overlap`` is on, the save runs on a thread of its own while the
loop goes on to the next step's rollouts; :meth:`Checkpointer.wait` joins it before the
loop's next call on the policy, so the policy's ranks never see two calls at once. What
the loop waited for saves shows in each step's ``timing/checkpoint_time_s``; each save's
own line carries ``checkpoint/save_time_s``, ``checkpoint/bytes`` and its path.

Where the policy declares staged saves (``CheckpointSupport(staged=True)``,
:class:`rlcore.handles.StagedCheckpointable`) and ``checkpoint.staged`` is on, the loop
waits only for ``stage_checkpoint`` (the copy of the state off the devices) and goes on
training, sampling and refitting; a thread polls ``checkpoint_written`` and then digests
and publishes the directory as any save's (``checkpoint/stage_time_s`` is what the loop
waited, ``checkpoint/save_time_s`` the whole save). The next save, a preemption's last
save and the end of the run wait for it (:meth:`Checkpointer.finish`), so one is in
flight at a time and a run never ends before its last checkpoint is published.

A save that fails (a full disk, a rank that died) ends the run with a
:class:`~rlcore.errors.CheckpointError` naming the directory and the cause; the last
complete checkpoint is untouched (only a complete newer one ever replaces it).
"""

from __future__ import annotations

import errno
import logging
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.app.checkpoints import POLICY_DIR, prune, scan, step_dir, write_checkpoint
from rlcore.errors import Cancelled, CancelToken, CheckpointError, Deadline, wait_until
from rlcore.publish import discard

log = logging.getLogger(__name__)

#: ``publish(destination, write)``: the ``rlcore_publish`` hook, cancellation and deadline bound.
Publish = Callable[[Path, Callable[[Path], None]], Path]


@dataclass(frozen=True)
class Schedule:
    """When saves happen and how.

    Attributes:
        every: ``checkpoint.every_steps`` (0: never).
        last_step: the run's last step (saved too).
        keep: ``checkpoint.keep``.
        keep_every: ``checkpoint.keep_every`` (0: no milestones).
        overlap: run saves on their own thread (the policy allows it and the config wants it).
        staged: the policy stages its saves (the loop waits only for the copy off the
            devices; module doc).
    """

    every: int
    last_step: int
    keep: int
    overlap: bool
    keep_every: int = 0
    staged: bool = False

    def due(self, step: int) -> bool:
        """Whether ``step`` is saved: every ``every`` steps and the last."""
        return self.every > 0 and (step % self.every == 0 or step == self.last_step)


@dataclass(frozen=True)
class Contents:
    """What a checkpoint holds besides the policy's files.

    Attributes:
        manifest: what every manifest carries besides the step and files: the policy's
            format, the config keys a resume must share.
        config_yaml: the run's config, saved beside the state.
        env_state: ``env_state(step)``: the env's state after ``step`` (None: it has none).
    """

    manifest: Mapping[str, Any]
    config_yaml: str
    env_state: Callable[[int], Any]


def save_stages(config: Any, decl: Any) -> bool:
    """Whether a run's saves are staged: the policy declares ``CheckpointSupport.staged``
    and ``checkpoint.staged`` is on."""
    return bool(decl.checkpoint is not None and decl.checkpoint.staged and config.checkpoint.staged)


def save_overlaps(config: Any, decl: Any) -> bool:
    """Whether a run's saves run beside its next rollouts: the policy declares its save
    only reads (``CheckpointSupport.overlap``), ``checkpoint.overlap`` is on, and the policy
    does not sleep while the generation samples (colocated roles that hand the devices over)."""
    sleeps = config.placement.colocated and config.placement.memory_handoff and decl.memory_handoff
    return bool(decl.checkpoint is not None and decl.checkpoint.overlap and config.checkpoint.overlap and not sleeps)


class Checkpointer:
    """A run's saves (module doc).

    Args:
        root: where the checkpoints go (``checkpoint.dir`` or ``<run_dir>/checkpoints``).
        policy: the policy handle (:class:`rlcore.handles.Checkpointable`).
        publish: publishes a directory atomically (the ``rlcore_publish`` hook).
        contents: what a checkpoint holds besides the policy's files.
        schedule: when saves happen, how many stay, whether they overlap the loop.
        record: ``record(metrics, step)``: a ``metrics.jsonl`` line about a save.
        flush: called once a save is published and recorded: ``metrics.jsonl`` to the device,
            so a resume from this checkpoint finds every line up to its step.
        cancel: the run's cancellation (a staged save's wait for its files stops there).
        write_timeout_s: how long a staged save's files may take to be written.
    """

    def __init__(
        self,
        root: Path,
        *,
        policy: Any,
        publish: Publish,
        contents: Contents,
        schedule: Schedule,
        record: Callable[[dict[str, Any], int], None],
        flush: Callable[[], None] = lambda: None,
        cancel: CancelToken | None = None,
        write_timeout_s: float = 1800.0,
    ) -> None:
        self.root, self.policy, self.publish = Path(root), policy, publish
        self.contents, self.schedule, self.record, self.flush = contents, schedule, record, flush
        self.cancel, self.write_timeout_s = cancel, write_timeout_s
        self.last_saved: int | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staged: threading.Event | None = None  # set once the save in flight is staged

    def due(self, step: int) -> bool:
        """Whether ``step`` is saved (:meth:`Schedule.due`)."""
        return self.schedule.due(step)

    def save(self, step: int) -> None:
        """Save the state after ``step``: on a thread where the policy allows (joined by
        :meth:`wait`), staged where it stages (returns once staged; :meth:`finish` waits
        for the files), else now. An earlier save still running is finished first."""
        self.finish()
        if self.last_saved == step:
            return
        self.last_saved = step
        env = self.contents.env_state(step)  # now, on the caller's thread: the env moves on next step
        if not (self.schedule.overlap or self.schedule.staged):
            self._save(step, env)
            return
        self._staged = threading.Event() if self.schedule.staged else None
        self._thread = threading.Thread(
            target=self._save_in_background, args=(step, env), name=f"rlcore-checkpoint-{step}", daemon=True
        )
        self._thread.start()
        if self._staged is not None:
            self._wait_staged(self._thread, self._staged)

    def _wait_staged(self, thread: threading.Thread, staged: threading.Event) -> None:
        # The staging call itself is bounded by the publish's deadline on the thread.
        while not staged.wait(0.05):
            if not thread.is_alive():
                self.finish()  # it failed before staging: raise that here
                return

    def wait(self) -> None:
        """Before a call on the policy: join a save in flight that reads the policy's state
        (an overlapped one); a staged save has its copy and goes on writing. Raises the
        failure of a save that has ended."""
        thread = self._thread
        if thread is not None and self._staged is not None and thread.is_alive():
            return
        self.finish()

    def finish(self) -> None:
        """Join the save in flight, staged or not, if any; raise its failure."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise err

    @property
    def saving(self) -> bool:
        """A save is running on its thread."""
        return self._thread is not None and self._thread.is_alive()

    def _save_in_background(self, step: int, env: Any) -> None:
        try:
            self._save(step, env)
        except BaseException as err:  # raised on the loop's thread by wait() or finish()
            self._error = err

    def _save_policy(self, step: int, figures: dict[str, float]) -> Callable[[str], None]:
        """What writes the policy's files into a checkpoint: ``save_checkpoint``, or a staged
        save: stage (the loop goes on once it returns), then poll until every file is written."""
        staged = self._staged
        if staged is None:
            return self.policy.save_checkpoint  # type: ignore[no-any-return]

        def stage_then_wait(directory: str) -> None:
            t0 = time.monotonic()
            figures.update({f"checkpoint/{k}": float(v) for k, v in (self.policy.stage_checkpoint(directory) or {}).items()})
            figures["checkpoint/stage_time_s"] = time.monotonic() - t0
            staged.set()
            what = f"the background write of the checkpoint of step {step}"
            wait_until(
                lambda: self.policy.checkpoint_written() or None, what=what, cancel=self.cancel,
                deadline=Deadline(self.write_timeout_s, what), max_poll_s=WRITE_POLL_S,
            )

        return stage_then_wait

    def _save(self, step: int, env: Any) -> None:
        destination = step_dir(self.root, step)
        t0 = time.monotonic()
        written: dict[str, Any] = {}
        figures: dict[str, float] = {}

        def write(staging: Path) -> None:
            written.update(write_checkpoint(
                staging, step=step, save_policy=self._save_policy(step, figures),
                manifest={**self.contents.manifest, "weight_version": step, "env": env, "time": time.time()},
                config_yaml=self.contents.config_yaml,
            ))

        self._check_room(step, destination)
        self._replace_stale(destination)
        try:
            self.publish(destination, write)
        except Cancelled:
            raise
        except BaseException as err:
            raise CheckpointError(
                f"the checkpoint of step {step} could not be saved to {destination}: "
                f"{_full_disk(err, self.root) or _cause(err)}; {self._intact()}"
            ) from err
        seconds = time.monotonic() - t0
        removed = prune(self.root, self.schedule.keep, self.schedule.keep_every)
        self.record({
            "checkpoint/step": step, "checkpoint/save_time_s": seconds,
            "checkpoint/bytes": written.get("bytes", 0), "checkpoint/path": str(destination),
            "checkpoint/removed": [p.name for p in removed], **figures,
        }, step)
        self.flush()
        log.info("saved checkpoint %s (%.1fs)", destination, seconds)

    def _check_room(self, step: int, destination: Path) -> None:
        """Refuse a save the disk cannot hold, before anything is written: a checkpoint
        takes about what the last one took (pruning frees only after the new one is whole)."""
        complete = [f for f in scan(self.root) if f.problem is None and f.manifest is not None]
        if not complete:
            return  # the first save: nothing to size it by
        need = int(complete[0].manifest.get("bytes", 0) * ROOM_FACTOR)
        free = free_bytes(self.root)
        if free is not None and free < need:
            raise CheckpointError(
                f"the checkpoint of step {step} was not saved to {destination}: the disk is full for it "
                f"({free / 2**30:.2f} GiB free under {self.root}, the last checkpoint took "
                f"{complete[0].manifest.get('bytes', 0) / 2**30:.2f} GiB); free space there or set "
                f"checkpoint.dir elsewhere; {self._intact()}"
            )

    def _replace_stale(self, destination: Path) -> None:
        """A directory already at ``destination`` is not this run's state after that step: a
        run saves each step once, so it is left from before a resume from an older step (a
        checkpoint of a newer format, say). The publisher keeps a complete destination and
        writes nothing, so it goes first; the checkpoint the run resumed from is older and
        stays."""
        if destination.exists():
            log.warning("replacing %s, left from before this run resumed from an older step", destination)
            discard(destination)

    def _intact(self) -> str:
        complete = [f for f in scan(self.root) if f.problem is None]
        if not complete:
            return "no earlier checkpoint exists"
        return f"the last complete checkpoint, {complete[0].path}, is intact"


#: How often a staged save asks whether its files are written.
WRITE_POLL_S = 0.2
#: Room a save wants, as a multiple of the last checkpoint's bytes (its size drifts a little).
ROOM_FACTOR = 1.05
#: Free bytes under which a failed save is put down to a full disk, whatever it raised
#: (torch's writer says "unexpected pos 704 vs 598" where the disk ran out).
FULL_BELOW = 64 << 20


def free_bytes(path: Path) -> int | None:
    """Bytes free to this user on the filesystem of ``path`` (None: it cannot be asked)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _full_disk(err: BaseException, root: Path) -> str | None:
    """A failed save put down to a full disk, in one phrase (None: it was something else):
    ENOSPC or EDQUOT anywhere in its causes, or (almost) nothing left free under ``root``."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            break
        seen = seen.__cause__ or seen.__context__
    free = free_bytes(root)
    if seen is None and (free is None or free >= FULL_BELOW):
        return None
    left = f" ({free / 2**20:.0f} MiB free)" if free is not None else ""
    return f"the disk under {root} is full{left}: {_cause(err)}"


def _cause(err: BaseException) -> str:
    """The innermost cause of a failed save, in one phrase (a full disk names its path)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err) or type(err).__name__
    return text.splitlines()[0] if text else type(err).__name__


__all__ = ["POLICY_DIR", "Checkpointer", "Contents", "Schedule", "save_overlaps", "save_stages"]
