"""One log format for every process (the driver, tools, Ray actors, the engine): ``HH:MM:SS L name: message``.

Third-party noise is off below ``--log-level debug``: Megatron's INFO lines (the per-bucket parameter lists of its
DDP buffers, ~40 lines a run), the UserWarnings of Megatron, Transformer Engine and Apex (missing fused kernels,
deprecations), Ray's warning that a local cluster runs without token authentication (the cluster slime-lite
starts is this run's own), and httpx's line per request (the openai client of an agent). Their warnings and errors proper still show.
"""

from __future__ import annotations

import logging
import warnings

# logger name -> the lowest level shown below --log-level debug
QUIET_LOGGERS = {"megatron": logging.WARNING, "transformer_engine": logging.WARNING,
                 "ray._private.authentication": logging.ERROR,
                 "httpx": logging.WARNING}  # a line per request of an openai-client agent (rollout/agent_endpoint.py)
QUIET_WARNINGS = r"(megatron|transformer_engine|apex)(\.|$)"  # modules whose UserWarnings are hidden


def setup_logging(level: str = "INFO") -> None:
    """Configure the root logger once per process (the format; a no-op when it already has handlers) and set the
    level (``set_level``)."""
    logging.basicConfig(format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    set_level(level)


def set_level(level: str) -> None:
    """The root logger's level, and third-party noise hidden unless it is DEBUG (or lower)."""
    value = getattr(logging, str(level).upper(), logging.INFO)
    logging.getLogger().setLevel(value)
    debug = value <= logging.DEBUG
    for name, quiet in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(logging.NOTSET if debug else quiet)
    warnings.filterwarnings("default" if debug else "ignore", category=UserWarning, module=QUIET_WARNINGS)
