"""mindie_host.testing.free_port: the ports of one cluster never collide.

A clean-clone CI run lost 16 PD tests at once: three servers' ports were picked one after another,
the kernel handed a just-released port out twice, and the third server found its inter-instance
port taken by the second one's metrics listener.
"""

from __future__ import annotations

import socket

from mindie_host.testing import free_port


def test_ports_picked_one_after_another_are_all_different_and_free() -> None:
    ports = [free_port() for _ in range(3000)]  # more than the tests of a run ask for
    assert len(set(ports)) == len(ports)
    for port in ports[:50]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
