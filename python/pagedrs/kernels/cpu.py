"""The CPU kernels in ``cpu/`` (paged attention, sampling, quantized matmuls, the fused decoder
stack): one extension built with `torch.utils.cpp_extension` on first use, cached under
``~/.cache/pagedrs`` by a hash of the sources, the compiler flags, torch's version and this
machine's CPU (the build targets it with ``-march=native``), loaded once, used as
``torch.ops.pagedrs_cpu.*`` and ``torch.classes.pagedrs_cpu.DecoderStack`` (all registered in
``cpu/torch_bindings.cpp``). ``python -m pagedrs.kernels.cpu`` builds it ahead of use (``make
cpu-kernels``, run by ``make test``), so no test or first request pays the compile."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

SOURCES = (
    "torch_bindings.cpp",
    "paged_attention.cpp",
    "sampling.cpp",
    "quant_matmul.cpp",
    "moe.cpp",
    "decoder_stack.cpp",
)
HEADERS = ("cpu_kernels.h",)


def sources_dir() -> Path:
    """``cpu/`` of the pagedrs checkout (``PAGEDRS_CPU_SOURCES`` overrides)."""
    override = os.environ.get("PAGEDRS_CPU_SOURCES")
    directory = Path(override) if override else Path(__file__).resolve().parents[3] / "cpu"
    if not (directory / SOURCES[0]).is_file():
        raise RuntimeError(
            f"the CPU kernel sources are not at {directory}: run from a pagedrs checkout or set PAGEDRS_CPU_SOURCES"
        )
    return directory


def compile_flags() -> list[str]:
    # NOTE: at::parallel_for is inlined from torch's headers as `omp parallel`, so it spreads
    # over threads only when compiled with -fopenmp. On Linux the extension then needs
    # libgomp.so.1, which torch has already loaded (its own copy): one OpenMP runtime, torch's
    # thread count. Elsewhere -fopenmp-simd keeps the `omp simd` loops vectorized and the
    # kernel runs on one thread.
    # -ffp-contract=fast: a * b + c as one fused multiply-add (ISO C++ mode turns it off).
    # -fno-trapping-math: lets floor and float-to-int vectorize (nothing here reads FP traps).
    flags = [
        "-O3",
        "-ffp-contract=fast",
        "-fno-trapping-math",
        "-fopenmp" if sys.platform == "linux" else "-fopenmp-simd",
    ]
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        flags.append("-march=native")
    elif machine in ("aarch64", "arm64"):
        flags.append("-mcpu=native")
    return flags


def _cpu_fingerprint() -> str:
    """What ``-march=native`` compiles for: the CPU model and its instruction-set flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keys = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in keys}))


def build_version() -> str:
    import torch

    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((sources_dir() / name).read_bytes())
    for part in (*compile_flags(), torch.__version__, sys.version, _cpu_fingerprint()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _put_ninja_on_path() -> None:
    """torch runs ``ninja`` from the PATH; the `ninja` wheel puts it beside this Python,
    which is not on the PATH when the virtual environment is not activated."""
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_path("scripts")
        if os.path.isfile(os.path.join(scripts, "ninja")):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load() -> ModuleType:
    """Builds (once per version, see `build_version`) and loads the kernel; returns
    ``torch.ops.pagedrs_cpu``. Raises when it cannot be built (no compiler, no ninja, no
    sources)."""
    import torch
    from torch.utils.cpp_extension import load as load_extension

    _put_ninja_on_path()
    version = build_version()
    build_dir = Path(os.environ.get("PAGEDRS_CACHE", Path.home() / ".cache" / "pagedrs")) / f"cpu-{version}"
    build_dir.mkdir(parents=True, exist_ok=True)
    load_extension(
        name=f"pagedrs_cpu_{version}",
        sources=[str(sources_dir() / name) for name in SOURCES],
        extra_cflags=compile_flags(),
        extra_ldflags=["-fopenmp"] if sys.platform == "linux" else [],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=bool(os.environ.get("PAGEDRS_VERBOSE_BUILD")),
    )
    return torch.ops.pagedrs_cpu


@functools.cache
def available() -> bool:
    """Whether the kernels (attention and sampling) build and load here; logs one warning when
    they do not."""
    try:
        load()
    except Exception as error:  # noqa: BLE001 -- any build failure means: use the torch paths
        import logging

        logging.getLogger("pagedrs").warning(
            "the CPU kernels did not build (%s); attention and sampling use torch ops", str(error).splitlines()[0]
        )
        return False
    return True


def main() -> int:
    import time

    start = time.perf_counter()
    try:
        load()
    except Exception as error:  # noqa: BLE001
        print(f"the CPU kernels did not build: {error}", file=sys.stderr)
        return 1
    print(f"ok: built and loaded torch.ops.pagedrs_cpu ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
