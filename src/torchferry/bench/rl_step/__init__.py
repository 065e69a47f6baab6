"""``torchferry bench``: one colocated RL step (rollout, old_log_prob, update_actor) on Qwen2, the ways
of moving the actor's state side by side, against a resident baseline.

``config`` (what runs; no torch import, so that ``--help`` is quick), ``strategies`` (the ways of
moving the state), ``workload`` (one step, timed phase by phase), ``timer`` (FSDP units' compute
seconds), ``rounds`` (set-ups, timed steps, hand-overs), ``overlap`` (the arithmetic),
``summary`` (records to figures), ``run`` (the whole run as a function), ``report`` and ``plot``
(table, lines, PNG), ``trace`` (a profiler trace of one step), ``command`` (what the CLI calls).
"""
