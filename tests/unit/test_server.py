import json
import os
import shutil
import socket
import stat
import tempfile
import threading
import time

import pytest

from hami_bpf.server import MAX_REQUEST, ServerError, SnapshotServer, fetch_events, query
from hami_bpf.snapshot import EventRecord, Snapshot, example_snapshot


@pytest.fixture
def sockdir():
    # Short path: AF_UNIX paths are limited to 108 bytes, pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="hb", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


EVENTS = [EventRecord(10.0 + i, "register", "registered",
                      {"pid": i, "comm": "x", "group": "g", "slot": i}, seq=i + 1) for i in range(5)]


def get_events(since):
    return [e for e in EVENTS if e.seq > since]


@pytest.fixture
def server(sockdir):
    snap = example_snapshot()
    srv = SnapshotServer(os.path.join(sockdir, "s.sock"), lambda: snap, get_events)
    srv.start()
    yield srv
    srv.close()


def raw(path, payload: bytes, timeout=5.0) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    try:
        s.sendall(payload)
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    finally:
        s.close()
    return json.loads(buf)


def test_socket_is_0600(server):
    st = os.stat(server.path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()


def test_socket_group_gives_0660(sockdir):
    gid = os.getegid()
    srv = SnapshotServer(os.path.join(sockdir, "g.sock"), example_snapshot, None, group=str(gid))
    with srv:
        st = os.stat(srv.path)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == gid


def test_unknown_group_is_server_error(sockdir):
    with pytest.raises(ServerError, match="unknown group"):
        SnapshotServer(os.path.join(sockdir, "g.sock"), example_snapshot, None,
                       group="no-such-group-hb").start()


def test_ping_snapshot_events(server):
    assert query(server.path, "ping") == {"version": 1}
    assert Snapshot.from_json(query(server.path, "snapshot")) == example_snapshot()
    evs, last = fetch_events(server.path, since=3)
    assert [e.seq for e in evs] == [4, 5] and last == 5
    evs, last = fetch_events(server.path, since=5)
    assert evs == [] and last == 5


def test_events_unavailable(sockdir):
    with SnapshotServer(os.path.join(sockdir, "n.sock"), example_snapshot, None) as srv:
        with pytest.raises(ServerError, match="events are not available"):
            query(srv.path, "events", since=0)


@pytest.mark.parametrize("payload,msg", [
    (b"not json\n", "malformed request"),
    (b"[1, 2]\n", "malformed request"),
    (b'{"op": 3}\n', "malformed request"),
    (b'{"op": "shutdown"}\n', "unknown op"),
    (b'{"op": "events", "since": -1}\n', "since"),
    (b'{"op": "events", "since": "x"}\n', "since"),
])
def test_bad_requests_get_error_replies(server, payload, msg):
    reply = raw(server.path, payload)
    assert reply["ok"] is False and msg in reply["error"]


def test_oversized_request(server):
    reply = raw(server.path, b'{"op": "ping", "pad": "' + b"x" * (2 * MAX_REQUEST) + b'"}\n')
    assert reply == {"ok": False, "error": f"request too large (limit {MAX_REQUEST} bytes)"}
    assert query(server.path, "ping") == {"version": 1}  # still serving


def test_request_without_newline_at_eof_is_accepted(server):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(server.path)
    s.sendall(b'{"op": "ping"}')
    s.shutdown(socket.SHUT_WR)
    assert json.loads(s.makefile().readline()) == {"ok": True, "data": {"version": 1}}
    s.close()


def test_silent_client_does_not_block_others(server):
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(server.path)  # connects, sends nothing
    try:
        t0 = time.monotonic()
        assert query(server.path, "ping", timeout=1.5) == {"version": 1}
        assert time.monotonic() - t0 < 1.0
        # ... and the idle one is cut off after the request timeout with an error.
        idle.settimeout(5)
        reply = json.loads(idle.makefile().readline())
        assert reply["ok"] is False and "timed out" in reply["error"]
    finally:
        idle.close()


def test_many_concurrent_clients(server):
    results = []

    def worker():
        results.append(query(server.path, "snapshot")["version"])

    threads = [threading.Thread(target=worker) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1] * 20


def test_provider_exception_is_an_error_reply(sockdir):
    def boom():
        raise RuntimeError("kaput")

    with SnapshotServer(os.path.join(sockdir, "b.sock"), boom, None) as srv:
        with pytest.raises(ServerError, match="internal error: kaput"):
            query(srv.path, "snapshot")
        assert query(srv.path, "ping") == {"version": 1}


def test_stale_socket_is_replaced(sockdir):
    path = os.path.join(sockdir, "s.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # file remains, nobody listens
    with SnapshotServer(path, example_snapshot, None) as srv:
        assert query(srv.path, "ping") == {"version": 1}
    assert not os.path.exists(path)  # close() removes its own socket


def test_live_socket_is_not_stolen(server):
    with pytest.raises(ServerError, match="in use"):
        SnapshotServer(server.path, example_snapshot, None).start()
    assert query(server.path, "ping") == {"version": 1}


def test_refuses_to_unlink_non_socket(sockdir):
    path = os.path.join(sockdir, "file")
    open(path, "w").close()
    with pytest.raises(ServerError, match="not a socket"):
        SnapshotServer(path, example_snapshot, None).start()
    assert os.path.isfile(path)


def test_client_errors_are_one_line(sockdir):
    path = os.path.join(sockdir, "missing.sock")
    with pytest.raises(ServerError) as e:
        query(path, "ping")
    assert str(e.value) == (f"cannot connect to {path}: No such file or directory "
                            "(is `hami-bpf run` running?)")
