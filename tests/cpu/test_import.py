import subprocess
import sys


def test_import_does_not_initialise_cuda_or_distributed():
    code = (
        "import sys, torch, torchferry, torchferry.integrations.verl\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert 'torch.distributed.fsdp' not in sys.modules, 'fsdp imported eagerly'\n"
        "print(sorted(torchferry.__all__))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("['CoreSettings', 'Dock', 'DockStats', 'Ferry', 'HostBudgetError', 'Move', "
                                  "'Prefetch', 'Residency', 'Schedule', 'TransferHandle', 'TransferStats', 'swap']")


def test_public_names_are_torchferrys_and_the_old_verl_path_warns():
    code = (
        "import warnings, torchferry\n"
        "assert all(getattr(torchferry, n).__module__ == 'torchferry' for n in torchferry.__all__)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import torchferry.compat.verl\n"
        "assert any(issubclass(x.category, DeprecationWarning) and 'integrations.verl' in str(x.message) for x in w)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
