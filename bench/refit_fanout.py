"""Refit fan-out to N generation replicas: one broadcast tree, not N sends.

A collective refit opens one private process group spanning the policy's rank 0 and
every generation rank (:class:`rlcore.refit.sessions.RefitSessions`: world = 1 + the
generation's ``refit_ranks``, engine i as rank 1 + i) and broadcasts each bucket
once over it (:mod:`rlcore.refit.channels`). Gloo broadcasts along a binomial tree
(ceil(log2(N + 1)) rounds; a receiver forwards to others once it has the bucket);
NCCL along a pipelined ring. This script runs the real channel code between real
processes, 1 sender and N = 1..max receivers, and compares in one run:

* ``tree``: :func:`rlcore.refit.channels.send_weights` / ``receive_weights`` (what a
  refit does);
* ``sequential``: the same buckets sent point to point to each receiver in turn over
  the same group (what the fan-out must not be).

Two payloads: a tiny one (the latency term: how many message rounds) and a large one
(the bandwidth term). For each: time until the last receiver holds every bucket, and
the root's own sending time (on a cluster the root's link carries what it sends: a
tree sends ceil(log2(N + 1)) copies, sequential sends N). Figures are medians of
interleaved rounds, shown relative to N = 1 of the same mode and payload.

On a host with fewer cores than processes every copy competes for the same cores
(loopback TCP is memory copies), so the large payload's totals grow with N whatever
the algorithm; the latency term and the root's share still show the tree.

    .venv/bin/python bench/refit_fanout.py [--max-receivers 4] [--rounds 5] [--large-mib 32]
    .venv/bin/python bench/refit_fanout.py --model   # the cost model's table, N up to 1,000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from rlcore.refit.channels import (
    ChannelSpec,
    close_channel,
    open_channel,
    receive_weights,
    send_weights,
)
from rlcore.refit.specs import plan_buckets, spec_of
from rlcore.refit.transports import collective
from rlcore.runtime.addresses import free_port

_TIMEOUT_S = 300


def payloads(large_mib: int) -> dict[str, dict[str, torch.Tensor]]:
    """``small``: one 4 KiB tensor; ``large``: ``large_mib`` MiB of fp32 in 4 MiB tensors."""
    g = torch.Generator().manual_seed(0)
    per = 1 << 20  # fp32 elements in 4 MiB
    return {
        "small": {"w": torch.randn(1024, generator=g)},
        "large": {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(max(1, large_mib // 4))},
    }


def _buckets(weights: dict[str, torch.Tensor]) -> list[Any]:
    return plan_buckets([spec_of(n, t) for n, t in weights.items()], 8 << 20)


def _seq_recv(ch: Any, buckets: list[Any]) -> None:
    for bucket in buckets:
        buf = torch.empty(sum(s.nbytes for s in bucket), dtype=torch.uint8)
        ch.pg.recv([buf], 0, 0).wait()


def _seq_send(ch: Any, weights: dict[str, torch.Tensor], buckets: list[Any], n: int) -> None:
    """Each bucket to receiver 1, then 2, ... then n: what a fan-out must not be."""
    for bucket in buckets:
        buf = collective._pack([weights[s.name] for s in bucket], torch.empty(sum(s.nbytes for s in bucket), dtype=torch.uint8))
        for rank in range(1, n + 1):
            ch.pg.send([buf], rank, 0).wait()


def _receiver(rank: int, specs: dict[int, ChannelSpec], large_mib: int, cmds: Any, out: Any) -> None:
    try:
        buckets = {k: _buckets(w) for k, w in payloads(large_mib).items()}
        for n in sorted(specs):
            if n >= rank:
                open_channel(specs[n], rank)
        while (cmd := cmds.get()) is not None:
            mode, n, step, payload, reps = cmd
            out.put(("ready", rank, 0.0))
            for rep in range(reps):
                if mode == "tree":
                    for _ in receive_weights(specs[n], rank, step + rep, buckets[payload]):
                        pass
                else:
                    _seq_recv(collective._open[specs[n].key], buckets[payload])
            out.put(("done", rank, time.monotonic()))
    except BaseException as err:  # report, never leave the sender waiting
        out.put(("error", rank, repr(err)))


class Fanout:
    """1 sender (this process) and ``max_n`` receiver processes, with one channel per N."""

    def __init__(self, max_n: int, large_mib: int) -> None:
        self.weights = payloads(large_mib)
        self.buckets = {k: _buckets(w) for k, w in self.weights.items()}
        self.specs = {
            n: ChannelSpec("collective", f"fan{os.getpid()}n{n}", n + 1, addr="127.0.0.1", port=free_port(), timeout_s=_TIMEOUT_S)
            for n in range(1, max_n + 1)
        }
        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.cmds = {r: ctx.Queue() for r in range(1, max_n + 1)}
        self.procs = [
            ctx.Process(target=_receiver, args=(r, self.specs, large_mib, self.cmds[r], self.out), daemon=True)
            for r in range(1, max_n + 1)
        ]
        for p in self.procs:
            p.start()
        for n in sorted(self.specs):
            open_channel(self.specs[n], 0)
        self.step = 0

    def _collect(self, kind: str, n: int) -> list[float]:
        got = []
        while len(got) < n:
            what, rank, value = self.out.get(timeout=_TIMEOUT_S)
            if what == "error":
                raise RuntimeError(f"receiver {rank}: {value}")
            assert what == kind, (what, kind)
            got.append(value)
        return got

    def measure(self, mode: str, n: int, payload: str, reps: int) -> tuple[float, float]:
        """(seconds until the last receiver is done, seconds the root spent sending), per refit."""
        self.step += reps
        for r in range(1, n + 1):
            self.cmds[r].put((mode, n, self.step, payload, reps))
        self._collect("ready", n)
        t0 = time.monotonic()
        for rep in range(reps):
            if mode == "tree":
                send_weights(self.specs[n], self.step + rep, iter(self.weights[payload].items()), self.buckets[payload])
            else:
                _seq_send(collective._open[self.specs[n].key], self.weights[payload], self.buckets[payload], n)
        root = time.monotonic() - t0
        done = max(self._collect("done", n))
        return (done - t0) / reps, root / reps

    def close(self) -> None:
        for q in self.cmds.values():
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        for spec in self.specs.values():
            close_channel(spec)


def run(max_n: int, rounds: int, large_mib: int) -> dict[tuple[str, str, int], tuple[float, float]]:
    """Median (total, root) seconds per refit for each (mode, payload, N), rounds interleaved."""
    fan = Fanout(max_n, large_mib)
    samples: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    try:
        for mode in ("tree", "sequential"):  # warm-up: first use of each group and buffer
            for n in range(1, max_n + 1):
                fan.measure(mode, n, "small", 2)
        for _ in range(rounds):
            for payload, reps in (("small", 50), ("large", 1)):
                for n in range(1, max_n + 1):
                    for mode in ("tree", "sequential"):
                        samples.setdefault((mode, payload, n), []).append(fan.measure(mode, n, payload, reps))
    finally:
        fan.close()
    return {
        k: (statistics.median(t for t, _ in v), statistics.median(r for _, r in v)) for k, v in samples.items()
    }


def rounds_of(n: int) -> int:
    """Message rounds of a binomial-tree broadcast to ``n`` receivers: ceil(log2(n + 1))."""
    return (n).bit_length()


# -- the cost model (docs/refit-fanout.md) ------------------------------------------------


def tree_s(n: int, size: float, bucket: float, alpha: float, beta: float, per_round: float = 1.0) -> float:
    """Binomial tree, buckets pipelined: one round moves every bucket one level down. A
    round costs ``size / beta + buckets * alpha`` where a sender's link is shared by its
    sends (``per_round`` 1.0); on a host whose streams overlap, a measured fraction."""
    one = size / beta + -(-size // bucket) * alpha
    return one * (1 + per_round * (rounds_of(n) - 1))


def chain_s(n: int, size: float, bucket: float, alpha: float, beta: float, chunk: float) -> float:
    """Pipelined chain (NCCL's ring broadcast): the bytes cross one link at full bandwidth,
    and each bucket's first chunk pays one hop per extra receiver to fill the pipe."""
    return size / beta + -(-size // bucket) * (alpha + max(0, n - 1) * (alpha + chunk / beta))


def sequential_s(n: int, size: float, bucket: float, alpha: float, beta: float, per_send: float = 1.0) -> float:
    """The root sends every bucket to each receiver in turn (what the fan-out is not)."""
    one = size / beta + -(-size // bucket) * alpha
    return one * (1 + per_send * (n - 1))


#: Calibration, from bench/results/refit_fanout_16core.txt (gloo over loopback, 16 cores):
#: a raw message 51 us, 128 MiB in 84.1 ms to one receiver (1.49 GiB/s); the tree's time grew
#: by 0.41 x T(1) per extra round (2.23x at N=15, 4 rounds) and sequential sends' by 0.41 x
#: T(1) per extra receiver (6.80x at N=15).
HOST = {"size": 128 * 2**20, "bucket": 8 * 2**20, "alpha": 51e-6, "beta": 1.49 * 2**30, "per_round": 0.41}
#: A cluster refit: the 1.14 B bf16 model of bench/results/megatron_gpu.txt (2.12 GiB, 512 MiB
#: buckets), links of 50 GB/s (400 Gb/s NICs: assumed, not measured here), 10 us a hop and
#: NCCL's 512 KiB pipeline step (assumed). Within one node NVLink gave 331 GB/s (measured).
CLUSTER = {"size": 2.119 * 2**30, "bucket": 512 * 2**20, "alpha": 10e-6, "beta": 50e9, "chunk": 512 * 2**10}


def model_table(ns: tuple[int, ...] = (1, 2, 4, 8, 16, 64, 256, 1000)) -> str:
    h, c = HOST, CLUSTER
    host = {k: h[k] for k in ("size", "bucket", "alpha", "beta")}
    net = {k: c[k] for k in ("size", "bucket", "alpha", "beta")}
    lines = [
        "predicted refit time to N replicas (docs/refit-fanout.md; bench/refit_fanout.py --model)",
        f"{'N':>5} {'rounds':>6} | {'host tree ms':>12} {'host seq ms':>11} | "
        f"{'net tree ms':>11} {'net chain ms':>12} {'net seq ms':>10}",
    ]
    for n in ns:
        lines.append(
            f"{n:>5} {rounds_of(n):>6} | {tree_s(n, **host, per_round=h['per_round']) * 1e3:>12.0f} "
            f"{sequential_s(n, **host, per_send=h['per_round']) * 1e3:>11.0f} | "
            f"{tree_s(n, **net) * 1e3:>11.0f} {chain_s(n, **net, chunk=c['chunk']) * 1e3:>12.0f} "
            f"{sequential_s(n, **net) * 1e3:>10.0f}"
        )
    return "\n".join(lines)


def report(res: dict[tuple[str, str, int], tuple[float, float]], max_n: int, rounds: int, large_mib: int) -> str:
    lines = [
        f"# .venv/bin/python bench/refit_fanout.py --max-receivers {max_n} --rounds {rounds} --large-mib {large_mib}  "
        f"({time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}, torch {torch.__version__}, gloo over loopback; medians of {rounds} "
        "interleaved rounds in one run)",
    ]
    for payload, label in (("small", "4 KiB (latency term), per refit"), ("large", f"{large_mib} MiB in 8 MiB buckets (bandwidth term)")):
        lines.append(f"{payload}: {label}")
        lines.append(
            f"{'N':>3} {'tree rounds':>11} | {'tree ms':>9} {'x N=1':>6} {'root ms':>8} {'x N=1':>6} | "
            f"{'seq ms':>9} {'x N=1':>6} {'root ms':>8} {'x N=1':>6}"
        )
        base = {m: res[(m, payload, 1)] for m in ("tree", "sequential")}
        for n in range(1, max_n + 1):
            t, tr = res[("tree", payload, n)]
            s, sr = res[("sequential", payload, n)]
            lines.append(
                f"{n:>3} {rounds_of(n):>11} | {t * 1e3:>9.3f} {t / base['tree'][0]:>6.2f} {tr * 1e3:>8.3f} "
                f"{tr / base['tree'][1]:>6.2f} | {s * 1e3:>9.3f} {s / base['sequential'][0]:>6.2f} "
                f"{sr * 1e3:>8.3f} {sr / base['sequential'][1]:>6.2f}"
            )
    t1 = res[("tree", "small", 1)][0]
    big = res[("tree", "large", 1)][0]
    lines.append(
        f"calibration (N=1): one message {t1 * 1e6:.0f} us (alpha); {large_mib} MiB in {big * 1e3:.1f} ms "
        f"= {large_mib / 1024 / big:.2f} GiB/s (beta)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-receivers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--large-mib", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "refit_fanout_cpu.txt"))
    ap.add_argument("--model", action="store_true", help="print the cost model's table and exit")
    args = ap.parse_args(argv)
    if args.model:
        print(model_table())
        return 0
    res = run(args.max_receivers, args.rounds, args.large_mib)
    text = report(res, args.max_receivers, args.rounds, args.large_mib)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
