"""One log format for every process (the driver, tools, Ray actors, the engine): ``HH:MM:SS L name: message``.

Third-party noise is off below ``--log-level debug``: Megatron's INFO lines (the per-bucket parameter lists of its
DDP buffers, ~40 lines a run), the UserWarnings of Megatron, Transformer Engine and Apex (missing fused kernels,
deprecations), Ray's warning that a local cluster runs without token authentication (the cluster slime-lite
starts is this run's own), and httpx's line per request (the openai client of an agent). Their warnings and errors proper still show.
"""

from __future__ import annotations

import logging
import os
import warnings

# logger name -> the lowest level shown below --log-level debug
QUIET_LOGGERS = {"megatron": logging.WARNING, "transformer_engine": logging.WARNING,
                 "ray._private.authentication": logging.ERROR,
                 "httpx": logging.WARNING}  # a line per request of an openai-client agent (rollout/agent_endpoint.py)
QUIET_WARNINGS = r"(megatron|transformer_engine|apex)(\.|$)"  # modules whose UserWarnings are hidden


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # what --log-level takes (any case)
LOG_LEVEL_ENV = "SLIME_LITE_LOG_LEVEL"  # the run's --log-level, for every process it starts (Ray actors included)


def setup_logging(level: str = "INFO") -> None:
    """Configure the root logger once per process (the format; a no-op when it already has handlers) and set the
    level (``set_level``)."""
    logging.basicConfig(format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    set_level(level)


def set_level(level: str) -> None:
    """The root logger's level, and third-party noise hidden unless it is DEBUG (or lower); the processes this one
    starts get the level through ``$SLIME_LITE_LOG_LEVEL``."""
    value = getattr(logging, str(level).upper(), logging.INFO)
    os.environ[LOG_LEVEL_ENV] = logging.getLevelName(value)
    logging.getLogger().setLevel(value)
    for name, quiet in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(logging.NOTSET if value <= logging.DEBUG else quiet)
    quiet_import_warnings()


def quiet_import_warnings() -> None:
    """Hide (or, at ``$SLIME_LITE_LOG_LEVEL`` DEBUG, show) the UserWarnings of Megatron, Transformer Engine and
    Apex. Called before Megatron is imported too (``slime_lite.backends.megatron``): most are raised at import."""
    debug = getattr(logging, os.environ.get(LOG_LEVEL_ENV, "INFO").upper(), logging.INFO) <= logging.DEBUG
    warnings.filterwarnings("default" if debug else "ignore", category=UserWarning, module=QUIET_WARNINGS)
