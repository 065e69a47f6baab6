"""SkyRL's PPO trainer with torchferry on in the driver and every Ray worker::

    python -m torchferry.integrations.skyrl.main_base <the arguments of python -m skyrl.train.entrypoints.main_base>

or SkyRL's own entry point, which hands over to this one before it parses its config::

    python -m skyrl.train.entrypoints.main_base trainer.override_entrypoint=torchferry.integrations.skyrl.main_base ...

torchferry must be importable by the Ray workers (installed in their Python environment, as SkyRL is).
"""

from __future__ import annotations

import sys

from . import _HOOK, patch

__all__ = ["main"]

_OVERRIDE = "trainer.override_entrypoint="  # SkyRL's hand-over to this module; not a field of its config


def main(argv: list[str] | None = None) -> None:
    """Runs ``skyrl.train.entrypoints.main_base.main`` on ``argv`` (default: ``sys.argv[1:]``; a
    ``trainer.override_entrypoint=...`` dropped) after ``patch()``, its ``ray.init`` given the Ray hook.

    Raises:
        RuntimeError: SkyRL is not importable, or its offload helpers are not the ones this integration was
            written for.
    """
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith(_OVERRIDE)]
    _HOOK.launch("skyrl.train.entrypoints.main_base", argv, patch)


if __name__ == "__main__":
    _HOOK.run_as_main(main)
