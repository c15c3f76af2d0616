"""slime_lite: compact RL post-training for LLMs with the debugging workflow built in."""

__version__ = "0.1.0"
