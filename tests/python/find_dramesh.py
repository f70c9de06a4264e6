#!/usr/bin/env python3
"""Builds the dramesh binary (debug, or --release) and prints its path, wherever cargo puts it
(CARGO_TARGET_DIR, a workspace target-dir setting, or ./target): the path comes from cargo's
own build messages, not from a guess."""

import json
import subprocess
import sys


def main():
    cmd = ["cargo", "build", "--quiet", "--locked", "-p", "dramesh", "--bin", "dramesh",
           "--message-format=json-render-diagnostics"]
    if "--release" in sys.argv[1:]:
        cmd.append("--release")
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    path = None
    for line in out.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg.get("executable") \
                and msg["target"]["name"] == "dramesh":
            path = msg["executable"]
    if not path:
        print("cargo build reported no dramesh executable", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
