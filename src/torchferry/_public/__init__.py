"""What the public face adds above the core: the environment's settings read (``env``, the one place
``TORCHFERRY_*`` variables of the core are read) and ``torchferry.Ferry``, the core's ``Ferry`` made with
them (``ferry``). Imports the core only; ``torchferry/__init__`` and ``integrations`` build on it."""
