"""The transfer engine, one folder per layer, low to high; a module imports only from its own layer or the ones
below it (``tests/cpu/test_layers.py`` checks it)."""
