import pytest
import torch


def pytest_collection_modifyitems(config, items):
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_multi = pytest.mark.skip(reason="needs 2 CUDA devices")
    for item in items:
        if "gpu" in item.keywords and n == 0:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def own_ledger(tmp_path, monkeypatch):
    """The test gets its own node ledger (and no budget from the environment), so parallel test
    runs do not see each other's host pools."""
    monkeypatch.setenv("TORCHFERRY_LEDGER_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHFERRY_HOST_BUDGET_BYTES", raising=False)
    yield
