"""Small file and socket helpers shared by rollout and training: safe ``torch.load``, atomic writes that report a
full disk as such (files, and Hugging Face model folders), the probe of an output folder, and a free TCP port."""

from __future__ import annotations

import collections
import errno
import ipaddress
import json
import os
import pickle
import re
import shutil
import socket
import tempfile
import zipfile
from collections.abc import Callable
from typing import IO, Any

from slime_lite.errors import SlimeLiteError

# a full disk, or a full quota: the same problem for the user
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space_error(exc: OSError, path: str) -> SlimeLiteError | None:
    """The user-facing error for a write that failed because the disk (or quota) is full; None for other errors."""
    if exc.errno in _NO_SPACE:
        return SlimeLiteError(f"no space left writing {path} ({os.strerror(exc.errno)}). Free space on that disk or "
                              "point the flag at another one; nothing partial was left behind.")
    return None


def _numpy_globals() -> list[Any]:
    """What unpickling a numeric numpy array names: its rebuild function, ndarray, dtype and the numeric dtypes'
    classes (slime keeps a sample's routed experts as one); an object array needs more and stays refused."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 / 1
    kinds = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
             "float64"]
    rebuild = core.multiarray._reconstruct  # under either name: a file numpy 1 wrote names numpy.core's
    return [rebuild, (rebuild, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype,
            *{type(np.dtype(k)) for k in kinds}]


def load_plain(path: str, what: str, error: type[SlimeLiteError] = SlimeLiteError, mmap: bool = False,
               numpy_arrays: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU: tensors and plain containers only, so nothing in the file
    runs. A missing, empty, truncated or unsafe file raises ``error`` naming the file and what is wrong. ``mmap``:
    tensors of a zip-format file are mapped, not read (a cheap check of a large file). ``numpy_arrays``: numeric
    numpy arrays too (slime's rollout dumps)."""
    import torch  # torch: io is on the CLI start-up path

    if not os.path.exists(path):
        raise error(f"{what} {path} does not exist.")
    if os.path.isdir(path):
        raise error(f"{what} {path} is a folder, not a file.")
    if os.path.getsize(path) == 0:
        raise error(f"{what} {path} is empty (0 bytes): it was not written completely; re-create it.")
    with open(path, "rb") as f:
        head = f.read(12)
    if not head.startswith((b"PK\x03\x04", b"\x80")):  # neither torch.save's zip nor its legacy pickle format
        raise error(f"{what} {path} is not a torch file (corrupt, or another format: it starts with {head!r}); "
                    "a file written by torch.save was expected. Re-create it.")
    try:
        with torch.serialization.safe_globals(_numpy_globals() if numpy_arrays else []):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and head.startswith(b"PK"))
    except pickle.UnpicklingError as exc:
        text = str(exc)
        found = re.search(r"GLOBAL (\S+)", text) or re.search(r"but got <class '([^']+)'>", text)
        if found:  # a pickle that names a function or class to call: the shape of every code-running payload
            raise error(
                f"{what} {path} is not a plain-tensor file: it asks to load {found.group(1)}, so it was refused "
                "(loaded with weights_only=True; nothing in it ran). Only tensors, dicts, lists, numbers and "
                "strings are accepted; re-create the file with slime_lite, or convert it where you trust its source."
            ) from None
        raise error(f"{what} {path} is truncated, corrupt or not a torch file (not a plain-tensor file: "
                    f"{_first_line(text)}). Re-create it.") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError, KeyError, IndexError,
            TypeError, AttributeError, UnicodeDecodeError) as exc:  # what torch raises on garbage input
        raise error(f"{what} {path} is truncated, corrupt or not a torch file ({type(exc).__name__}: "
                    f"{_first_line(str(exc))}). Re-create it.") from None


def _first_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0][:200] if lines else ""


class _WriteErrors:
    """A file that remembers the OSError of a failed write: ``torch.save`` turns it into a RuntimeError."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


def atomic_write(path: str, write: Callable[[Any], None]) -> None:
    """``write(f)`` to a temporary file in the same folder, fsync, then rename: readers never see a partial file, a
    failure leaves no temporary file, and a full disk is a SlimeLiteError "no space left writing PATH"."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1], dir=folder)
    except OSError as exc:
        raise (no_space_error(exc, path) or exc) from None
    out = None
    try:
        with os.fdopen(fd, "wb") as f:
            out = _WriteErrors(f)
            write(out)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        cause = out.error if out is not None and out.error is not None else exc
        full = no_space_error(cause, path) if isinstance(cause, OSError) else None
        if full is not None:
            raise full from None
        raise


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` through ``atomic_write``."""
    import torch  # torch: io is on the CLI start-up path

    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(text: str, path: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def append_line(path: str, line: str) -> None:
    """Append one line (a metrics record); a full disk is a SlimeLiteError naming the file."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError as exc:
        raise (no_space_error(exc, path) or exc) from None


def within(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or lies inside it, links resolved."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def probe_folder(folder: str, flag: str) -> None:
    """Create ``folder`` (and its parents) and write, fsync and remove a small file in it, so that a missing,
    unwritable or full output location is found before any work starts. SlimeLiteError naming ``flag`` (the flag
    and its value) and the folder."""
    try:
        os.makedirs(folder, exist_ok=True)
    except FileExistsError:
        raise SlimeLiteError(f"{flag}: {folder} exists but is not a folder; choose another path.") from None
    except OSError as exc:
        raise SlimeLiteError(f"{flag}: cannot create the folder {folder} ({exc.strerror or exc}); choose a path you "
                             "can write to.") from None
    if not os.path.isdir(folder):
        raise SlimeLiteError(f"{flag}: {folder} exists but is not a folder; choose another path.")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".slime-lite-probe-", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        if exc.errno in _NO_SPACE:
            raise SlimeLiteError(f"{flag}: no space left writing {folder} ({os.strerror(exc.errno)}). Free space "
                                 "on that disk or point the flag at another one.") from None
        raise SlimeLiteError(f"{flag}: the folder {folder} is not writable ({exc.strerror or exc}); choose a path "
                             "you can write to.") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` (an IPv4 or IPv6 address, brackets or not) right now (the OS picks it)."""
    host = host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address, IPv6 with or without brackets) is this host's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another host name
        return False


def http_url(host: str, port: int) -> str:
    """``http://host:port``; an IPv6 address in brackets."""
    host = host.strip("[]")
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _config_dtype(path: str, named: dict[str, Any]) -> None:
    """The config's dtype (``torch_dtype``, ``dtype``) set to the written tensors' float dtype: a float32 export of
    a model whose config says bfloat16 would be loaded rounded to bfloat16 (transformers' ``dtype="auto"``)."""
    floats = collections.Counter(str(v.dtype).removeprefix("torch.") for v in named.values() if v.is_floating_point())
    if not floats or not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    dtype = floats.most_common(1)[0][0]
    keys = [k for k in ("torch_dtype", "dtype") if k in config]
    if keys and any(config[k] != dtype for k in keys):
        config.update(dict.fromkeys(keys, dtype))
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)


def hf_export_files(hf_checkpoint: str) -> list[str]:
    """The files of ``hf_checkpoint`` a Hugging Face export copies (config, tokenizer; not its weights)."""
    return sorted(name for name in os.listdir(hf_checkpoint)
                  if os.path.isfile(os.path.join(hf_checkpoint, name)) and not name.endswith((".safetensors", ".bin"))
                  and name != "model.safetensors.index.json")


def foreign_entry(out_dir: str, hf_checkpoint: str) -> str | None:
    """An entry of an existing ``out_dir`` that an export of ``hf_checkpoint`` does not write (a folder, or a file
    of another name), which replacing the folder would delete; None when there is none (or no folder)."""
    if not os.path.isdir(out_dir):
        return None if not os.path.exists(out_dir) else out_dir
    ours = set(hf_export_files(hf_checkpoint)) | {"model.safetensors"}
    return next((os.path.join(out_dir, name) for name in sorted(os.listdir(out_dir))
                 if name not in ours or not os.path.isfile(os.path.join(out_dir, name))), None)


def save_safetensors(tensors: dict[str, Any], path: str, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file``, a failed write raised as the OSError it was: safetensors raises its own error
    class, which names the system error only in its text (``(os error 28)``: a full disk), so no ``except OSError``
    saw it."""
    from safetensors.torch import save_file  # torch: only the trainer's processes write weights

    try:
        save_file(tensors, path, metadata=metadata)
    except Exception as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None or isinstance(exc, OSError):
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), path) from exc


def write_hf_folder(named: dict[str, Any], hf_checkpoint: str, out_dir: str) -> None:
    """A Hugging Face model folder: ``named`` tensors as model.safetensors, with the config and tokenizer files of
    ``hf_checkpoint``. Written to a temporary folder beside ``out_dir``, then renamed: a failed write (a full disk)
    leaves neither a partial folder nor the temporary one. An existing ``out_dir`` is replaced only when it holds
    nothing but files of such an export (an earlier one); else SlimeLiteError, and nothing is deleted."""
    stray = foreign_entry(out_dir, hf_checkpoint)
    if stray is not None:
        raise SlimeLiteError(f"the Hugging Face export to {out_dir} would replace that folder, and it holds {stray}, "
                             "which no export writes: move it away or export to another folder.")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-hf-", dir=parent)
    try:
        for name in hf_export_files(hf_checkpoint):
            shutil.copy2(os.path.join(hf_checkpoint, name), tmp)
        save_safetensors({k: v.contiguous() for k, v in named.items()}, os.path.join(tmp, "model.safetensors"),
                         metadata={"format": "pt"})
        _config_dtype(os.path.join(tmp, "config.json"), named)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException as exc:  # (an interrupt too: no temporary folder is left)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise no_space_error(exc, out_dir) or exc
        raise
