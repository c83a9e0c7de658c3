"""Build kvlab's C kernels once per machine and load them with ctypes.

The sources (every ``*.c`` under this folder, with the ``*.h`` they include; each header's
folder is on the include path) are compiled with the system C compiler for this CPU
(``-march=native``: whatever vector extensions it has) into one library
under ``$KVLAB_CACHE/kernels``, keyed by the sources, the flags and the CPU (model,
features), so a cache shared between machines never loads code built for another CPU.
OpenMP comes from the libgomp torch has already loaded. Without a compiler the kernels are
unavailable and callers use their torch reference path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from kvlab.paths import cache_dir

SOURCES = sorted(Path(__file__).parent.rglob("*.c"))
HEADERS = sorted(Path(__file__).parent.rglob("*.h"))  # part of the build's key, not compiled
# fast-math for the code (vectorized expf from glibc's libmvec, reassociated reductions;
# the kernels use a finite sentinel, not -inf, for "no score seen"), but never on the link
# line: there gcc adds crtfastmath.o, which sets flush-to-zero for the whole process
FLAGS = ["-O3", "-march=native", "-fPIC", "-fopenmp", "-std=c11", "-ffast-math"]
# bit-identical to the torch path: no fast-math
EXACT = ("codes.c", "decode_layer.c", "gemv_w4a8.c", "gemv_w8a8.c", "rms_norm.c")
LIBS = ["-lmvec", "-lm"]


def cpu_identity() -> str:
    """The CPU as code built or tuned for it must know it: its model name and feature flags
    (the first of each in /proc/cpuinfo), or the machine type where there is none."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return os.uname().machine
    lines = cpuinfo.read_text().splitlines()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(wanted)) or os.uname().machine


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    sources = (s.read_bytes() for s in SOURCES + HEADERS)
    for part in (*sources, " ".join(FLAGS + LIBS + list(EXACT)).encode()):
        key.update(part)
    key.update(compiler.encode())
    key.update(cpu_identity().encode())
    return cache_dir() / "kernels" / f"kvlab-{key.hexdigest()[:16]}.so"


def _compile(compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        commands = [
            [compiler, *_flags(source), "-c", str(source), "-o", str(obj)]
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        commands.append(
            [compiler, "-shared", "-fopenmp", *map(str, objects), "-o", str(partial), *LIBS]
        )
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
        partial.replace(out)


def _flags(source: Path) -> list[str]:
    flags = [f for f in FLAGS if f != "-ffast-math"] if source.name in EXACT else FLAGS
    return [*flags, *(f"-I{folder}" for folder in sorted({h.parent for h in HEADERS}))]


def library_identity() -> str:
    """The loaded kernel build's name (sources, flags, compiler, CPU), or "none"."""
    compiler = _compiler()
    if library() is None or compiler is None:
        return "none"
    return _library_path(compiler).stem


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first use; None (with one warning) where it
    cannot be built or loaded, or when ``KVLAB_KERNELS=0``."""
    if os.environ.get("KVLAB_KERNELS", "1") == "0":
        return None
    import torch  # noqa: F401  (its libgomp must be loaded first, so the kernels share it)

    compiler = _compiler()
    if compiler is None:
        warnings.warn(
            "kvlab: no C compiler found; CPU decode attention uses torch ops", stacklevel=2
        )
        return None
    path = _library_path(compiler)
    try:
        if not path.exists():
            _compile(compiler, path)
        return ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as exc:
        warnings.warn(f"kvlab: C kernels unavailable ({exc}); using torch ops", stacklevel=2)
        return None


# argument types of kernel signatures (pointers are passed as ints from ``data_ptr()``)
POINTER, INT, INT64, FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


@functools.cache
def kernel(name: str, *argtypes, restype=None) -> ctypes._CFuncPtr:
    """The library's function ``name`` with its argument types (and its result's, None for
    void) declared once: a call then passes Python ints and floats straight through,
    without building a ctypes object per argument (a decode step makes hundreds of kernel
    calls)."""
    function = getattr(library(), name)
    function.argtypes, function.restype = list(argtypes), restype
    return function
