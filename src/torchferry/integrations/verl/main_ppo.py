"""verl's PPO trainer with torchferry on in the driver and every Ray worker (``docs/verl-quickstart.md``)::

    python -m torchferry.integrations.verl.main_ppo <the arguments of python -m verl.trainer.main_ppo>

torchferry must be importable by the Ray workers (installed in their Python environment, as verl is).
"""

from __future__ import annotations

import sys

from . import _HOOK

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Runs ``verl.trainer.main_ppo.main`` on ``argv`` (default: ``sys.argv[1:]``) after ``patch()``, its
    ``ray.init`` given the Ray hook (a hook of your own in ``ray_kwargs.ray_init.runtime_env`` runs after it).

    Raises:
        RuntimeError: verl is not importable, or its offload helpers are not the ones this integration was
            written for.
    """
    _HOOK.launch("verl.trainer.main_ppo", sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    _HOOK.run_as_main(main)
