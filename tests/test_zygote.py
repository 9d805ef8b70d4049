"""The engine zygote on its own: a fork that enters a network namespace first
(the fork launcher's ``netns`` option), and a namespace that cannot be entered."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import poll_for

from nbrpc.cluster.zygote import Zygote

# written whole, then renamed: the file never shows up empty or half written
REPORT = ("import os, sys; ns = os.readlink('/proc/self/ns/net'); "
          "open(sys.argv[1] + '.part', 'w').write(ns); os.rename(sys.argv[1] + '.part', sys.argv[1])")


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote(preload=())  # nothing to warm: the forks run a line of Python
    z.start()
    z.wait_ready(30)
    try:
        yield z
    finally:
        z.close()


@pytest.fixture
def namespace() -> Iterator[str]:
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs Linux, root and iproute2 (a network namespace)")
    name = f"nbzy-{os.getpid()}-{secrets.token_hex(2)}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=15)
    if r.returncode:
        pytest.skip(f"cannot make a network namespace here: {r.stderr.strip()}")
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=15)


def test_a_fork_enters_the_namespace_it_is_given(zygote: Zygote, namespace: str,
                                                 tmp_path: Path) -> None:
    report = tmp_path / "ns"
    zygote.spawn([sys.executable, "-c", REPORT, str(report)], env={}, cwd=str(tmp_path),
                 output=str(tmp_path / "out"), netns=f"/run/netns/{namespace}")
    assert poll_for(report.exists, 10), (tmp_path / "out").read_text()
    theirs = report.read_text()
    assert theirs == f"net:[{os.stat(f'/run/netns/{namespace}').st_ino}]", (
        tmp_path / "out").read_text()
    assert theirs != os.readlink("/proc/self/ns/net")


def test_a_namespace_that_cannot_be_entered_fails_the_fork_saying_so(
        zygote: Zygote, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pid = zygote.spawn([sys.executable, "-c", REPORT, str(tmp_path / "ns")], env={},
                       cwd=str(tmp_path), output=str(out), netns=str(tmp_path / "no-such-ns"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "no-such-ns" not in (
            out.read_text() if out.exists() else ""):
        time.sleep(0.05)
    assert "no-such-ns" in out.read_text(), out.read_text()
    assert not (tmp_path / "ns").exists()  # it never ran
    assert pid > 0
