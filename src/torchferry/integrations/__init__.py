"""One-line switches that route a framework's own offload calls through torchferry."""
