"""Which local user a TCP peer is: LMCache's protocol carries no credentials, so the
gateway admits a connection only from a process of an allowed user on this host.

Linux keeps every TCP socket of the host's network namespace in /proc/net/tcp and
/proc/net/tcp6, with its local and remote address and the uid that owns it. The
connecting socket is the row whose local address is the accepted socket's peer and whose
remote address is the accepted socket's own; its uid column is the connecting process's
user. A peer on another host has no such row: it is unknown (None), as is everything on
a system without /proc.
"""

from __future__ import annotations

import ipaddress
import socket
import sys

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def proc_address(host: str, port: int) -> tuple[str, str]:
    """(v4 form, v6 form) of host:port as /proc/net/tcp{,6} print it: the address as 32-bit
    words in host byte order, in hex; the port in hex. An IPv4 peer of an IPv6 listener is
    the IPv4-mapped address in tcp6."""
    address = ipaddress.ip_address(host.split("%", 1)[0])
    mapped = getattr(address, "ipv4_mapped", None)
    v4 = mapped or (address if address.version == 4 else None)
    v6 = address if address.version == 6 else ipaddress.IPv6Address(f"::ffff:{address}")
    forms = []
    for addr in (v4, v6):
        if addr is None:
            forms.append("")
            continue
        raw = addr.packed
        words = "".join(
            f"{int.from_bytes(raw[i : i + 4], sys.byteorder):08X}" for i in range(0, len(raw), 4)
        )
        forms.append(f"{words}:{port:04X}")
    return forms[0], forms[1]


def peer_uid(sock: socket.socket, tables: tuple[str, ...] = TABLES) -> int | None:
    """The uid owning the other end of an accepted TCP socket when it is on this host;
    None when it is not found (another host, a peer already gone, no /proc)."""
    try:
        peer, local = sock.getpeername(), sock.getsockname()
    except OSError:
        return None
    theirs = proc_address(peer[0], peer[1])
    ours = proc_address(local[0], local[1])
    for table, their, our in zip(tables, theirs, ours, strict=True):
        uid = _owner(table, their, our)
        if uid is not None:
            return uid
    return None


def _owner(table: str, local: str, remote: str) -> int | None:
    if not local or not remote:
        return None
    try:
        with open(table) as rows:
            next(rows, None)  # the header
            for row in rows:
                fields = row.split()
                if len(fields) > 7 and fields[1] == local and fields[2] == remote:
                    return int(fields[7])
    except OSError:
        return None
    return None
