"""slime_lite: compact RL post-training for LLMs with the debugging workflow built in."""

import os as _os

# CPU matrix products whose rows do not depend on the rows around them: Intel MKL's strict reproducibility mode.
# Without it MKL's AVX-512 kernels round a row differently depending on how many rows share the call (and on the
# memory alignment), so on such CPUs the trainer's log-prob pass and train pass, packed differently, disagree in the
# last bit (step-1 ppo_kl not exactly 0). MKL reads it at its first call: set on import, before any product. A
# user's own MKL_CBWR is kept. (On an AMD EPYC, MKL rounds a product of 1-3 rows by other kernels, strict or not.)
_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
