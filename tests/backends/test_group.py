"""The driver's train groups start their Ray workers without importing megatron-core or transformers in the driver
(the workers import them anyway: ~6 s of a 2-core machine saved per run). Ray itself runs these workers in every
end-to-end test; here ``ray.remote`` is replaced by a recorder (a fake: no cluster), in a fresh interpreter so that
no other test's imports are counted."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys
import ray
from slime_lite.args import parser_defaults
from slime_lite.backends.megatron import group

made = []

class Recorder:
    def __init__(self, cls):
        self.cls = cls
    def options(self, **opts):
        return self
    def remote(self, *args):
        made.append((self.cls.__name__, args[:2]))
        return object()

ray.remote = Recorder
group.bundle_options = lambda pg, b, share: {}
args = parser_defaults(hf_checkpoint="unused")
group.ActorGroup(args, None, [0, 1])
group.CriticGroup(args, None, [0])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("megatron", "transformers"))
assert not heavy, heavy[:5]
assert made == [("TrainActor", ("slime_lite.backends.megatron.actor", "TrainActor"))] * 2 + [
    ("CriticActor", ("slime_lite.backends.megatron.critic", "CriticActor"))], made
worker = group._Worker("slime_lite.types", "TrainResult", {"train/loss": 1.5}, [2.0])
assert worker.call("__eq__", sys.modules["slime_lite.types"].TrainResult({"train/loss": 1.5}, [2.0])) is True
print("ok")
"""


def test_train_groups_start_workers_without_importing_megatron_in_the_driver():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
