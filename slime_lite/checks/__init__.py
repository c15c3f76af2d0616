"""What a run checks as it goes, below the driver and the backends: the ``--ci-test`` checks (ci.py), the
weight-equality check after a push (weight_check.py), the per-step grad-norm save/load (grad_norm.py) and the fault
injection points of ``--debug-inject-fault`` (faults.py). The user-facing tools that read a run afterwards (the
doctor, display, explain, diff ...) are in ``slime_lite.debug``; nothing outside it and cli.py imports them."""
