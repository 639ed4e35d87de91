"""Compile engine/native/*.c (decode.c, inspect.c) into one library once per machine and load it (ctypes);
None, with the reason, when it cannot be.

The library is built with the system C compiler (`cc`, or $CC) for this machine's CPU (-march=native) and
cached under $LLM_INSPECTOR_CACHE (default ~/.cache/llm-inspector)/native, named by a hash of the source, the
flags and the CPU's feature flags, so a changed source or another machine builds its own. A build goes to a
temporary file and is renamed into place, so concurrent processes never load a half-written library.
LLM_INSPECTOR_NATIVE=0 turns the native decode step off (the PyTorch forward does every step).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = (Path(__file__).with_name("decode.c"), Path(__file__).with_name("inspect.c"))
HEADERS = (Path(__file__).with_name("vexp.h"), Path(__file__).with_name("rowstat.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def cache_dir() -> Path:
    root = os.environ.get("LLM_INSPECTOR_CACHE") or Path.home() / ".cache" / "llm-inspector"
    return Path(root) / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path() -> Path:
    text = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    h = hashlib.sha256(text + " ".join(FLAGS).encode() + _cpu_flags().encode()
                       + platform.machine().encode()).hexdigest()[:16]
    return cache_dir() / f"llmi-{h}.so"


@functools.lru_cache(maxsize=1)
def load() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why not). Builds the library on first use (about a second)."""
    if os.environ.get("LLM_INSPECTOR_NATIVE", "1") == "0":
        return None, "turned off (LLM_INSPECTOR_NATIVE=0)"
    if platform.system() != "Linux":
        return None, f"built only on Linux (this is {platform.system()})"
    try:
        path = library_path()
        if not path.exists():
            build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        return None, f"cannot build or load the native decode step: {e}"
    lib.llmi_decode_step.restype = ctypes.c_int
    lib.llmi_decode_step.argtypes = [ctypes.c_void_p]
    lib.llmi_work_floats.restype = ctypes.c_long
    lib.llmi_work_floats.argtypes = [ctypes.c_int] * 8
    i, n, f, p = ctypes.c_int, ctypes.c_long, ctypes.c_float, ctypes.c_void_p
    lib.llmi_row_stats_many.restype = None
    lib.llmi_row_stats_many.argtypes = [i, p, p, p, i]
    lib.llmi_attention_work_floats.restype = ctypes.c_long
    lib.llmi_attention_work_floats.argtypes = [i] * 6
    lib.llmi_attention_stats.restype = ctypes.c_int
    lib.llmi_attention_stats.argtypes = [i, i, i, i, i, i, f, p, n, n, p, n, n, p, n, n, p, p, p, i]
    return lib, ""


def build(path: Path) -> None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(r.stderr or r.stdout).strip()[-400:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
