"""Building extensions: a stale build lock fails fast, naming the file to delete; a live one is waited for."""

from __future__ import annotations

import os
import threading
import time

import pytest

from megalite import extensions
from megalite.extensions import ExtensionUnavailable
pytestmark = pytest.mark.usefixtures("fresh_extension_cache")   # tests/conftest.py


def test_a_stale_build_lock_fails_fast_naming_the_file(tmp_path, monkeypatch):
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.raises(ExtensionUnavailable, match=f"stale build lock: {lock} is 3600 s old.*delete"):
        extensions._wait_for_build_lock(tmp_path)
    # Through load_extension: the fallback, with the same message in its warning; no compiler is started.
    build_dir = extensions.extensions_dir() / "stale_test"
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()
    os.utime(build_dir / "lock", (old, old))
    with pytest.warns(RuntimeWarning, match="stale build lock"):
        assert extensions.load_extension("stale_test", ["cpu_adam.cpp"]) is None


def test_a_live_build_lock_is_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv(extensions.LOCK_TIMEOUT_ENV, "30")
    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()   # the other process finishes its build
    start = time.monotonic()
    extensions._wait_for_build_lock(tmp_path)
    assert 0.2 < time.monotonic() - start < 10


def test_a_lock_older_than_the_timeout_is_stale(tmp_path, monkeypatch):
    monkeypatch.setenv(extensions.LOCK_TIMEOUT_ENV, "0.5")
    (tmp_path / "lock").touch()
    start = time.monotonic()
    with pytest.raises(ExtensionUnavailable, match="MEGALITE_BUILD_LOCK_TIMEOUT=0.5 s"):
        extensions._wait_for_build_lock(tmp_path)
    assert time.monotonic() - start < 5


def test_a_given_lock_timeout_replaces_the_default(tmp_path, monkeypatch):
    """The fused kernels wait on another rank's build as long as the distributed timeout, not 300 s."""
    monkeypatch.setenv(extensions.LOCK_TIMEOUT_ENV, "0.5")
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 1   # older than the environment's bound, younger than the given one: a live build
    os.utime(lock, (old, old))
    threading.Timer(0.3, lock.unlink).start()
    extensions._wait_for_build_lock(tmp_path, timeout_s=30)
    lock.touch()
    os.utime(lock, (old - 60, old - 60))
    with pytest.raises(ExtensionUnavailable, match="a lock may get 30 s old, the distributed timeout"):
        extensions._wait_for_build_lock(tmp_path, timeout_s=30)
