"""Two GPUs, NCCL: the seed's 2-rank FSDP2 regression redone for torchferry.

The seed (verl PR #7347, verl:tests/special_distributed/test_fsdp2_pinned_model_transfer.py)
checks that after offload every local shard is a pinned CPU tensor and that the
round trip is bit-exact; with the seed's method, uneven shards lose pinning
(README.md, beside the seed). Here uneven and empty shards must stay pinned.
"""

import pytest
import torch

from tests.cpu.test_integration_fsdp2 import check_fsdp2_cycles
from tests.spawn import run_spawned

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


def _qwen2_regression(rank: int, world: int) -> None:
    transformers = pytest.importorskip("transformers")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchferry.compat.verl import load_fsdp2_model_to_gpu, offload_fsdp2_model_to_cpu

    mesh = init_device_mesh("cuda", (world,))
    cfg = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=129, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1001, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(cfg).float()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    expected = [p._local_tensor.detach().clone() for p in model.parameters()]
    offload_fsdp2_model_to_cpu(model, empty_cache=False)
    torch.cuda.synchronize()
    for p in model.parameters():
        assert p.device.type == "cpu" and p._local_tensor.device.type == "cpu"
        if p._local_tensor.numel():
            assert p._local_tensor.is_pinned(), f"unpinned shard {tuple(p._local_tensor.shape)}"
    load_fsdp2_model_to_gpu(model)
    torch.cuda.synchronize()
    for p, e in zip(model.parameters(), expected, strict=True):
        assert p._local_tensor.device.type == "cuda"
        torch.testing.assert_close(p._local_tensor, e, atol=0, rtol=0)
    ids = torch.randint(0, 1000, (2, 16), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()


def _uneven_cycles(rank, world):
    check_fsdp2_cycles(rank, world, device=f"cuda:{rank}", expect_pinned=True)


def test_seed_regression_qwen2_two_gpus():
    run_spawned(_qwen2_regression, world=2, backend="nccl")


def test_uneven_and_empty_shards_stay_pinned_two_gpus():
    run_spawned(_uneven_cycles, world=2, backend="nccl")
