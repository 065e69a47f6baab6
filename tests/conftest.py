import os

# Under pytest-xdist, one share of the cores for each worker's ATen intra-op pool (unless the
# environment sets OMP_NUM_THREADS): `-n auto` runs one worker per core, and each worker's default
# pool of one thread per core oversubscribed them; a pool spinning on a descheduled thread made a
# BatchNorm1d(8) forward take 30 ms instead of 0.02 (2 cores, two workers). Set before torch starts
# its pool; the subprocesses and spawned ranks the tests start inherit it.
_THREADS = None
if "PYTEST_XDIST_WORKER" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    _THREADS = max(1, len(os.sched_getaffinity(0)) // _workers)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)

import pytest  # noqa: E402
import torch  # noqa: E402

if _THREADS is not None:
    torch.set_num_threads(_THREADS)  # in case a plugin imported torch before this file


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
