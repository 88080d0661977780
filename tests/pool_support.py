"""Helpers for tests of the shared KV pool: a served device of several host ports with a pool
created, keys and payloads derived from a number, and a host process driven over a pipe."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cli_support import ROOT, serve_process

SLOT = 4096
FP = ("tiny", "float16", 16, 2, 2, 64)


def block_hash(n: int) -> bytes:
    return hashlib.sha256(b"block %d" % n).digest()


def payload(n: int, size: int = SLOT) -> bytes:
    return (hashlib.sha256(b"payload %d" % n).digest() * (size // 32 + 1))[:size]


@contextmanager
def pool_server(name: str, hosts: int = 2, size: str = "8M") -> Iterator[subprocess.Popen[str]]:
    """`cxlemu serve --hosts N --dc-region 256M` in its own process, and the pool created on it."""
    proc = serve_process(name, "--capacity", "256M", "--hosts", str(hosts), "--dc-region", "256M")
    try:
        subprocess.run([sys.executable, "-m", "tools.cli.main", "pool", "create", name, "--size", size,
                        "--slot-bytes", str(SLOT), "--via", str(hosts - 1)], cwd=ROOT, check=True,
                       capture_output=True, timeout=60)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        subprocess.run([sys.executable, "-m", "tools.cli.main", "destroy", name], cwd=ROOT, capture_output=True)


_CHILD = r'''
import json, sys
sys.path.insert(0, "tests")
from pool_support import FP, block_hash, payload
from driver import MemDev
from driver.pool import Fingerprint, KvPool
md = MemDev.open(sys.argv[1], host=int(sys.argv[2]))
pool = KvPool.open(md)
fp, held = Fingerprint(*FP), []
print(json.dumps({"ready": True, "pid": md.host}), flush=True)
for line in sys.stdin:
    op, n = json.loads(line)
    if op == "publish":
        out = pool.publish(fp, block_hash(n), payload(n))
    elif op == "load":
        buf = bytearray(4096)
        out = pool.load(fp, block_hash(n), buf) and bytes(buf) == payload(n)
    elif op == "pin":
        held.append(pool.pin(fp, block_hash(n)))
        out = held[-1] is not None
    else:
        out = pool.stats()
    print(json.dumps(out), flush=True)
'''


class HostProcess:
    """A process on one host port with the pool open, answering one JSON line per request."""

    def __init__(self, name: str, host: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, name, str(host)], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self._line())["ready"]

    def _line(self) -> str:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise AssertionError(f"the host process exited ({self.proc.wait()})")
        return line

    def ask(self, op: str, n: int = 0) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([op, n]) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
