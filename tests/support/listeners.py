#!/usr/bin/env python3
"""Prints the listening TCP sockets (host:port, one a line) of every process in the given process
groups, from /proc. For the suites that must listen on 127.0.0.1 only.

  listeners.py PGID...
"""

import os
import sys


def main():
    groups = {int(g) for g in sys.argv[1:]}
    inodes = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            if int(stat[stat.rindex(")") + 2 :].split()[2]) not in groups:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                addr, port = fields[1].split(":")
                raw = bytes.fromhex(addr)
                if table == "tcp":
                    host = ".".join(str(b) for b in raw[::-1])
                else:
                    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
                    host = ":".join(b"".join(words).hex()[i : i + 4] for i in range(0, 32, 4))
                print(f"{host}:{int(port, 16)}")


if __name__ == "__main__":
    main()
