"""Layer 6: the ``Ferry`` face, its state set, reconcile, pin-ahead, guards, swap. Imports only the layers below it."""
