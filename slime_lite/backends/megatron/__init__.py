"""The Megatron-core trainer. Importing the package first hides the UserWarnings Megatron, Transformer Engine and
Apex raise while they import (shown at --log-level debug), in the driver and in every train worker."""

from slime_lite.logging_setup import quiet_import_warnings

quiet_import_warnings()
