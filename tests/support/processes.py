"""Multi-process JAX jobs on loopback only: tests/test_multihost.py, tests/test_interruption.py."""

import ipaddress
import socket


def free_ports(count: int) -> list[int]:
  """Ports the OS has just found free on 127.0.0.1, distinct (all held while choosing)."""
  sockets = [socket.socket() for _ in range(count)]
  try:
    for s in sockets:
      s.bind(('127.0.0.1', 0))
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def host_name_is_loopback() -> bool:
  """Whether gloo's TCP transport, which listens on the host name's address, stays on loopback."""
  try:
    return ipaddress.ip_address(socket.gethostbyname(socket.gethostname())).is_loopback
  except OSError:
    return False
