"""A FAKE attack for the loading tests: an object whose unpickling writes a marker file (as a crafted checkpoint or
dump would run any code). A safe load must refuse it and leave no marker."""

from __future__ import annotations

from pathlib import Path


def write_marker(path: str) -> str:
    Path(path).write_text("code ran")
    return path


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (write_marker, (self.marker,))
