"""verl's PPO trainer with torchferry on in the driver and every Ray worker (``docs/verl-quickstart.md``)::

    python -m torchferry.integrations.verl.main_ppo <the arguments of python -m verl.trainer.main_ppo>

torchferry must be importable by the Ray workers (installed in their Python environment, as verl is).
"""

from __future__ import annotations

import sys

from . import patch, ray_init_with_hook
from ._patch import check_settings

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """Runs ``verl.trainer.main_ppo.main`` on ``argv`` (default: ``sys.argv[1:]``) after :func:`patch`, its
    ``ray.init`` given the Ray hook (a hook of your own in ``ray_kwargs.ray_init.runtime_env`` runs after it).

    Raises:
        RuntimeError: verl is not importable, or its offload helpers are not the ones this integration was
            written for.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    patch()
    from verl.trainer import main_ppo  # after patch(): verl modules it imports bind torchferry's helpers

    sys.argv = [sys.argv[0], *argv]  # Hydra reads its overrides from sys.argv
    with ray_init_with_hook():
        main_ppo.main()


if __name__ == "__main__":
    try:
        check_settings()  # a bad setting is one line here, not a traceback from inside patch()
    except ValueError as e:
        sys.exit(str(e))
    main()
