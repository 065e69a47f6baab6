"""Layer 4, how: streams, copies, packing kernels, the reload arena; the only layer that issues copies on streams
and makes streams (``streams``). The schedules above hand it what to copy as data (``batches``, ``gates``), never a
callback. Imports only the layers below it."""
