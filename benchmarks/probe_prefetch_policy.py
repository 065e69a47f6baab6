"""Probe: `torchferry bench` with the prefetch strategy's policy set from TORCHFERRY_PROBE_LOOKAHEAD
(bytes; "none" issues every group at reload()). Same arguments as `torchferry bench`.

    TORCHFERRY_PROBE_LOOKAHEAD=none torchrun --nproc_per_node 2 benchmarks/probe_prefetch_policy.py bench ...
"""
import os
import sys

import torchferry
import torchferry.bench._strategies as strategies
from torchferry.cli import main

look = os.environ.get("TORCHFERRY_PROBE_LOOKAHEAD", "none")
strategies.TorchferryPrefetch.lookahead = torchferry.Prefetch(lookahead_bytes=None if look == "none" else int(look))
sys.argv = ["torchferry", *sys.argv[1:]]
main()
