"""The transfer engine, one folder per layer, low to high; a module imports only from its own layer or the ones
below it, and the folders' promises hold (copies only from ``_transfer``, streams only from its ``streams``,
torch's internals only in ``_state/fsdp`` and ``_state/fsdp1``, the environment nowhere: a ferry is handed its settings,
``_api/settings.CoreSettings``): ``tests/cpu/test_layers.py`` checks them."""
