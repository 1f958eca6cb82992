"""The CUDA kernels in ``cuda/``: built with `torch.utils.cpp_extension` on first use (cached
by a hash of the sources), loaded once, used as ``torch.ops.pagedrs.*``; and a compile-only
check that needs no GPU (``python -m pagedrs.kernels.cuda --check``, run by
``make test``), so a kernel that does not build cannot land."""

from __future__ import annotations

import argparse
import functools
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

SOURCES = ("cache_kernels.cu", "paged_attention.cu", "torch_bindings.cpp")
HEADERS = ("ops.h", "dtype.cuh")
CHECK_ARCHS = ("80", "90")


def sources_dir() -> Path:
    """``cuda/`` of the pagedrs checkout (``PAGEDRS_CUDA_SOURCES`` overrides)."""
    override = os.environ.get("PAGEDRS_CUDA_SOURCES")
    directory = Path(override) if override else Path(__file__).resolve().parents[3] / "cuda"
    if not (directory / SOURCES[0]).is_file():
        raise RuntimeError(
            f"the CUDA sources are not at {directory}: run from a pagedrs checkout or set PAGEDRS_CUDA_SOURCES"
        )
    return directory


def _source_hash(directory: Path) -> str:
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((directory / name).read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def load() -> ModuleType:
    """Builds (once per source version, cached under ``~/.cache/pagedrs``) and loads the
    kernels; returns ``torch.ops.pagedrs``."""
    import torch
    from torch.utils.cpp_extension import load as load_extension

    if not torch.cuda.is_available():
        raise RuntimeError("the pagedrs CUDA kernels need a CUDA device")
    directory = sources_dir()
    version = _source_hash(directory)
    build_dir = Path(os.environ.get("PAGEDRS_CACHE", Path.home() / ".cache" / "pagedrs")) / f"cuda-{version}"
    build_dir.mkdir(parents=True, exist_ok=True)
    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    load_extension(
        name=f"pagedrs_cuda_{version}",
        sources=[str(directory / name) for name in SOURCES],
        extra_include_paths=[str(directory)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=bool(os.environ.get("PAGEDRS_VERBOSE_BUILD")),
    )
    return torch.ops.pagedrs


# -- compiling without a GPU ------------------------------------------------------------------


def find_nvcc() -> str:
    """nvcc from $CUDA_HOME, the PATH, or the `nvidia-cuda-nvcc` wheel in this environment."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    if nvcc_on_path := shutil.which("nvcc"):
        candidates.append(nvcc_on_path)
    candidates += sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "bin", "nvcc")))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError("nvcc not found: install nvidia-cuda-nvcc (make test does) or set CUDA_HOME")


def cuda_include_dirs(nvcc: str) -> list[str]:
    """The CUDA headers that go with `nvcc` (the wheel layout keeps them beside bin/)."""
    root = Path(nvcc).resolve().parent.parent
    dirs = [root / "include", root / "targets" / "x86_64-linux" / "include"]
    return [str(d) for d in dirs if d.is_dir()]


def compile_check(archs: tuple[str, ...] = CHECK_ARCHS, verbose: bool = True) -> None:
    """Compiles every kernel for each ``sm_<arch>`` with nvcc and the torch binding with the
    C++ compiler against torch's headers, without linking or a GPU. Raises on any error."""
    from torch.utils.cpp_extension import include_paths

    directory = sources_dir()
    nvcc = find_nvcc()
    cuda_includes = cuda_include_dirs(nvcc)
    includes = [f"-I{directory}", *(f"-I{d}" for d in cuda_includes)]
    with tempfile.TemporaryDirectory() as out:
        for name in (n for n in SOURCES if n.endswith(".cu")):
            gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
            command = [
                nvcc,
                "-c",
                "-std=c++17",
                "-O3",
                "--expt-relaxed-constexpr",
                *gencode,
                *includes,
                str(directory / name),
                "-o",
                os.path.join(out, name + ".o"),
            ]
            _run(command, f"nvcc {name} for sm_{', sm_'.join(archs)}", verbose)
        torch_includes = [f"-I{d}" for d in include_paths()]
        command = [
            os.environ.get("CXX", "c++"),
            "-fsyntax-only",
            "-std=c++20",
            *torch_includes,
            *includes,
            str(directory / "torch_bindings.cpp"),
        ]
        _run(command, "c++ torch_bindings.cpp against torch's headers", verbose)


def _run(command: list[str], what: str, verbose: bool) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{result.stdout}{result.stderr}")
    if verbose:
        print(f"ok: {what}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compile-only check for sm_80 and sm_90 (no GPU needed)")
    parser.add_argument("--arch", action="append", help="with --check: an sm_ number (default 80 and 90)")
    args = parser.parse_args(argv)
    if args.check:
        try:
            compile_check(tuple(args.arch or CHECK_ARCHS))
        except RuntimeError as error:
            print(error, file=sys.stderr)
            return 1
        return 0
    load()
    print("built and loaded torch.ops.pagedrs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
