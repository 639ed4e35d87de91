"""Compile engine/native/*.c (decode.c, decode_rows.c, inspect.c, quant.c, products.c) into one library once per
machine and load it (ctypes); None, with the reason, when it cannot be or must not be.

The library is built with the system C compiler (`cc`, or $CC) for this machine's CPU (-march=native) and
cached under $LLM_INSPECTOR_CACHE (default ~/.cache/llm-inspector)/native, named by a hash of the source, the
flags and the CPU's feature flags, so a changed source or another machine builds its own. A build goes to a
temporary file and is renamed into place, so concurrent processes never load a half-written library.
LLM_INSPECTOR_NATIVE=0 turns the native decode step off (the PyTorch forward does every step).

Whatever is loaded runs inside the server, so the cache is trusted only as far as it is private: the folder is
created 0700, and a folder, library or checksum file that another user owns or can write is refused (the
PyTorch path is used, with the reason), as is a cache folder that is a symbolic link, or one below a folder
someone else could write to or owns (every folder up to /, `check_chain`). The SHA-256 of each library is
recorded next to it (llmi-….so.sha256) when it is built and compared before every load; a library whose bytes
do not match is built again in place.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

SOURCES = tuple(Path(__file__).with_name(n)
                for n in ("decode.c", "decode_rows.c", "inspect.c", "quant.c", "products.c"))
HEADERS = tuple(Path(__file__).with_name(n)
                for n in ("vexp.h", "rowstat.h", "llama_ops.h", "quant_ops.h", "quant_int8.h", "row_product.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


class UnsafeCacheError(RuntimeError):
    """The cache folder or a file in it could be changed by someone other than this user."""


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


def checksum_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


@functools.lru_cache(maxsize=1)
def load() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why not). Builds the library on first use (about a second)."""
    if os.environ.get("LLM_INSPECTOR_NATIVE", "1") == "0":
        return None, "turned off (LLM_INSPECTOR_NATIVE=0)"
    if platform.system() != "Linux":
        return None, f"built only on Linux (this is {platform.system()})"
    try:
        path = library_path()
        private_dir(path.parent)
        if not verified(path):
            with _build_lock(path.parent):       # another process may be building it right now: wait for it
                if not verified(path):
                    build(path)
                    if not verified(path):
                        raise UnsafeCacheError(f"{path} does not match its recorded SHA-256 right after building")
        # The folder is this user's alone (checked above), so nobody else can swap the file after the check.
        lib = ctypes.CDLL(str(path))
    except UnsafeCacheError as e:
        return None, f"refusing the native library cache: {e}"
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        return None, f"cannot build or load the native decode step: {e}"
    lib.llmi_decode_step.restype = ctypes.c_int
    lib.llmi_decode_step.argtypes = [ctypes.c_void_p]
    lib.llmi_work_floats.restype = ctypes.c_long
    lib.llmi_work_floats.argtypes = [ctypes.c_int] * 8
    lib.llmi_decode_rows.restype = ctypes.c_int
    lib.llmi_decode_rows.argtypes = [ctypes.c_void_p]
    lib.llmi_rows_work_floats.restype = ctypes.c_long
    lib.llmi_rows_work_floats.argtypes = [ctypes.c_int] * 9
    i, n, f, p = ctypes.c_int, ctypes.c_long, ctypes.c_float, ctypes.c_void_p
    lib.llmi_row_stats_many.restype = None
    lib.llmi_row_stats_many.argtypes = [i, p, p, p, i]
    lib.llmi_attention_work_floats.restype = ctypes.c_long
    lib.llmi_attention_work_floats.argtypes = [i] * 6
    lib.llmi_attention_stats.restype = ctypes.c_int
    lib.llmi_attention_stats.argtypes = [i, i, i, i, i, i, f, p, n, n, p, n, n, p, n, n, p, p, p, i]
    lib.llmi_quant_rows.restype = ctypes.c_int
    lib.llmi_quant_rows.argtypes = [i, p, n, n, p, n, p, i]
    lib.llmi_quant_x_bytes.restype = ctypes.c_long
    lib.llmi_quant_x_bytes.argtypes = [i, n]
    lib.llmi_quant_x.restype = ctypes.c_int
    lib.llmi_quant_x.argtypes = [i, p, n, p]
    lib.llmi_f32_rows.restype = None
    lib.llmi_f32_rows.argtypes = [p, n, n, p, n, p, i]
    lib.llmi_product_rows.restype = ctypes.c_int      # the steps' float products, for tests (products.c)
    lib.llmi_product_rows.argtypes = [p, i, p, i, i, p, i, i, i]
    return lib, ""


def _check_private(st: os.stat_result, path: Path) -> None:
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafeCacheError(f"{path} belongs to user id {st.st_uid}, not to this user (id {me})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheError(f"{path} can be written by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
                               "it must be writable by its owner only")


def private_dir(folder: Path) -> None:
    """Create the folder 0700 if it is missing; refuse one that is not this user's alone: a symbolic link, or a
    folder anyone but this user could replace (check_chain)."""
    folder = Path(os.path.abspath(folder))
    folder.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeCacheError(f"{folder} is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheError(f"{folder} is not a folder")
    _check_private(st, folder)
    check_chain(folder)


def check_chain(folder: Path) -> None:
    """Refuse a folder that someone else could swap: every folder above it, as written and with its symbolic links
    resolved, up to /, must belong to this user or to root and be writable by its owner only. A folder others may
    write to passes only with its sticky bit set (as /tmp) and when the entry below it is this user's or root's
    (the sticky bit keeps others from renaming or deleting it). A symbolic link on the way belongs to this user
    or root; its folder is the next one checked, its target on the resolved chain."""
    me = os.geteuid()
    for top in (folder, Path(os.path.realpath(folder))):
        below = me
        for p in top.parents:
            st = os.lstat(p)
            if st.st_uid not in (me, 0):
                raise UnsafeCacheError(f"{p}, a folder above the cache, belongs to user id {st.st_uid}, not to this "
                                       f"user (id {me}) or root: its owner could replace {folder}")
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (
                    st.st_mode & stat.S_ISVTX and below in (me, 0)):
                raise UnsafeCacheError(f"{p}, a folder above the cache, can be written by other users (mode "
                                       f"{stat.S_IMODE(st.st_mode):04o}): they could replace {folder}")
            below = st.st_uid


def _read_private(path: Path) -> bytes:
    """The bytes of a regular file of this user's that no one else can write (never through a symlink)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeCacheError(f"{path} is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCacheError(f"{path} is not a regular file")
        _check_private(st, path)
        return f.read()


def verified(path: Path) -> bool:
    """The library is there and its bytes hash to the SHA-256 recorded when it was built. False when either
    file is missing or they differ (build it again); UnsafeCacheError when either could be changed by others."""
    try:
        data = _read_private(path)
        recorded = _read_private(checksum_path(path)).decode("ascii", "replace").strip()
    except FileNotFoundError:
        return False
    return hashlib.sha256(data).hexdigest() == recorded


@contextlib.contextmanager
def _build_lock(folder: Path):
    fd = os.open(folder / ".build.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def build(path: Path) -> None:
    """Compile the library to path and record its SHA-256 next to it (both written whole, then renamed)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(r.stderr or r.stdout).strip()[-400:]}")
        os.chmod(tmp, 0o700)                  # the linker's mode follows the umask, which may let the group write
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fd, tmp = tempfile.mkstemp(suffix=".sha256", dir=path.parent)     # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(digest + "\n")
        os.replace(tmp, checksum_path(path))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
