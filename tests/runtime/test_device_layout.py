"""GPU bundles (rlcore.config.placement.device_layout): counted as Ray counts them, refused in one
line when they cannot fit, shown by ``rlcore plan``, and reserved for real: colocated
ranks land in one bundle and share its GPU.

The Ray test runs on any host: an embedded cluster told it has GPUs (``cluster.num_gpus``)
advertises them to Ray's scheduler, which assigns their ids to actors as on a GPU node.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.config import load_config
from rlcore.config.placement import device_layout, role_placement
from rlcore.errors import ConfigError
from rlcore.setup.preflight import check_resources

REPO = Path(__file__).resolve().parents[2]
GPU_EXAMPLES = sorted((REPO / "examples" / "gpu").glob("*.yaml"))
BASE = ["policy.backend=megatron", "generation.backend=megatron"]


def layout_of(*overrides: str):
    return device_layout(load_config(None, [*BASE, *overrides]))


def test_colocated_ranks_share_one_bundle_per_gpu() -> None:
    layout = layout_of(
        "placement.colocated=true", "policy.workers=2", "generation.workers=2",
        "policy.devices_per_worker=0.5", "generation.devices_per_worker=0.5",
    )
    assert layout.gpus == 2 and layout.colocated
    assert [b.members for b in layout.bundles] == [
        (("policy", 0, 0.5), ("generation", 0, 0.5)),
        (("policy", 1, 0.5), ("generation", 1, 0.5)),
    ]
    assert layout.ranks("policy") == (0, 1) and layout.ranks("generation") == (0, 1)
    assert layout.lines()[0] == "GPU 0: policy rank 0 (0.5 GPU) + generation rank 0 (0.5 GPU)"


def test_colocated_with_more_policy_ranks_than_engines() -> None:
    layout = layout_of(
        "placement.colocated=true", "policy.workers=2", "generation.workers=1",
        "policy.devices_per_worker=0.4", "generation.devices_per_worker=0.6",
    )
    assert layout.gpus == 2
    assert [len(b.members) for b in layout.bundles] == [2, 1]
    assert layout.ranks("generation") == (0,)


def test_separate_roles_pack_their_own_bundles_as_ray_does() -> None:
    # Four policy ranks at a quarter GPU fit one GPU; two engines at 0.5 another; never mixed.
    layout = layout_of(
        "policy.workers=4", "policy.devices_per_worker=0.25",
        "generation.workers=2", "generation.devices_per_worker=0.5",
    )
    assert layout.gpus == 2 and not layout.colocated
    assert [{r for r, _, _ in b.members} for b in layout.bundles] == [{"policy"}, {"generation"}]
    # Whole GPUs: one bundle of k GPUs per worker.
    layout = layout_of("policy.workers=2", "policy.devices_per_worker=2", "generation.workers=1")
    assert [b.gpus for b in layout.bundles] == [2, 2, 1] and layout.gpus == 5
    assert layout.lines()[1] == "GPUs 2-3: policy rank 1 (2 GPU)"
    # 0.3 of a GPU: three per GPU, the fourth on a second one.
    layout = layout_of("policy.workers=4", "policy.devices_per_worker=0.3", "generation.workers=1")
    assert layout.ranks("policy") == (0, 0, 0, 1) and layout.gpus == 3


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["placement.colocated=true", "policy.devices_per_worker=0.5"], "generation.devices_per_worker",
         "policy.devices_per_worker (0.5) + generation.devices_per_worker (1) = 1.5 GPUs > 1"),
        (["policy.devices_per_worker=1.5"], "policy.devices_per_worker", "is 1.5"),
    ],
)
def test_shares_ray_cannot_place_are_refused_naming_the_key(overrides, key, words) -> None:
    with pytest.raises(ConfigError) as err:
        layout_of(*overrides)
    assert err.value.key == key and words in str(err.value) and "\n" not in str(err.value)


def test_preflight_counts_what_the_placement_group_asks_for() -> None:
    colocated = [
        "placement.colocated=true", "policy.workers=1", "generation.workers=1",
        "policy.devices_per_worker=0.5", "generation.devices_per_worker=0.5",
    ]
    config = load_config(None, [*BASE, *colocated, "cluster.num_gpus=1"])
    check_resources(config)  # fits: one GPU, shared
    assert device_layout(config).gpus == 1
    # The same workers apart need two: refused on one GPU, naming the roles and counts.
    apart = load_config(None, [*BASE, "cluster.num_gpus=1"])
    assert device_layout(apart).gpus == 2
    with pytest.raises(ConfigError) as err:
        check_resources(apart)
    text = str(err.value)
    assert "need 2 GPU" in text and "has 1" in text and "policy.workers=1 x 1 GPU" in text
    assert "GPU 1: generation rank 0 (1 GPU)" in text and "placement.colocated=true" in text
    # On a CPU-only cluster the same config counts CPUs, and a GPU-invalid share is fine.
    check_resources(load_config(None, [*BASE, "cluster.num_gpus=0", "cluster.num_cpus=4", "policy.devices_per_worker=1.5"]))


@pytest.mark.parametrize("example", GPU_EXAMPLES, ids=lambda p: p.stem)
def test_rlcore_plan_shows_which_roles_share_which_gpus(example: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rlcore", "plan", str(example), "--json", "cluster.num_gpus=2"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    devices = json.loads(out.stdout)["devices"]
    colocated = "colocated" in example.stem
    assert devices["colocated"] is colocated
    assert devices["gpus"] == (1 if colocated else 2)
    roles = [{m["role"] for m in b["members"]} for b in devices["bundles"]]
    assert roles == ([{"policy", "generation"}] if colocated else [{"policy"}, {"generation"}])
    text = subprocess.run(
        [sys.executable, "-m", "rlcore", "plan", str(example), "cluster.num_gpus=2"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    assert "GPU 0: policy rank 0" in text


def test_gpu_examples_are_refused_on_too_few_gpus_before_anything_starts() -> None:
    split = next(p for p in GPU_EXAMPLES if "split" in p.stem)
    out = subprocess.run(
        [sys.executable, "-m", "rlcore", "plan", str(split), "cluster.num_gpus=1"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "need 2 GPU" in lines[0]


def test_no_devices_in_a_plan_on_cpus() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rlcore", "plan", str(REPO / "examples" / "quickstart.yaml"), "--json", "cluster.num_gpus=0"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert json.loads(out.stdout)["devices"] is None


# ---------------------------------------------------------------- reserved for real

ray = pytest.importorskip("ray")


from rlcore.runtime.worker_group import DistributedWorker, WorkerGroup  # noqa: E402


class GpuIdWorker(DistributedWorker):
    def gpu_ids(self) -> list[str]:
        import ray

        return [str(g) for g in ray.get_gpu_ids()]


@pytest.mark.slow
def test_colocated_ranks_get_the_same_gpu_from_ray() -> None:
    import ray.cloudpickle

    from rlcore.runtime.cluster import Cluster

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the test class travels by value
    config = load_config(None, [
        *BASE, "placement.colocated=true", "policy.workers=2", "generation.workers=2",
        "policy.devices_per_worker=0.5", "generation.devices_per_worker=0.5",
        "cluster.num_gpus=2", "cluster.num_cpus=4",
    ])
    cluster = Cluster(config.cluster).start()
    groups: list[WorkerGroup] = []
    try:
        devices = cluster.reserve_devices(config)
        assert devices is not None and devices.layout.gpus == 2
        for role in ("policy", "generation"):
            groups.append(WorkerGroup(
                GpuIdWorker, 2, name=f"gpu-ids-{role}", num_cpus=1.0, num_gpus=0.5, dist_backend=None,
                placement=role_placement(config, role, devices), timeout_s=60,
            ))
        policy, generation = (g.call("gpu_ids") for g in groups)
        # Rank i of both roles holds half of the same GPU; the two ranks hold different GPUs.
        assert policy == generation and len(policy) == 2
        assert all(len(ids) == 1 for ids in policy) and policy[0] != policy[1]
        # The bundles hold every GPU of the cluster: nothing else can take one.
        import ray as _ray

        assert _ray.available_resources().get("GPU", 0.0) == 0.0
        # A layout larger than the cluster (a joined one: the preflight could not count it)
        # is refused naming both counts, before any actor asks for a GPU.
        bigger = load_config(None, [*BASE, "policy.workers=2", "cluster.num_gpus=2"])
        with pytest.raises(ConfigError, match=r"need 3 GPU .* has 2"):
            cluster.reserve_devices(bigger)
    finally:
        for g in groups:
            g.shutdown()
        cluster.shutdown()
