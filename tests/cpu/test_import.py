import subprocess
import sys


def test_import_does_not_initialise_cuda_or_distributed():
    code = (
        "import sys, torch, torchferry, torchferry.compat.verl\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert 'torch.distributed.fsdp' not in sys.modules, 'fsdp imported eagerly'\n"
        "print(sorted(torchferry.__all__))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['Dock', 'Ferry', 'HostBudgetError', 'Prefetch', 'Residency', 'TransferHandle', 'TransferStats', 'swap']"
