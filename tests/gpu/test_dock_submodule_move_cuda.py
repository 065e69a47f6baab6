"""One GPU, NCCL: a ``Dock``'s resident FSDP2 set after a submodule's move trains as the framework's own run and
holds the state once (``tests/cpu/test_dock_submodule_move.py``, whose check this runs on the device)."""

import pytest
import torch

from tests.cpu.test_dock_submodule_move import check_a_docked_sets_submodule_move
from tests.spawn import run_spawned

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _on_cuda(rank: int, world: int) -> None:
    check_a_docked_sets_submodule_move(rank, world, device=f"cuda:{rank}")


def test_a_docked_sets_submodule_move_keeps_training_exact_one_gpu():
    run_spawned(_on_cuda, world=1, backend="nccl")
