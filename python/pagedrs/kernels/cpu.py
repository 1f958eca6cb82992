"""The CPU kernels in ``cpu/`` (paged attention, sampling, quantized matmuls, the fused decoder
stack): one extension built with `torch.utils.cpp_extension` on first use, cached under
``~/.cache/pagedrs`` by a hash of the sources, the compiler flags, torch's version and this
machine's CPU (the build targets it with ``-march=native``, or the x86 instruction set
``PAGEDRS_CPU_ISA`` names: ``avx2``, ``avxvnni``, ``avx512``), loaded once, used as
``torch.ops.pagedrs_cpu.*`` and ``torch.classes.pagedrs_cpu.DecoderStack`` (all registered in
``cpu/torch_bindings.cpp``). ``python -m pagedrs.kernels.cpu`` builds it ahead of use (``make
cpu-kernels``, run by ``make test``), so no test or first request pays the compile."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
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
HEADERS = ("cpu_kernels.h", "quant_blocks.h", "kv_rows.h")


def sources_dir() -> Path:
    """``cpu/`` of the pagedrs checkout (``PAGEDRS_CPU_SOURCES`` overrides)."""
    override = os.environ.get("PAGEDRS_CPU_SOURCES")
    directory = Path(override) if override else Path(__file__).resolve().parents[3] / "cpu"
    if not (directory / SOURCES[0]).is_file():
        raise RuntimeError(
            f"the CPU kernel sources are not at {directory}: run from a pagedrs checkout or set PAGEDRS_CPU_SOURCES"
        )
    return directory


ISA_FLAGS = {
    "avx2": ("-march=x86-64-v3",),
    "avxvnni": ("-march=x86-64-v3", "-mavxvnni"),
    "avx512": ("-march=x86-64-v4",),
}
"""x86 instruction sets the kernels can be built for besides ``native`` (``PAGEDRS_CPU_ISA``):
AVX2 + FMA + F16C; the same with AVX-VNNI (Alder Lake and later without AVX-512); AVX-512
F/BW/DQ/VL (no VNNI). Each selects its own code paths at compile time (``cpu/quant_matmul.cpp``),
so building the ones this machine does not take keeps them from rotting (`compile_check`;
``make cpu-isa-check``)."""

INT8_PATHS = {
    "avx512-vnni": "AVX-512 VNNI (vpdpbusd, 16 weight rows a register)",
    "avx-vnni": "AVX-VNNI (vpdpbusd, 8 weight rows a register)",
    "avx2": "AVX2 (maddubs + madd: stored panels of 8 weight rows, else one row at a time)",
    "neon-dotprod": "NEON dot product (sdot, one row at a time)",
    "neon": "NEON widening multiplies (smull + sadalp, one row at a time)",
    "none": "not built (neither AVX2 nor NEON): exact path",
}
"""What ``torch.ops.pagedrs_cpu.int8_activation_path()`` can name: the instructions of the
opt-in int8-activation matmul in this build."""


def _isa() -> str:
    isa = os.environ.get("PAGEDRS_CPU_ISA", "native")
    if isa != "native" and isa not in ISA_FLAGS:
        raise ValueError(f"PAGEDRS_CPU_ISA must be one of native, {', '.join(ISA_FLAGS)}; got {isa!r}")
    return isa


def native_isa() -> str:
    """The instruction set ``-march=native`` takes here: ``avx512``, ``avx2`` or ``other``."""
    flags = _cpu_fingerprint().split()
    if "avx512f" in flags and "avx512bw" in flags:
        return "avx512"
    return "avx2" if "avx2" in flags and "fma" in flags else "other"


def compile_flags(isa: str | None = None) -> list[str]:
    """The compiler's flags for ``isa`` (default: ``PAGEDRS_CPU_ISA``, else ``native``)."""
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
    isa = isa or _isa()
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        flags += ["-march=native"] if isa == "native" else [*ISA_FLAGS[isa], "-mtune=native"]
    elif machine in ("aarch64", "arm64"):
        if isa != "native":
            raise ValueError(f"PAGEDRS_CPU_ISA={isa} is an x86 instruction set; this machine is {machine}")
        flags.append("-mcpu=native")
    return flags


def describe() -> str:
    """The paths the built kernels take on this machine, for the start-up log (builds and loads
    the kernels if they are not yet)."""
    isa = _isa()
    target = native_isa() if isa == "native" else isa
    matmul = {
        "avx512": "blocks dequantized into AVX-512 registers",
        "avx2": "blocks dequantized into AVX2 registers",
        "avxvnni": "blocks dequantized into AVX2 registers",
    }.get(
        target,
        "blocks dequantized into NEON registers"
        if platform.machine().lower() in ("aarch64", "arm64")
        else "blocks dequantized by scalar code",
    )
    ops = load()
    if ops.scales_first_rows():
        matmul += " (Q8_0, Q4_0 and Q4_1 rows stored scales first)"
    int8_path = ops.int8_activation_path()
    vnni = f", {int8_path}" if "vnni" in int8_path else ""
    prefetch = ops.int8_panel_prefetch_bytes()
    panels = ""  # (a build without stored int8 panels)
    if prefetch > 0:
        panels = f"; stored int8 panels prefetched {prefetch // 1024} KB ahead"
    elif prefetch == 0:  # AMD's: software prefetches measured slower there (quant_matmul.cpp)
        panels = "; stored int8 panels read behind the CPU's own prefetchers alone"
    return (
        f"CPU kernels for {isa}{f' ({target}{vnni})' if isa == 'native' else ''}: packed matmul {matmul}; "
        f"int8 activations by {INT8_PATHS[int8_path]}{panels}; attention and sampling compiler-vectorized"
    )


def compile_check(isa: str, sources: tuple[str, ...] = SOURCES) -> float:
    """Compiles kernel sources (default: all) for ``isa`` into object code that is thrown away
    (nothing is loaded: this machine may not run it); raises with the compiler's output on an
    error. Returns the seconds it took."""
    import time

    import torch
    from torch.utils.cpp_extension import include_paths

    start = time.perf_counter()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    base = [  # as torch.utils.cpp_extension compiles them (its build.ninja's cflags)
        os.environ.get("CXX", "c++"),
        "-std=c++20",
        "-fPIC",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(flag for path in includes for flag in ("-isystem", path)),
        *compile_flags(isa),
    ]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        runs = list(
            pool.map(
                lambda name: subprocess.run(
                    [*base, "-c", str(sources_dir() / name), "-o", os.devnull], capture_output=True, text=True
                ),
                sources,
            )
        )
    failed = [(name, run) for name, run in zip(sources, runs) if run.returncode != 0]
    if failed:
        name, run = failed[0]
        raise RuntimeError(f"{name} does not compile for {isa}:\n{run.stderr[-4000:]}")
    return time.perf_counter() - start


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


def _native_int8_isa(native: str) -> str:
    """The `ISA_FLAGS` entry whose int8-activation path ``-march=native`` builds here."""
    flags = _cpu_fingerprint().split()
    return "avxvnni" if native == "avx2" and "avx_vnni" in flags else native


def main() -> int:
    """``python -m pagedrs.kernels.cpu``: builds and loads the kernels for this machine;
    ``--compile-check-other``: also compiles them for the x86 instruction set it does not take
    (AVX-512 on an AVX2 machine, AVX2 on an AVX-512 one), and ``quant_matmul.cpp`` for each other
    int8-activation path (AVX-VNNI, or AVX2 on an AVX-VNNI machine)."""
    import time

    start = time.perf_counter()
    try:
        load()
    except Exception as error:  # noqa: BLE001
        print(f"the CPU kernels did not build: {error}", file=sys.stderr)
        return 1
    print(f"ok: built and loaded torch.ops.pagedrs_cpu for {_isa()} ({time.perf_counter() - start:.1f} s)")
    if "--compile-check-other" in sys.argv[1:]:
        native = native_isa()
        if native == "other" or platform.machine().lower() not in ("x86_64", "amd64"):
            print(f"no other x86 instruction set to check on this {platform.machine()} machine")
            return 0
        other = "avx2" if native == "avx512" else "avx512"
        int8_only = [isa for isa in ISA_FLAGS if isa not in (other, _native_int8_isa(native))]
        try:
            seconds = compile_check(other)
            print(f"ok: the kernels compile for {other} too ({seconds:.1f} s; this machine runs {native})")
            for isa in int8_only:
                seconds = compile_check(isa, ("quant_matmul.cpp",))
                print(f"ok: quant_matmul.cpp compiles for {isa} too ({seconds:.1f} s)")
        except RuntimeError as error:
            print(error, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
