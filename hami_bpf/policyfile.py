"""The --policy file: read once at start-up with ownership checks, and again
on SIGHUP off the loop's thread (a file of many rules takes seconds to parse;
the loop keeps handling events under the previous policy meanwhile).
"""
from __future__ import annotations

import os
import stat as stat_
import threading
from typing import Callable

from .config import unsafe_chain
from .limits import Policy, PolicyError, load_policy


class DaemonError(RuntimeError):
    """A start-up failure the CLI prints as one line (exit 2)."""


def read_policy(p: str) -> Policy:
    """The checked and parsed policy file (DaemonError naming what is wrong)."""
    # Whoever can write the file, or any directory above it, can raise
    # their own limit: only root may.
    bad = unsafe_chain(p)
    if bad:
        raise DaemonError(f"--policy {p}: {bad}; a workload must not be able to replace "
                          "the policy")
    try:
        fd = os.open(os.path.realpath(p), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise DaemonError(f"--policy {p}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat_.S_ISREG(st.st_mode):
            raise DaemonError(f"--policy {p}: not a regular file")
        if st.st_uid != 0 or st.st_mode & 0o022:
            raise DaemonError(f"--policy {p}: must be owned by root and not writable by "
                              f"group or others (owner uid {st.st_uid}, mode "
                              f"{st.st_mode & 0o777:o}); a workload must not be able to "
                              "raise its own limit")
        try:
            text = f.read().decode()
        except (OSError, UnicodeDecodeError) as e:
            raise DaemonError(f"--policy {p}: {e}") from None
    try:
        return load_policy(text, p)
    except PolicyError as e:
        raise DaemonError(str(e)) from None


class PolicyFile:
    """The policy in force (``current``, None without --policy) and its reloads.

    ``applied(policy)`` is called on the loop's thread once a reloaded policy
    is in force (the group limits are worked out again from it)."""

    def __init__(self, path: str | None, *, record, counters,
                 applied: Callable[[], None] = lambda: None,
                 read: Callable[[str], Policy] = read_policy):
        self.path = path
        self.current: Policy | None = None
        self._record = record
        self._counters = counters
        self.applied = applied
        self.read = read
        # Set from a signal handler and the reading thread: plain flags.
        self.asked = False
        self._job: threading.Thread | None = None     # reading --policy again
        self._result = None        # (Policy, None) or (None, DaemonError) from it
        self._again = False        # SIGHUP while it read: read once more

    def load(self) -> None:
        if self.path:
            self.current = self.read(self.path)

    def request(self) -> None:
        """SIGHUP: the loop re-reads --policy at its next turn (safe in a
        signal handler)."""
        self.asked = True

    def due(self) -> None:
        """The loop's turn: start or finish a reload if one was asked."""
        if self.asked:
            self.asked = False      # one asked meanwhile reads the same file
            self.reload()

    def reload(self) -> None:
        """Re-read --policy (same ownership and syntax checks as at start) and
        work every group's limits out again from it and its members'
        environments: a policy can now raise a limit as well as lower it,
        members still only lower. A file that fails a check changes nothing.

        Reading and parsing run on a thread: the loop goes on handling events,
        under the previous policy, until the thread has a result, which it
        asks the loop to apply (the loop calls this again)."""
        if not self.path:
            self._record("config", "no_policy")
            return
        job = self._job
        if job is not None and job.is_alive():
            self._again = True     # read the file again once this one is in
            return
        if job is None:
            self._again = False
            path = self.path

            def read():
                try:
                    self._result = (self.read(path), None)
                except DaemonError as e:
                    self._result = (None, e)
                except Exception as e:  # noqa: BLE001 - reported by the loop
                    self._result = (None, DaemonError(f"--policy {path}: {e}"))
                self.asked = True     # the loop applies it at its next turn
            self._result = None
            self._job = threading.Thread(target=read, name="hami-policy", daemon=True)
            self._job.start()
            return
        self._job = None
        new, err = self._result or (None, DaemonError("--policy: not read"))
        self._result = None
        if err is not None:
            self._record("error", "policy_failed", error=str(err))
        else:
            self.current = new
            self._counters["policy_reloads"] += 1
            self.applied()
            self._record("config", "policy_reloaded", policy=str(self.path))
        if self._again:
            self.reload()

    def wait(self, timeout: float) -> None:
        """Until the reading thread is done (tests)."""
        if self._job is not None:
            self._job.join(timeout)
