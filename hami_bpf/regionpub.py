"""--hami-regions DIR: HAMi's shared-region files, one per group, published
from the daemon's snapshot so HAMi's node monitor keeps working.

The region format is hami_region's; this module owns the directory, the file
of each group, what was last written to each, and the errors already said.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat as st_
import time
from typing import Callable

from . import hami_region as hr


class RegionError(RuntimeError):
    """DIR is unsafe to write to at start-up."""


class RegionPublisher:
    def __init__(self, root: str, *, record: Callable, group_exists: Callable[[str], bool],
                 phys: Callable[[int], list[int] | None], ndev: Callable[[], int],
                 sm_caps: Callable[[str], dict[int, int]], ctx_bytes: Callable[[], int]) -> None:
        self.root = os.path.abspath(root)
        self.record = record
        self._group_exists, self._phys, self._ndev = group_exists, phys, ndev
        self._sm_caps, self._ctx_bytes = sm_caps, ctx_bytes
        self._s = {"files": {}, "last": {}, "errors": set(), "next": 0.0, "checked": False}

    def publish(self, snap, now: float | None) -> bool:
        """Write the regions of `snap`'s groups (at most once a second;
        unchanged ones are not rewritten). False: not due yet, call again."""
        return self._publish(snap, now)

    def gone(self, group: str) -> None:
        """That group was deleted: its file goes now."""
        self._publish(None, None, gone=group)

    def _publish(self, snap, now: float | None, gone: str | None = None) -> bool:
        """--hami-regions DIR: one HAMi shared-region file per group
        (DIR/<pod uid>_<container>/hami-bpf.cache for a pod's container, else
        DIR/<sanitized group name>/hami-bpf.cache), so HAMi's node monitor keeps
        working. At most once a second; unchanged regions are not rewritten.
        ``gone``: that group was deleted, remove its file now. I/O errors are
        recorded (once per path) and never stop the daemon; an unsafe DIR is
        refused at start-up."""
        s = self._s
        root = self.root

        def err(path: str, what: str) -> None:
            if path not in s["errors"]:
                s["errors"].add(path)
                self.record("error", "region_failed", path=path, error=what)

        def remove(group: str) -> None:
            d, f, made = s["files"].pop(group)
            s["last"].pop(f, None)
            try:
                os.unlink(f)
                if made:
                    os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                err(f, f"removing {f}: {e}")

        if gone is not None:
            if gone in s["files"]:
                remove(gone)
            return True
        # The directory must be ours alone: a link or a directory others can
        # write to would let them steer what root writes.
        first = not s["checked"]
        try:
            if first:
                os.makedirs(root, 0o755, exist_ok=True)
            st = os.lstat(root)
            bad = ("is a symbolic link" if st_.S_ISLNK(st.st_mode) else
                   "is not a directory" if not st_.S_ISDIR(st.st_mode) else
                   "is writable by group or others" if st.st_mode & 0o022 else
                   f"is owned by uid {st.st_uid}, not {os.geteuid()}" if st.st_uid != os.geteuid()
                   else None)
        except OSError as e:
            bad = str(e)
        if bad:
            if first:
                raise RegionError(f"--hami-regions {root}: {bad}; refusing to write there")
            err(root, f"{root} {bad}: not publishing")
            return True
        s["checked"] = True
        s["errors"].discard(root)
        if now is not None and now < s["next"]:
            return False
        s["next"] = (now if now is not None else time.monotonic()) + 1.0
        js = snap.to_json()
        by_pid = {p.pid: p for p in snap.processes}
        devinfo = {d.index: d for d in snap.devices}
        ndev = min(self._ndev() or len(devinfo), hr.MAX_DEVICES)
        live = set()
        for g in snap.groups:
            if not self._group_exists(g.id):
                continue    # deleted since the snapshot: its region went with it
            live.add(g.id)
            first_pid = g.slots[0].pid if g.slots else None
            phys = self._phys(first_pid) if first_pid is not None else None
            p0 = by_pid.get(first_pid) if first_pid is not None else None
            lab = dict(p0.labels) if p0 else {}
            if lab.get("pod_uid") and lab.get("container"):
                name = hr.region_dir_name(lab["pod_uid"], lab["container"])
            else:
                name = re.sub(r"[^A-Za-z0-9_.-]", "_", g.id)[:120]
                if name != g.id or name.startswith("."):
                    name = f"{name}-{hashlib.sha1(g.id.encode()).hexdigest()[:8]}"
            if "/" in name or name in (".", ".."):
                name = "group-" + hashlib.sha1(g.id.encode()).hexdigest()[:16]
            d = os.path.join(root, name)
            f = os.path.join(d, "hami-bpf.cache")
            old = s["files"].get(g.id)
            if old and old[1] != f:
                remove(g.id)
                old = None
            visible = [x for x in (phys if phys is not None else range(ndev))][:ndev]
            uuids = [(devinfo[x].uuid if x in devinfo and devinfo[x].uuid else f"hami-bpf-dev{x}")
                     for x in visible]
            caps = self._sm_caps(g.id)
            try:
                region = hr.region_from_snapshot(js, g.id, uuids, visible,
                                                 context_bytes=self._ctx_bytes(),
                                                 sm_limits=[caps.get(x, 0) for x in visible])
                if old is None:
                    made = not os.path.isdir(d)
                    if made:
                        os.mkdir(d, 0o755)
                    s["files"][g.id] = (d, f, made)
                elif not os.path.isdir(d):     # removed under us (HAMi's monitor cleans up)
                    os.mkdir(d, 0o755)
                if s["last"].get(f) == region and os.path.exists(f):
                    continue
                s["last"].pop(f, None)
                hr.publish_region(f, region)
                s["last"][f] = region
                s["errors"].discard(f)
            except (OSError, ValueError) as e:
                err(f, f"group {g.id!r}: writing {f}: {e}")
        for group in [x for x in s["files"] if x not in live]:
            remove(group)
        return True

