"""Small file and socket helpers shared by rollout and training: atomic ``torch.save`` and a free TCP port."""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename: readers never see a partial file."""
    import torch

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
