"""Layer 4, how: streams, copies, packing kernels, the reload arena; the only layer that issues copies on streams.
Imports only the layers below it."""
