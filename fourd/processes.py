"""How fourd starts helper processes: multiprocessing's forkserver where its socket fits, else spawn."""

from __future__ import annotations

import multiprocessing
import tempfile

# multiprocessing's forkserver listens on TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, an AF_UNIX socket
# whose path may hold 107 bytes on Linux (sockaddr_un.sun_path)
_SOCKET_PATH_MAX = 107
_FORKSERVER_SOCKET_NAME = len("/pymp-xxxxxxxx/listener-xxxxxxxx")


def forkserver_fits() -> bool:
    """True when multiprocessing's forkserver is available and its socket fits below this TMPDIR."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    return len(tempfile.gettempdir()) + _FORKSERVER_SOCKET_NAME <= _SOCKET_PATH_MAX
