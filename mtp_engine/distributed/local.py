"""Starting N local processes over the ring backend on 127.0.0.1, as `mlx.launch --hosts
127.0.0.1 -n N` would (a hostfile of one free port per rank, $MLX_RANK, $MLX_HOSTFILE): the tests
and the CPU benchmark use it; real runs use `mlx.launch`."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
from contextlib import closing


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def hostfile(n: int, directory: str | None = None) -> str:
    """A ring hostfile for n local ranks (a path; the caller removes it)."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="mtp-ring-", dir=directory)
    with closing(os.fdopen(fd, "w")) as f:
        json.dump([[f"127.0.0.1:{p}"] for p in free_ports(n)], f)
    return path


def spawn(n: int, argv: list[str], env: dict | None = None, **popen) -> tuple[list[subprocess.Popen], str]:
    """Starts `argv` n times as ranks 0..n-1 of one ring group; returns the processes and the
    hostfile path."""
    path = hostfile(n)
    base = dict(os.environ if env is None else env)
    procs = [subprocess.Popen(argv, env={**base, "MLX_RANK": str(r), "MLX_HOSTFILE": path}, **popen)
             for r in range(n)]
    return procs, path
