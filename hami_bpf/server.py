"""Read-only Unix-socket server for snapshots and events, plus its client.

Protocol: the client sends one JSON line, the server answers one JSON line and
closes the connection.

    {"op": "ping"}                 -> {"ok": true, "data": {"version": 1}}
    {"op": "snapshot"}             -> {"ok": true, "data": <Snapshot.to_json()>}
    {"op": "events", "since": N}   -> {"ok": true, "data": {"events": [...], "last": M}}
    anything wrong                 -> {"ok": false, "error": "..."}

No op changes controller state, so the only access control needed is the
socket file's mode: 0600 root by default, 0660 with a group.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import threading
import time
from typing import Any, Callable

from .snapshot import SCHEMA_VERSION, EventRecord, Snapshot

log = logging.getLogger(__name__)

MAX_REQUEST = 4096          # bytes, newline included
REQUEST_TIMEOUT = 2.0       # seconds for the whole request line
SEND_TIMEOUT = 5.0          # a reader this slow loses its reply, nobody else waits
MAX_CLIENTS = 64            # concurrent connections; more get a "busy" reply
MAX_RESPONSE = 64 << 20     # client side guard against a runaway reply

NOT_RUNNING_HINT = "is `hami-bpf run` running?"


class ServerError(Exception):
    """A failure talking to (or starting) the control socket; str() is one line."""


class _RequestError(Exception):
    pass


class SnapshotServer:
    def __init__(self, path: str, get_snapshot: Callable[[], Snapshot],
                 get_events: Callable[[int], list[EventRecord]] | None = None,
                 group: str | None = None) -> None:
        self.path = path
        self._get_snapshot = get_snapshot
        self._get_events = get_events
        self._group = group
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self._ino: tuple[int, int] | None = None

    # -- lifecycle -------------------------------------------------------

    def start(self) -> None:
        gid = self._resolve_group()
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, mode=0o755, exist_ok=True)
        self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # bind() creates the file with 0777 & ~umask; narrowing the umask for
        # the bind means the socket is never reachable by others, not even
        # between bind() and chmod().
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        except OSError as e:
            sock.close()
            raise ServerError(f"cannot bind {self.path}: {e.strerror or e}") from None
        finally:
            os.umask(old)
        try:
            if gid is not None:
                os.chown(self.path, -1, gid)
                os.chmod(self.path, 0o660)
            else:
                os.chmod(self.path, 0o600)
            st = os.stat(self.path)
            self._ino = (st.st_dev, st.st_ino)
            # Clients connect with a timeout, i.e. non-blocking: on a full
            # backlog an AF_UNIX connect fails at once (EAGAIN) instead of
            # waiting, so the backlog must outlast a burst while the accept
            # thread is not scheduled (a loaded host).
            sock.listen(socket.SOMAXCONN)
            sock.settimeout(0.2)  # lets the accept loop notice close()
        except OSError as e:
            sock.close()
            raise ServerError(f"cannot set up {self.path}: {e.strerror or e}") from None
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="hami-bpf-socket",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        # Only remove the file if it is still the socket we created (a newer
        # daemon may have replaced it).
        try:
            st = os.stat(self.path)
            if self._ino == (st.st_dev, st.st_ino):
                os.unlink(self.path)
        except OSError:
            pass

    def __enter__(self) -> "SnapshotServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _resolve_group(self) -> int | None:
        if self._group is None:
            return None
        import grp
        try:
            return grp.getgrnam(self._group).gr_gid
        except KeyError:
            if self._group.isdigit():
                return int(self._group)
            raise ServerError(f"unknown group {self._group!r} for the control socket") from None

    def _remove_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ServerError(f"{self.path} exists and is not a socket; refusing to remove it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(0.5)
        try:
            probe.connect(self.path)
        except OSError:
            os.unlink(self.path)  # nobody listening: left over from a crash
            return
        finally:
            probe.close()
        raise ServerError(f"{self.path} is in use by another process (is another "
                          "`hami-bpf run` running?)")

    # -- serving ---------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("control socket accept failed")
                time.sleep(0.1)
                continue
            if not self._slots.acquire(blocking=False):
                self._reply_and_close(conn, {"ok": False, "error": "server busy, try again"})
                continue
            # One thread per connection: a client that connects and stalls
            # only holds its own thread, for at most REQUEST_TIMEOUT.
            threading.Thread(target=self._serve, args=(conn,), name="hami-bpf-client",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            try:
                req = self._read_request(conn)
                reply = {"ok": True, "data": self._dispatch(req)}
            except _RequestError as e:
                reply = {"ok": False, "error": str(e)}
            except Exception as e:  # a bug in a provider must not kill the server
                log.exception("control socket request failed")
                reply = {"ok": False, "error": f"internal error: {e}"}
            self._reply_and_close(conn, reply)
        finally:
            self._slots.release()

    @staticmethod
    def _reply_and_close(conn: socket.socket, reply: dict) -> None:
        try:
            conn.settimeout(SEND_TIMEOUT)
            conn.sendall(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
        except OSError:
            pass  # client went away or is too slow; nothing to do
        finally:
            conn.close()

    @staticmethod
    def _read_request(conn: socket.socket) -> dict:
        deadline = time.monotonic() + REQUEST_TIMEOUT
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _RequestError("request timed out")
            conn.settimeout(left)
            try:
                chunk = conn.recv(MAX_REQUEST + 1 - len(buf))
            except socket.timeout:
                raise _RequestError("request timed out") from None
            if not chunk:
                break  # EOF without newline: accept what we have
            buf += chunk
            if len(buf) > MAX_REQUEST:
                raise _RequestError(f"request too large (limit {MAX_REQUEST} bytes)")
        line = buf.split(b"\n", 1)[0]
        if len(line) >= MAX_REQUEST:
            raise _RequestError(f"request too large (limit {MAX_REQUEST} bytes)")
        try:
            req = json.loads(line)
        except (UnicodeDecodeError, ValueError):
            raise _RequestError("malformed request: expected one JSON object line") from None
        if not isinstance(req, dict) or not isinstance(req.get("op"), str):
            raise _RequestError('malformed request: expected {"op": "..."}')
        return req

    def _dispatch(self, req: dict) -> Any:
        op = req["op"]
        if op == "ping":
            return {"version": SCHEMA_VERSION}
        if op == "snapshot":
            return self._get_snapshot().to_json()
        if op == "events":
            if self._get_events is None:
                raise _RequestError("events are not available from this daemon")
            since = req.get("since", 0)
            if not isinstance(since, int) or isinstance(since, bool) or since < 0:
                raise _RequestError("events: 'since' must be a non-negative integer")
            events = list(self._get_events(since))
            last = max([since] + [e.seq for e in events])
            return {"events": [e.to_json() for e in events], "last": last}
        raise _RequestError(f"unknown op {op!r} (expected ping, snapshot or events)")


# -- client ---------------------------------------------------------------

def query(path: str, op: str, *, timeout: float = 5.0, **kw: Any) -> Any:
    """Send one request and return its "data"; ServerError with a one-line message."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(path)
        except OSError as e:
            reason = e.strerror or str(e)
            if e.errno in (errno.ENOENT, errno.ECONNREFUSED):
                reason += f" ({NOT_RUNNING_HINT})"
            elif e.errno in (errno.EACCES, errno.EPERM):
                reason += " (run as root, or start the daemon with --socket-group)"
            raise ServerError(f"cannot connect to {path}: {reason}") from None
        try:
            sock.sendall(json.dumps({"op": op, **kw}).encode() + b"\n")
            buf = bytearray()
            while not buf.endswith(b"\n"):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
                if len(buf) > MAX_RESPONSE:
                    raise ServerError(f"reply from {path} is too large")
        except socket.timeout:
            raise ServerError(f"no reply from {path} within {timeout:g}s") from None
        except OSError as e:
            raise ServerError(f"talking to {path}: {e.strerror or e}") from None
    finally:
        sock.close()
    try:
        reply = json.loads(bytes(buf))
    except ValueError:
        raise ServerError(f"malformed reply from {path}") from None
    if not isinstance(reply, dict) or "ok" not in reply:
        raise ServerError(f"malformed reply from {path}")
    if not reply["ok"]:
        raise ServerError(f"daemon: {reply.get('error', 'unknown error')}")
    return reply.get("data")


def fetch_snapshot(path: str, timeout: float = 5.0) -> Snapshot:
    try:
        return Snapshot.from_json(query(path, "snapshot", timeout=timeout))
    except ValueError as e:
        raise ServerError(str(e)) from None


def fetch_events(path: str, since: int = 0, timeout: float = 5.0) -> tuple[list[EventRecord], int]:
    data = query(path, "events", since=since, timeout=timeout)
    try:
        return [EventRecord.from_json(e) for e in data["events"]], int(data["last"])
    except (KeyError, TypeError, ValueError):
        raise ServerError(f"malformed events reply from {path}") from None
