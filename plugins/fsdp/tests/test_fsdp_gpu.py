"""The fsdp worker on CUDA: two ranks over NCCL and an NCCL refit channel (needs 2 GPUs).

No Ray here (the GPU machines have none): each rank is a spawned process that sees one
GPU, as a Ray actor with ``num_gpus=1`` would; a third process is the refit receiver.
Imports nothing that needs omegaconf, so it runs with torch, transformers, pluggy and
safetensors alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from rlcore.runtime.addresses import free_port
from rlcore.testing.policy_checks import LR, write_hf_model
from rlcore.testing.reference import GRPO_ADVANTAGES, GRPO_BATCH

pytestmark = pytest.mark.gpu

BATCH = GRPO_BATCH
ADVANTAGES = GRPO_ADVANTAGES
BUCKET_BYTES = 100_000
#: ``cpu`` runs the same processes over gloo (a dry run of this file without GPUs).
DEVICE = os.environ.get("RLCORE_FSDP_GPU_TEST_DEVICE", "cuda")
BACKEND = "nccl" if DEVICE == "cuda" else "gloo"


def _policy_rank(
    rank: int, port: int, model_dir: str, dtype: str, spec: Any, specs_q: Any, out: str
) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)  # one GPU per rank, like a Ray actor
    from rlcore.refit.specs import plan_buckets
    from rlcore_fsdp.options import FSDPOptions
    from rlcore_fsdp.worker import FSDPWorker

    w = FSDPWorker(rank, 2)
    w.init_process_group("127.0.0.1", port, BACKEND, 120.0)
    res: dict[str, Any] = {
        "info": w.load(model_dir, dtype, FSDPOptions(micro_batch_size=2), DEVICE)
    }
    res["specs"] = w.weight_specs()
    if rank == 0:
        specs_q.put(res["specs"])  # the receiver plans the same buckets
    res["stream"] = [(n, t.device.type, t.cpu()) for n, t in w.export_stream()]
    res["logprobs"] = w.logprobs(BATCH)
    res["train"] = w.train_step(BATCH, ADVANTAGES, None, 0.2, LR)
    res["export_after"] = w.export_state_dict()
    res["gathered_after"] = w.reference_state_dict()
    w.open_refit_channel(spec)
    res["sent"] = w.send_weights(spec, 1, plan_buckets(res["specs"], BUCKET_BYTES))
    torch.save(res, out)
    w.teardown()


def _receiver(spec: Any, specs_q: Any, out: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # shares GPU 1 with policy rank 1
    from rlcore.refit.channels import close_channel, open_channel, receive_weights
    from rlcore.refit.specs import plan_buckets

    buckets = plan_buckets(specs_q.get(timeout=300), BUCKET_BYTES)
    open_channel(spec, 1)
    got = {n: (t.device.type, t.cpu()) for n, t in receive_weights(spec, 1, 1, buckets)}
    close_channel(spec)
    torch.save(got, out)


def _run(tmp: Path, dtype: str) -> tuple[list[dict], dict]:
    import torch.multiprocessing as mp

    from rlcore.refit.channels import ChannelSpec

    model_dir = write_hf_model(
        tmp / "model",
        "llama",
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        tie_word_embeddings=False,
    )
    spec = ChannelSpec(
        "collective",
        f"gpu-{dtype}",
        2,
        addr="127.0.0.1",
        port=free_port(),
        backend=BACKEND,
        timeout_s=120,
    )
    ctx = mp.get_context("spawn")
    specs_q = ctx.Queue()
    port = free_port()
    outs = [str(tmp / f"{dtype}-rank{r}.pt") for r in range(2)]
    recv_out = str(tmp / f"{dtype}-recv.pt")
    procs = [
        ctx.Process(
            target=_policy_rank, args=(r, port, str(model_dir), dtype, spec, specs_q, outs[r])
        )
        for r in range(2)
    ]
    procs.append(ctx.Process(target=_receiver, args=(spec, specs_q, recv_out)))
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(300)
            assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [torch.load(o, weights_only=False) for o in outs], torch.load(
        recv_out, weights_only=False
    )


def _reference(model_dir: Path, dtype: str) -> tuple[Any, list[list[float]], dict]:
    from transformers import AutoModelForCausalLM

    model = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        .to(DEVICE)
        .eval()
    )
    state = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
    lps = []
    with torch.no_grad():
        for p, c in BATCH:
            logp = (
                model(input_ids=torch.tensor([p + c]).to(DEVICE))
                .logits[0, :-1]
                .float()
                .log_softmax(-1)
            )
            lps.append([logp[len(p) - 1 + j, t].item() for j, t in enumerate(c)])
    # on-policy GRPO step (ratio 1): loss = -mean over tokens of A
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    terms = []
    for (p, c), a in zip(BATCH, ADVANTAGES, strict=True):
        if not c:
            continue
        logp = (
            model(input_ids=torch.tensor([p + c]).to(DEVICE)).logits[0, :-1].float().log_softmax(-1)
        )
        lp = (
            logp[len(p) - 1 : len(p) - 1 + len(c)]
            .gather(-1, torch.tensor(c).to(DEVICE)[:, None])
            .squeeze(-1)
        )
        ratio = torch.exp(lp - lp.detach())
        terms.append(ratio * a)
    (-torch.cat(terms).mean()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return state, lps, {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}


@pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_ranks_nccl(tmp_path: Path, dtype: str) -> None:
    (r0, r1), received = _run(tmp_path, dtype)
    state, ref_lp, ref_after = _reference(tmp_path / "model", dtype)
    assert r0["info"]["device"] == DEVICE and r0["info"]["local_numel"] * 2 >= r0["info"]["params"]
    # export before training: bit-exact HF state dict, on the GPU, in weight_specs order
    from rlcore.refit.specs import spec_of

    assert [spec_of(n, t) for n, _, t in r0["stream"]] == r0["specs"] and r1["stream"] == []
    assert {d for _, d, _ in r0["stream"]} == {DEVICE}
    stream = {n: t for n, _, t in r0["stream"]}
    assert sorted(stream) == sorted(state)
    assert [k for k in state if not torch.equal(stream[k], state[k])] == []
    # logprobs: shards in rank order
    lp = r0["logprobs"] + r1["logprobs"]
    tol = 1e-4 if dtype == "float32" else 5e-2
    diffs = [abs(a - b) for x, y in zip(lp, ref_lp, strict=True) for a, b in zip(x, y, strict=True)]
    assert max(diffs) < tol, max(diffs)
    # training: same metrics on both ranks, same full params on both ranks
    assert r0["train"] == r1["train"]
    g0, g1 = r0["gathered_after"], r1["gathered_after"]
    assert all(torch.equal(g0[k], g1[k]) for k in g0)
    assert all(torch.equal(r0["export_after"][k], g0[k]) for k in g0)
    if dtype == "float32":
        for k, v in ref_after.items():
            torch.testing.assert_close(g0[k], v, rtol=0, atol=1e-4, msg=k)
    # NCCL refit channel: the receiver got exactly the export, on its GPU
    assert sorted(received) == sorted(g0)
    assert all(d == DEVICE and torch.equal(t, g0[k]) for k, (d, t) in received.items())
    assert r0["sent"] == sum(t.numel() * t.element_size() for t in g0.values()) and r1["sent"] == 0
