"""The launcher's store, as the workers reach it.

torchrun's agent hosts a TCPStore that its workers share (it sets
TORCHELASTIC_USE_AGENT_STORE=True and points MASTER_ADDR:MASTER_PORT at
it); stp's own launcher (stp.runtime.launch) does the same. Through it the
workers meet before the process group exists (stp.runtime.launch's start-up
wait, stp.runtime.agree), and beat (stp.runtime.watch). Keys are scoped by
the run and its restart, so a restarted run never reads an old value.

Who can reach it. stp's launcher binds its store to 127.0.0.1 only (a socket
it binds itself, handed to the TCPStore: `loopback_store`), so no other machine
can connect. Other users of the same machine can, so what stp decides from the
store (heartbeats: which rank froze; the nodes' settings) is signed with the
job's secret, STP_JOB_TOKEN, which the launcher draws at random and gives its
workers through their environment (`seal` / `unseal`: an HMAC of key and
value; a value that does not verify is ignored). Under torchrun the agent's
store is torch's: it listens on every interface of the --master-addr node at
--master-port, and torch's own rendezvous keys in it are not signed; set the
same STP_JOB_TOKEN on every node (e.g. `STP_JOB_TOKEN=$(openssl rand -hex 16)`
shared by the launch script) so that stp's keys are signed, and run multi-node
jobs on a network only the job's nodes reach.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["SharedStore", "TOKEN_ENV", "loopback_store", "new_token", "seal", "shared_store",
           "unseal"]

TOKEN_ENV = "STP_JOB_TOKEN"
"""The job's secret: stp's launcher sets a random one in every worker's environment."""
_MAC_HEX = 32


@dataclass
class SharedStore:
    """A client of the launcher's store, and this worker's place in the world."""

    store: dist.Store
    rank: int
    world_size: int

    def key(self, name: str) -> str:
        """`stp/<name>/<run id>/<restart>`: `name` within this run's attempt."""
        env = os.environ
        return (f"stp/{name}/{env.get('TORCHELASTIC_RUN_ID', '')}/"
                f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def shared_store(timeout: float) -> SharedStore | None:
    """A new client of the launcher's store (its operations wait at most `timeout`
    seconds), or None without one: a single process, or a launcher whose store
    the workers do not share."""
    import torch.distributed as dist  # here: stp.runtime.watch loads before torch

    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env.get("WORLD_SIZE", 1)) < 2:
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout))
    return SharedStore(store, int(env["RANK"]), int(env["WORLD_SIZE"]))


def new_token() -> str:
    return secrets.token_hex(16)


def _mac(key: str, value: str, token: str | None) -> str:
    secret = (os.environ.get(TOKEN_ENV, "") if token is None else token).encode()
    return hmac.new(secret, f"{key}\0{value}".encode(), hashlib.sha256).hexdigest()[:_MAC_HEX]


def seal(key: str, value: str, token: str | None = None) -> str:
    """`value` signed for `key` with the job's secret (`token`, default this process's
    STP_JOB_TOKEN; see the module doc)."""
    return f"{value}|{_mac(key, value, token)}"


def unseal(key: str, sealed: bytes | str, token: str | None = None) -> str | None:
    """The value `seal(key, value)` signed, or None for one the job did not write."""
    text = sealed.decode(errors="replace") if isinstance(sealed, bytes) else sealed
    value, sep, mac = text.rpartition("|")
    if not sep or not hmac.compare_digest(mac, _mac(key, value, token)):
        return None
    return value


def loopback_store(timeout: float) -> dist.TCPStore:
    """A master TCPStore listening on 127.0.0.1 only, on a free port.

    TCPStore("127.0.0.1", 0, is_master=True) binds every interface (the address is
    where clients connect, not where the server listens): a machine on the network
    could read and write the job's keys. So the socket is bound here and handed to
    the store (`master_listen_fd`); holding it from bind to listen also leaves no
    window in which another process could take the port."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=timeout),
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now (and closes it)
    return store
