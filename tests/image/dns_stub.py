#!/usr/bin/env python3
"""A stub DNS server for the image check: answers A queries for the names given on the command
line with 127.0.0.1, every other query with NXDOMAIN (AAAA of a known name: no answer), over
UDP on --listen (default 127.0.0.1:53), and writes each question to --log. Serves until killed.

It lets the check prove that the static binary in the image resolves names through
/etc/resolv.conf (search domains, ndots) with no NSS modules to load, as a replica resolving
`--seed dramesh-replica-0.dramesh-replica-peers:7946` in a pod does."""

import argparse
import socket
import struct


def question(packet):
    """(name, qtype, end offset) of the first question."""
    labels, i = [], 12
    while packet[i]:
        n = packet[i]
        labels.append(packet[i + 1 : i + 1 + n].decode("ascii", "replace"))
        i += 1 + n
    qtype, _qclass = struct.unpack("!HH", packet[i + 1 : i + 5])
    return ".".join(labels).lower(), qtype, i + 5


def answer(packet, names):
    txid, flags = struct.unpack("!HH", packet[:4])
    name, qtype, end = question(packet)
    rd = flags & 0x0100
    known = name in names
    rcode = 0 if known else 3  # NXDOMAIN
    records = b""
    count = 0
    if known and qtype == 1:
        # A pointer to the question's name, type A, class IN, TTL 5 s, 4 bytes.
        records = struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton("127.0.0.1")
        count = 1
    header = struct.pack("!HHHHHH", txid, 0x8180 | rd | rcode, 1, count, 0, 0)
    return name, qtype, header + packet[12:end] + records


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--listen", default="127.0.0.1:53")
    p.add_argument("--log", required=True)
    p.add_argument("names", nargs="+")
    a = p.parse_args()
    host, port = a.listen.rsplit(":", 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((host, int(port)))
    names = {n.lower().rstrip(".") for n in a.names}
    with open(a.log, "a", buffering=1) as log:
        log.write("listening\n")
        while True:
            packet, peer = s.recvfrom(4096)
            try:
                name, qtype, reply = answer(packet, names)
            except (IndexError, struct.error):
                continue
            log.write(f"{qtype} {name}\n")
            s.sendto(reply, peer)


if __name__ == "__main__":
    main()
