"""What a node must have for the roles that may land on it (issue 32): the answer a node
gives and its comparison with the driver's. Real nodes: ``tests/e2e/test_ray_start.py``."""

from __future__ import annotations

import pytest

from rlcore.errors import ConfigError
from rlcore.runtime.node_check import Needed, _compare, installed

NODE, WHERE = "node 0123456789ab (10.0.0.7)", "the Ray cluster at h:1"
GEN = Needed("generation", "vllm", "rlcore_vllm.plugin", "rlcore-vllm", "0.1.0")
HERE = {"rlcore": "0.3.0", "rlcore-vllm": "0.1.0"}


def test_a_node_answers_its_import_errors_and_versions() -> None:
    answer = installed(["json", "no_such_module_rlcore_test"], ["rlcore", "no-such-distribution-rlcore-test"])
    assert answer["errors"]["json"] is None
    assert answer["errors"]["no_such_module_rlcore_test"].startswith("ModuleNotFoundError: No module named")
    assert answer["versions"]["rlcore"] and answer["versions"]["no-such-distribution-rlcore-test"] is None


def test_the_same_versions_pass() -> None:
    _compare(NODE, WHERE, [GEN], HERE, {"errors": {GEN.module: None}, "versions": dict(HERE)})


@pytest.mark.parametrize(
    ("answer", "expected", "key"),
    [
        ({"errors": {GEN.module: "ModuleNotFoundError: No module named 'vllm'"}, "versions": HERE},
         "node 0123456789ab (10.0.0.7), where generation may run, cannot import rlcore_vllm.plugin of generation's "
         "backend vllm (distribution rlcore-vllm): ModuleNotFoundError: No module named 'vllm'; the driver has "
         "rlcore-vllm 0.1.0", "generation.backend"),
        ({"errors": {GEN.module: None}, "versions": {**HERE, "rlcore-vllm": "0.0.9"}},
         "has generation's backend vllm (distribution rlcore-vllm) 0.0.9, the driver 0.1.0", "generation.backend"),
        ({"errors": {GEN.module: None}, "versions": {**HERE, "rlcore": "0.2.0"}},
         "node 0123456789ab (10.0.0.7) has rlcore 0.2.0, the driver 0.3.0", "cluster.address"),
    ],
    ids=["cannot-import", "backend-version", "rlcore-version"],
)
def test_a_difference_is_one_line_naming_node_backend_distribution_and_versions(
    answer: dict, expected: str, key: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _compare(NODE, WHERE, [GEN], HERE, answer)
    assert expected in str(err.value) and str(err.value).startswith(WHERE) and err.value.key == key
    assert "\n" not in str(err.value)
