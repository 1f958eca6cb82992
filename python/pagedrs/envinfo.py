"""Facts about the software and machine a result was measured on, for benchmark records and
the server's ``/server_info``."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
from typing import Any


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The commit of the pagedrs checkout this package runs from (``+dirty`` if changed), or
    ``None`` for an installed wheel."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=8)
def model_fingerprint(path: str) -> str | None:
    """sha256 of a model file (GGUF); for a checkpoint directory, of its config.json and the
    names and sizes of its files. ``None`` if the path is not readable here."""
    digest = hashlib.sha256()
    try:
        if os.path.isfile(path):
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        elif os.path.isdir(path):
            with open(os.path.join(path, "config.json"), "rb") as f:
                digest.update(f.read())
            for name in sorted(os.listdir(path)):
                digest.update(f"{name}:{os.path.getsize(os.path.join(path, name))}".encode())
        else:
            return None
    except OSError:
        return None
    return "sha256:" + digest.hexdigest()


def environment() -> dict[str, Any]:
    """Versions and hardware of this process's machine."""
    from pagedrs import __version__

    info: dict[str, Any] = {
        "pagedrs_version": __version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
    except ImportError:
        info["torch"] = None
    return info
