"""The native library's cache (engine/native/build.py) runs code inside the server, so it is used only while it
is this user's alone: the folder is made 0700, a folder or file another user owns or can write is refused (the
PyTorch path is taken, with the reason), and a library whose bytes differ from the SHA-256 recorded when it
was built is built again rather than loaded."""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.native import build

pytestmark = pytest.mark.unit

PLANTED_C = "int llmi_planted_marker(void) { return 42; }\n"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


if platform.system() != "Linux" or not _compiler():
    pytest.skip("the native library is built only on Linux with a C compiler", allow_module_level=True)


@pytest.fixture(scope="module")
def quick_builds():
    """The library built without optimisation (-O0: 0.2 s a build here, against 1.4 s at -O3): these tests check the
    cache (which file is trusted, rebuilt or refused), not the kernels. Its path hashes the flags, so no build here
    meets the library the rest of the suite uses."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build, "FLAGS", ("-O0", *(f for f in build.FLAGS if not f.startswith("-O"))))
        yield


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory, quick_builds) -> Path:
    """One cache, empty until build.load() built and recorded its library, copied by each test (a build takes
    seconds)."""
    root = tmp_path_factory.mktemp("native-cache")
    assert not any(root.iterdir())
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLM_INSPECTOR_CACHE", str(root))
        mp.delenv("LLM_INSPECTOR_NATIVE", raising=False)
        build.load.cache_clear()
        try:
            lib, why = build.load()
            assert lib is not None, why
        finally:
            build.load.cache_clear()
    return root


@pytest.fixture
def cache(built_cache, tmp_path, monkeypatch):
    """A private copy of the built cache as $LLM_INSPECTOR_CACHE; build.load's memo is cleared around the test."""
    root = tmp_path / "cache"
    shutil.copytree(built_cache, root, symlinks=True)
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(root))
    monkeypatch.delenv("LLM_INSPECTOR_NATIVE", raising=False)
    build.load.cache_clear()
    yield root
    build.load.cache_clear()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _mapped_files() -> set[str]:
    """The files this process has mapped (what dlopen actually loaded)."""
    return {line.split(maxsplit=5)[5].strip() for line in Path("/proc/self/maps").read_text().splitlines()
            if len(line.split(maxsplit=5)) == 6}


def test_a_fresh_cache_is_private_and_records_the_librarys_sha256(built_cache, monkeypatch):
    """What build.load() made of an empty cache folder: the module's one build, in built_cache."""
    monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(built_cache))
    path = build.library_path()
    assert path.parent == built_cache / "native"
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert path.stat().st_mode & 0o022 == 0 and build.checksum_path(path).stat().st_mode & 0o022 == 0
    assert build.checksum_path(path).read_text().strip() == _sha(path)
    assert str(path) in _mapped_files()                   # the library loaded is the one recorded


@pytest.mark.parametrize("planted", ["another library", "the library with bytes appended"])
def test_a_library_that_does_not_match_its_checksum_is_rebuilt_not_loaded(cache, tmp_path, planted):
    path = build.library_path()
    recorded = build.checksum_path(path).read_text().strip()
    if planted == "another library":
        src = tmp_path / "planted.c"
        src.write_text(PLANTED_C)
        subprocess.run([_compiler(), "-shared", "-fPIC", "-o", str(tmp_path / "planted.so"), str(src)], check=True)
        fake = (tmp_path / "planted.so").read_bytes()
    else:
        fake = path.read_bytes() + b"\0PLANTED"      # still a loadable ELF library, with other bytes
    path.write_bytes(fake)
    assert _sha(path) != recorded

    lib, why = build.load()
    assert lib is not None, why                       # rebuilt in place, then loaded
    assert not hasattr(lib, "llmi_planted_marker") and hasattr(lib, "llmi_decode_step")
    assert path.read_bytes() != fake
    assert _sha(path) == build.checksum_path(path).read_text().strip()
    assert str(path) in _mapped_files()


def test_a_library_without_a_recorded_checksum_is_rebuilt(cache):
    path = build.library_path()
    build.checksum_path(path).unlink()
    path.write_bytes(path.read_bytes() + b"\0unrecorded")
    lib, why = build.load()
    assert lib is not None, why
    assert _sha(path) == build.checksum_path(path).read_text().strip()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702], ids=lambda m: f"{m:04o}")
def test_a_cache_folder_others_can_write_is_refused(cache, mode):
    path = build.library_path()
    before = path.read_bytes()
    os.chmod(path.parent, mode)
    lib, why = build.load()
    assert lib is None
    assert "can be written by other users" in why and str(path.parent) in why and f"{mode:04o}" in why
    assert path.read_bytes() == before                # refused, not rebuilt into a folder others can write


@pytest.mark.parametrize("which", ["library", "checksum"])
def test_a_library_or_checksum_others_can_write_is_refused(cache, which):
    path = build.library_path()
    target = path if which == "library" else build.checksum_path(path)
    os.chmod(target, 0o666)
    lib, why = build.load()
    assert lib is None and "can be written by other users" in why and str(target) in why


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("which", ["folder", "library", "checksum"])
def test_a_folder_or_file_of_another_user_is_refused(cache, which):
    path = build.library_path()
    target = {"folder": path.parent, "library": path, "checksum": build.checksum_path(path)}[which]
    os.chown(target, 54321, -1)
    lib, why = build.load()
    assert lib is None and "belongs to user id 54321" in why and str(target) in why


def test_a_symlinked_library_is_refused(cache, tmp_path):
    path = build.library_path()
    elsewhere = tmp_path / "elsewhere.so"
    shutil.copy2(path, elsewhere)
    path.unlink()
    path.symlink_to(elsewhere)
    lib, why = build.load()
    assert lib is None and "is a symbolic link" in why
