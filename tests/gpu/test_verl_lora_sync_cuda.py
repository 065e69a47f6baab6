"""One GPU, NCCL: verl's LoRA weight sync after the base's under ``patch()`` reads each adapter of an FSDP2
peft model where it is, offloaded ([Note: the LoRA weight sync reads the adapters where they are] in
``docs/integrations.md``): ``param.to(device).full_tensor()`` through NCCL gives
the bytes verl's own ``collect_lora_params`` reads from the resident model, the model stays offloaded and
the device holds no more than before the sync once it returns; after the first sync (the base's) too."""

import pytest
import torch

from tests.spawn import run_spawned

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _lora_sync(rank: int, world: int) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    fsdp_utils = pytest.importorskip("verl.utils.fsdp_utils")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torchferry.integrations.verl as tf_verl
    from torchferry import Residency
    from torchferry.integrations._base import REGISTRY, marked
    from torchferry.integrations.verl import ferry_for

    mesh = init_device_mesh("cuda", (world,))
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=129, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1001, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = transformers.Qwen2ForCausalLM(cfg).float()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    tf_verl.patch()
    try:
        verl_own = fsdp_utils.collect_lora_params.__torchferry_original__
        want = verl_own(model, False, True)  # verl's read of the resident model
        assert want and all(t.device.type == "cpu" for t in want.values())
        fsdp_utils.offload_fsdp_model_to_cpu(model)
        ferry = ferry_for(model)
        assert ferry is not None and ferry.residency is Residency.HOST
        fsdp_utils.load_fsdp_model_to_gpu(model)  # one cycle first: its unchanged-storage baseline stays
        fsdp_utils.offload_fsdp_model_to_cpu(model)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        # verl's first sync (the base, base_sync_done=False) moves the model below the root unit to the host
        # and back ([Note: FSDP2's shard buffer left by a submodule's move]): its offload leaves nothing behind
        fsdp_utils.load_fsdp_model_to_gpu(model)
        assert fsdp_utils.collect_lora_params(model, False, False)
        fsdp_utils.offload_fsdp_model_to_cpu(model)
        torch.cuda.synchronize()
        assert ferry.residency is Residency.HOST and torch.cuda.memory_allocated() <= before, (
            torch.cuda.memory_allocated(), before)
        with marked(REGISTRY.patched["verl"].left_in_place, model):  # as verl's get_per_tensor_param marks it
            fsdp_utils.load_fsdp_model_to_gpu(model)  # left on the host
            got = fsdp_utils.collect_lora_params(model, False, True)
            fsdp_utils.offload_fsdp_model_to_cpu(model)
        torch.cuda.synchronize()
        assert ferry.residency is Residency.HOST
        assert torch.cuda.memory_allocated() <= before
        assert list(got) == list(want)
        for k, t in want.items():
            assert got[k].device.type == "cpu" and got[k].dtype == t.dtype
            torch.testing.assert_close(got[k], t, atol=0, rtol=0)
        fsdp_utils.load_fsdp_model_to_gpu(model)  # outside a sync the model comes back, bit-exact
        torch.testing.assert_close(verl_own(model, False, True), want, atol=0, rtol=0)
    finally:
        tf_verl.unpatch()


def test_the_lora_sync_reads_offloaded_adapters_through_nccl_bit_identical():
    run_spawned(_lora_sync, world=1, backend="nccl")
