"""A killed native-kernel build's lock is cleared, not waited on for ever; a live builder is waited on."""

import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from hf_lowprec.optim.native import build_lock, native_unavailable


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _host() -> str:
    import socket

    return socket.gethostname().replace("-", "_")


def test_a_lock_whose_builder_died_is_removed(tmp_path):
    (tmp_path / "lock").touch()
    (tmp_path / f"hf_lowprec-owner-{_host()}-{_dead_pid()}").touch()
    with build_lock.claim(tmp_path):
        assert not (tmp_path / "lock").exists()
        assert [p.name for p in tmp_path.iterdir()] == [f"hf_lowprec-owner-{_host()}-{os.getpid()}"]
    assert list(tmp_path.iterdir()) == []  # this process's owner file goes with the load


def test_a_lock_without_owner_is_removed_only_when_old(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    assert not build_lock._stale(tmp_path, _host())  # a build by torch alone, maybe running
    old = time.time() - build_lock.STALE_AFTER_S - 60
    os.utime(lock, (old, old))
    assert build_lock._stale(tmp_path, _host())
    with build_lock.claim(tmp_path):
        assert not lock.exists()


def test_a_live_builder_is_waited_for(tmp_path, monkeypatch):
    monkeypatch.setattr(build_lock, "_POLL_S", 0.01)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "lock").touch()
        (tmp_path / f"hf_lowprec-owner-{_host()}-{live.pid}").touch()
        entered = threading.Event()

        def load():
            with build_lock.claim(tmp_path):
                entered.set()

        thread = threading.Thread(target=load)
        thread.start()
        assert not entered.wait(0.5)  # waits while the builder lives and holds the lock
        (tmp_path / "lock").unlink()  # the builder finished
        assert entered.wait(10)
        thread.join()
        assert (tmp_path / "lock").exists() is False
    finally:
        live.kill()
        live.wait()


@pytest.mark.skipif(native_unavailable() is not None, reason=f"native kernels unavailable: {native_unavailable()}")
def test_the_kernels_load_past_a_killed_builds_lock(tmp_path):
    # A copy of the built extension with the lock and owner file a killed build leaves: the load
    # (in a fresh process) clears it and returns, where it hung before.
    built = build_lock.build_directory("hf_lowprec_native_optim")
    copy = tmp_path / "hf_lowprec_native_optim"
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "hf_lowprec-owner-*"))
    (copy / "lock").touch()
    (copy / f"hf_lowprec-owner-{_host()}-{_dead_pid()}").touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    code = "from hf_lowprec.optim import native; print('reason', native.native_unavailable())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "reason None" in out.stdout
    assert "left by a native-kernel build that was killed" in out.stderr
    assert not (copy / "lock").exists()
