"""The job's store is reachable from this machine only, and what stp decides from it
(heartbeats, the nodes' settings) cannot be faked by another client of it.

Before: TCPStore("127.0.0.1", 0, is_master=True) listened on every interface
(`ss`: LISTEN *:PORT); a client on the machine's external address read and
wrote keys and faked a frozen rank's heartbeat."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from stp.runtime import store as store_mod
from stp.runtime.agree import SettingsDiffer, _verdict
from stp.runtime.launch import launch_local
from stp.runtime.store import loopback_store, seal, unseal
from stp.runtime.watch import BeatMonitor, beat_key, read_beat


def listeners(port: int) -> list[str]:
    """The local addresses listening on TCP `port` (IPv4 and IPv6), from /proc/net."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                found.append(addr)
    return found


def external_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses (hostname -I), maybe none."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [a for a in out.split() if "." in a and not a.startswith("127.")]


def refused_from(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=2):
            return False
    except OSError:  # refused (nothing listens there) or unreachable
        return True


def test_the_store_listens_on_loopback_only() -> None:
    store = loopback_store(10.0)
    assert listeners(store.port) == ["0100007F"]  # 127.0.0.1, no 0.0.0.0, no ::
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
    client.set("k", "v")
    assert store.get("k") == b"v"
    for addr in external_addresses():
        assert refused_from(addr, store.port), addr


def _probe(_: int) -> tuple[list[str], list[tuple[str, bool]], bool]:
    port = int(os.environ["MASTER_PORT"])
    token = os.environ.get(store_mod.TOKEN_ENV, "")
    return listeners(port), [(a, refused_from(a, port)) for a in external_addresses()], \
        len(token) == 32


def test_the_local_launchers_store_is_loopback_only_and_workers_get_a_secret() -> None:
    result = launch_local(_probe, (0,), 1)
    assert result.exitcode == 0, result.cause
    bound, outside, has_token = result.returns[0]
    assert bound == ["0100007F"]
    assert all(refused for _, refused in outside), outside
    assert has_token


def test_a_forged_heartbeat_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(store_mod.TOKEN_ENV, "job-secret")
    store = dist.HashStore()
    key = beat_key(1)
    store.set(key, seal(key, "5"))
    assert read_beat(store, 1) == 5
    store.set(key, "6")  # what an outsider could write: unsigned
    assert read_beat(store, 1) == 0
    store.set(key, seal(key, "7", token="guessed"))
    assert read_beat(store, 1) == 0
    # the launcher holds the secret without having it in its own environment
    monkeypatch.delenv(store_mod.TOKEN_ENV)
    store.set(key, seal(key, "9", token="job-secret"))
    monitor = BeatMonitor(store, 2, token="job-secret")
    monitor.poll(0.0)
    time.sleep(0.01)
    assert monitor._seen[1][0] == 9
    store.set(key, seal(key, "10", token="other"))  # a faked beat of a frozen rank
    monitor.poll(5.0)
    assert monitor.silences(5.0, [1]) == {1: 5.0}  # still silent: the fake was ignored


def test_forged_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(store_mod.TOKEN_ENV, "job-secret")
    store = dist.HashStore()
    store.set("p/1", '{"pp": "2"}')  # unsigned
    line = _verdict(store, "p", {"pp": "2"}, 2, 1.0)
    assert "not signed" in line and "STP_JOB_TOKEN" in line
    store.set("p/1", seal("p/1", '{"pp": "2"}'))
    assert _verdict(store, "p", {"pp": "2"}, 2, 1.0) == ""
    assert issubclass(SettingsDiffer, ValueError)


def test_seal_round_trip() -> None:
    assert unseal("k", seal("k", "a|b", "t"), "t") == "a|b"
    assert unseal("k", seal("k", "a", "t"), "u") is None
    assert unseal("other", seal("k", "a", "t"), "t") is None
    assert unseal("k", b"\xff\xfe", "t") is None
