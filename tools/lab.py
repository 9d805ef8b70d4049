"""``make lab``: JupyterLab on the tutorials, as root or not, with its URL shown plainly.

The tutorials open from ``lab/`` (copies that ``make lab`` makes once and never
overwrites), so running them, and JupyterLab's autosave, leave the tracked
``notebooks/`` as committed: ``git status`` stays clean and ``make test``
compares the tutorials with their committed outputs, not with a reader's run.

Usage: ``python tools/lab.py DIR [JUPYTERLAB ARGS...]``; ``make lab LAB_ARGS="--port 9999"``
passes its arguments here, after our defaults, so they win (``--ip 0.0.0.0`` to
reach a container from outside). As root (containers, Binder-like images) it adds
``--allow-root``, which JupyterLab otherwise demands and refuses to start without.

Once the server has written its runtime file, the URL to open (with its token)
is printed in a box, apart from the server's log. One Ctrl-C stops the server
(SIGTERM, a clean shutdown; killed if it has not exited after 15 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

START_TIMEOUT = 120.0  # s for the server to come up on a cold, busy 2-core machine
STOP_TIMEOUT = 15.0    # s for it to stop once told to, before it is killed


def command(root_dir: Path, extra: list[str]) -> list[str]:
    """The JupyterLab command line: our defaults first, then the user's arguments.

    >>> cmd = command(Path("lab"), ["--port", "9999"])
    >>> cmd[1:3], cmd[-2:]
    (['-m', 'jupyterlab'], ['--port', '9999'])
    >>> ("--allow-root" in cmd) == (os.geteuid() == 0)
    True
    """
    cmd = [sys.executable, "-m", "jupyterlab", "--ip=127.0.0.1",
           f"--ServerApp.root_dir={root_dir}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    return cmd + extra


def banner(url: str, root_dir: Path) -> str:
    """The box around the URL.

    >>> print(banner("http://127.0.0.1:8888/lab?token=abc", Path("lab")))
    <BLANKLINE>
    ==================================================================
      JupyterLab is running on the tutorials (your copies, in lab/):
    <BLANKLINE>
          http://127.0.0.1:8888/lab?token=abc
    <BLANKLINE>
      Open that URL in a browser. Ctrl-C stops the server.
    ==================================================================
    <BLANKLINE>
    """
    rule = "=" * 66
    return "\n".join(["", rule, f"  JupyterLab is running on the tutorials (your copies, in {root_dir}/):",
                      "", f"      {url}", "",
                      "  Open that URL in a browser. Ctrl-C stops the server.", rule, ""])


def server_url(info: dict) -> str:
    """The URL of the lab page, token included, from a server's runtime file.

    >>> server_url({"url": "http://127.0.0.1:8890/", "token": "t0k"})
    'http://127.0.0.1:8890/lab?token=t0k'
    >>> server_url({"url": "http://127.0.0.1:8890/", "token": ""})
    'http://127.0.0.1:8890/lab'
    """
    url = info["url"].rstrip("/") + "/lab"
    return f"{url}?token={info['token']}" if info.get("token") else url


def wait_for_runtime_file(proc: subprocess.Popen, runtime_dir: Path) -> dict | None:
    """The server's ``jpserver-PID.json`` once written, or None if it exits or times out."""
    path = runtime_dir / f"jpserver-{proc.pid}.json"
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):  # not yet, or half written
            time.sleep(0.2)
    return None


def stop(proc: subprocess.Popen) -> int:
    """Ask the server to stop (SIGTERM, which it handles as a shutdown), then kill it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    root_dir, extra = Path(argv[0]), argv[1:]
    from jupyter_core.paths import jupyter_runtime_dir

    proc = subprocess.Popen(command(root_dir, extra))
    try:
        info = wait_for_runtime_file(proc, Path(jupyter_runtime_dir()))
        if info is not None:
            print(banner(server_url(info), root_dir), flush=True)
        elif proc.poll() is None:
            print(f"JupyterLab has not written its URL after {START_TIMEOUT:.0f} s; "
                  "its log above says why.", file=sys.stderr, flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        # The terminal's Ctrl-C reached the server too, which would ask to confirm
        # and carry on without an answer: one Ctrl-C here means stop.
        return stop(proc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
