"""The benchmarks behind ``torchferry bench``, ``bench-pin``, ``bench-lora`` and ``bench-grpo``: one folder
or module per scenario, on torchferry's public API.

* ``rl_step/``: ``torchferry bench``, a colocated RL step, the ways of moving the actor's state side by side;
* ``pin.py``: ``torchferry bench-pin``, pinning speed, small tensors and the first offload, on one GPU;
* ``lora.py``: ``torchferry bench-lora``, LoRA training with a frozen base (``skip_unchanged``);
* ``grpo/``: ``torchferry bench-grpo``, a GRPO-like step under a GPU budget, against a ``Dock``;
* ``_common/``: what they share (model building, FSDP2 set-up and units, the link peak, paths, output).

Each scenario draws its own table and summary; ``torchferry.cli`` only parses the options and calls
the scenario's ``*_command`` function. Bench modules import ``torchferry``'s public names only, never
``torchferry._core`` (``tests/cpu/test_bench_scenarios.py`` checks every module).
"""
