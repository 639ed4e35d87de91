"""Issue 31, item 7: the native library's cache is checked along its whole chain, not only its last folder: a
folder above it that others can write to (or own), or a `native/` that is a symbolic link, is refused before
anything is built or loaded (the PyTorch path is taken, with the reason). /tmp-like folders (sticky bit) are
fine when the entry below them is this user's."""
from __future__ import annotations

import os
import platform

import pytest

from engine.native import build

pytestmark = pytest.mark.unit
if platform.system() != "Linux":
    pytest.skip("the native library is built only on Linux", allow_module_level=True)


@pytest.fixture
def load_from(monkeypatch):
    def go(root):
        monkeypatch.setenv("LLM_INSPECTOR_CACHE", str(root))
        monkeypatch.delenv("LLM_INSPECTOR_NATIVE", raising=False)
        build.load.cache_clear()
        try:
            return build.load()
        finally:
            build.load.cache_clear()
    return go


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757], ids=lambda m: f"{m:04o}")
def test_a_folder_above_the_cache_that_others_can_write_is_refused(tmp_path, load_from, mode):
    shared = tmp_path / "shared"
    (shared / "me").mkdir(parents=True)
    os.chmod(shared, mode)
    lib, why = load_from(shared / "me" / "cache")
    assert lib is None and "refusing the native library cache" in why
    assert f"{shared}, a folder above the cache, can be written by other users (mode {mode:04o})" in why
    assert not list((shared / "me").rglob("*.so"))                           # nothing was built there


def test_a_native_folder_that_is_a_symbolic_link_is_refused(tmp_path, load_from):
    root, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    root.mkdir(mode=0o700)
    elsewhere.mkdir(mode=0o700)
    (root / "native").symlink_to(elsewhere)
    lib, why = load_from(root)
    assert lib is None and f"{root / 'native'} is a symbolic link" in why
    assert not list(elsewhere.iterdir())


def test_a_link_above_the_cache_into_a_folder_others_can_write_is_refused(tmp_path, load_from):
    open_dir = tmp_path / "open"
    (open_dir / "me").mkdir(parents=True)
    os.chmod(open_dir, 0o777)
    (tmp_path / "home").mkdir(mode=0o700)
    (tmp_path / "home" / "link").symlink_to(open_dir / "me")
    lib, why = load_from(tmp_path / "home" / "link" / "cache")
    assert lib is None and f"{open_dir}, a folder above the cache, can be written by other users" in why


def test_a_sticky_shared_folder_above_a_folder_of_this_users_is_fine(tmp_path):
    sticky = tmp_path / "tmp-like"
    (sticky / "mine").mkdir(parents=True, mode=0o700)
    os.chmod(sticky, 0o1777)
    build.private_dir(sticky / "mine" / "cache" / "native")                 # no error
    assert (os.stat(sticky / "mine" / "cache" / "native").st_mode & 0o777) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_above_the_cache_of_another_user_is_refused(tmp_path, load_from):
    theirs = tmp_path / "theirs"
    (theirs / "me").mkdir(parents=True)
    os.chmod(theirs, 0o755)
    os.chown(theirs, 54321, -1)
    lib, why = load_from(theirs / "me" / "cache")
    assert lib is None and f"{theirs}, a folder above the cache, belongs to user id 54321" in why
