"""What the bench scenarios share: model presets and building, FSDP2 set-up and units, the link
peak, state checksums, output paths, progress and the rules for figures without a GPU.

Like every bench module, these import only ``torchferry``'s public names (``torchferry.__all__``),
torch, the standard library and third-party packages (``tests/cpu/test_bench_scenarios.py`` checks it).
"""
