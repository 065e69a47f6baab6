"""``patch(dock=...)`` on one GPU: verl 0.9.1's own actor in the bench's colocated step (tiny model, a 4 GB
KV cache stand-in) under a tight and a roomy budget: bit-identical to verl, the moves of
``check_dock_run``, and the device's peak in each step within the budget."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

verl_dock = pytest.importorskip("tests.cpu.test_integration_verl_dock")


def test_verls_actor_under_the_dock_on_a_gpu(tmp_path):
    for kind, result in verl_dock.run_dock_bench(tmp_path, "1", "tiny", "4 2", cpu=False).items():
        verl_dock.check_dock_run(result, kind, gpu=True)
