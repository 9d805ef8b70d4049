"""``python -m nbrpc.cluster.relay_engine [ENGINE ARGS]``: an ipyparallel
engine on another host than its controller. It starts the engine's end of
the controller's relay (:func:`.relay.start_engine_relay`: ipyparallel's
channels as Unix sockets in a private directory, each connection dialled on
to the driver's relay with the key's token first), then runs ipyparallel's
engine in this process, pointed at those sockets. A Cluster puts it in
place of ``-m ipyparallel.engine`` in the launcher's ``engine_cmd``.
"""

from __future__ import annotations

import runpy
import sys

from .relay import start_engine_relay


def main() -> None:
    start_engine_relay()
    sys.argv = ["ipyparallel.engine", *sys.argv[1:]]
    runpy.run_module("ipyparallel.engine", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
