"""Every type of event the controller records, in one table: its kind, its
name within the kind (``what``), the payload fields it requires, and how its
human line is made from that payload.

Records carry only the payload; the line is rendered where people read it
(the daemon's log, the socket's JSON, the CLI), so nothing depends on the
English and tests assert on fields. :func:`render` never raises: a payload it
cannot render gives a line naming the type and the raw payload.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Callable, Mapping, Union


class Kind(str, enum.Enum):
    """Every kind of record the controller writes, and who writes it."""
    REGISTER = "register"          # registry: a process joined a group (pid, group, slot)
    EXEC = "exec"                  # registry: a process replaced its image (pid, group)
    COMPACT = "compact"            # registry: a slot freed, the last one moved (group, removed, moves)
    GROUP = "group"                # registry: an empty group deleted (group)
    RECONCILE = "reconcile"        # registry: usage corrected from the kernel (pid, before, after)
    LIMIT = "limit"                # grouplimits: a memory limit, priority or SM cap (group, device, limit)
    DENY = "deny"                  # memory: an allocation refused (pid, group, device, size)
    DENY_IGNORED = "deny_ignored"  # registry: a refused allocation returned success
    THROTTLE = "throttle"          # smcontrol: SM-cap holds and their corrections
    PROBES = "probes"              # libwatch: libraries attached and detached
    ADOPT = "adopt"                # startup: a predecessor's maps taken over
    RECOVER = "recover"            # startup: stops a previous run left, finished
    STATE = "state"                # startup: kept state discarded or waited for
    CONFIG = "config"              # policy, registration: configuration read and problems in it
    FALLBACK = "fallback"          # any: a mechanism unavailable, what is used instead
    ERROR = "error"                # any: something failed; what still holds


# A str.format template over the payload, or a function of it.
Text = Union[str, Callable[[Mapping], str]]


@dataclass(frozen=True)
class EventType:
    kind: Kind
    what: str
    fields: tuple[str, ...]      # required in the payload (others may be added)
    text: Text


# -- renderers too involved for a template -------------------------------------

_DENY_FIELDS = ("pid", "group", "device", "size", "limit", "paced", "action")


def _denied(then: str) -> Callable[[Mapping], str]:
    def text(d: Mapping) -> str:
        return (f"denied pid {d['pid']} group {d['group']!r} device {d['device']}: request "
                f"{d['size']} bytes over limit {d['limit']} bytes"
                + (" (paced)" if d["paced"] else "") + ": " + then.format_map(d))
    return text


def _overlap_reading(d: Mapping) -> str:
    busy, waited = d.get("gpu_busy"), d.get("waited")
    parts = ([f"its device {busy:.0f}% busy per second it ran, theirs included"]
             if busy is not None else []) + \
        ([f"{waited:.0%} of its running time in synchronize calls"] if waited is not None else [])
    return f" ({'; '.join(parts)})" if parts else ""


def _learned(d: Mapping) -> str:
    extra = "".join([", contended" if d["contended"] else "",
                     ", launcher-bound" if d["launcher_bound"] else "",
                     f", host-bound: +{d['probe_share']:.1%} for the probe"
                     if d["probe_share"] else "",
                     ", from completions" if d["by_completion"] else ""])
    return (f"group {d['group']!r} device {d['device']}: cap {d['cap']}% of a learned full "
            f"rate of {d['full_rate']:.4g} units/s (pace {d['pace']:.4g}/s{extra})")


def _names(names) -> str:
    return ", ".join(repr(n) for n in names)


def _group(d: Mapping) -> str:
    """A group's name, its index where it has none any more."""
    return repr(d["group"]) if d["group"] is not None else str(d["group_index"])


def _alone_done(d: Mapping) -> str:
    how = {"learned": "learned its rate",
           "not_learned": f"not learned in {d['learn_s']:g} s (it learns beside them)",
           "stopped": "stopped launching"}[d["outcome"]]
    return f"group {_group(d)} device {d['device']}: {how}; {_names(d['released'])} released"


def _turns(d: Mapping) -> str:
    if not d["turns"]:
        return f"device {d['device']}: no turns"
    return (f"device {d['device']}: groups "
            + ", ".join(f"{n!r} ({share:.0%})" for n, share in d["turns"].items())
            + f" take turns every {d['period_ms']:g} ms")


def _turns_rescaled(d: Mapping) -> str:
    said = ", ".join(f"{n!r} x{g:.3f}" for n, g in d["gains"].items() if g != 1.0)
    how = (f"rates learned side by side were short, raised: {said}"
           if max(d["gains"].values()) > 1.0 else f"raised rates overran their turns, lowered: {said}")
    return f"device {d['device']}: {d['util']:.1f}% busy in turns that should fill {d['target']:.0f}%: {how}"


def _compact(d: Mapping) -> str:
    moves = ", ".join(f"pid {m['pid']} slot {m['from']}->{m['to']}" for m in d["moves"])
    return f"group {d['group']!r}: pid {d['removed']} left; " + (moves or "no move needed")


def _memory_limit(d: Mapping) -> str:
    limit = "no memory limit" if d["limit"] is None else f"limit {d['limit']} bytes"
    return f"group {d['group']!r} device {d['device']}: {limit}"


def _given_back(d: Mapping) -> str:
    head = f"group {d['group']!r} device {d['device']}: "
    spare = d.get("spare_pct")     # beside other groups: the time no cap claims
    if d["stop_share"] > 0:
        return head + (
            f"launch-bound (its GPU idle by the time it synchronizes): runs "
            f"{d['stop_share']:.0%} of its running time more for what being held costs it"
            + (f", out of the {spare:.0f}% of its device's time that no cap beside it claims"
               if spare is not None else ""))
    if d["stop_share"] < 0:
        return head + (f"runs {-d['stop_share']:.0%} of its running time less: measured, it "
                       "does more per second of running paced than free")
    why = ("beside another group, where no cap leaves time unclaimed" if spare is not None
           else "no longer launch-bound, or not alone")
    if d.get("gpu_busy") is not None:
        why += f" (its GPU busy {d['gpu_busy']:.0f}% of its running time)"
    return head + why + ": held for its cap alone"


def _sm_cap(d: Mapping) -> str:
    cap = "no SM cap" if d["sm"] is None else f"SM cap {d['sm']}%"
    return f"group {d['group']!r} device {d['device']}: {cap}"


_STOP_REWRITE_REFUSED = ("stop-rewrite refused for {symbol} in {lib}: {reason}; a denied call "
                         "there is let through and counted")
_NOT_ATTACHING = "not attaching to {lib_ref}, mapped by pid {pid}: {reason}"

K = Kind
TYPES: tuple[EventType, ...] = (
    # registry
    EventType(K.REGISTER, "registered", ("pid", "comm", "group", "slot"),
              "pid {pid} ({comm}) registered in group {group!r} slot {slot}"),
    EventType(K.EXEC, "replaced", ("pid", "comm", "group"),
              "pid {pid} ({comm}) replaced its image: released from group {group!r}"),
    EventType(K.COMPACT, "compacted", ("group", "removed", "moves"), _compact),
    EventType(K.GROUP, "deleted", ("group",), "group {group!r} is empty: deleted"),
    EventType(K.RECONCILE, "corrected", ("pid", "group", "before", "after"),
              "pid {pid}: usage {before} corrected to {after} from the kernel's counters "
              "(an allocation or free event was lost)"),
    EventType(K.DENY_IGNORED, "charged", ("pid", "group", "device", "size"),
              "pid {pid}: a refused allocation of {size} bytes on device {device} returned "
              "success (resumed before its answer, or the kernel did not take the refusal); "
              "charged to its group"),
    EventType(K.CONFIG, "env_ignored", ("pid", "variable", "value", "reason"),
              "pid {pid}: {variable}={value}: {reason} (ignored)"),
    EventType(K.CONFIG, "env_ignored_more", ("pid", "count"),
              "pid {pid}: {count} more malformed variables (ignored)"),
    EventType(K.CONFIG, "env_cut", ("pid", "limit"),
              "pid {pid}: environment longer than {limit} bytes: read up to there"),
    EventType(K.ERROR, "classify_failed", ("pid", "group", "classify_failed", "reasons"),
              lambda d: f"pid {d['pid']}: classifying it failed ({'; '.join(d['reasons'])}); "
                        f"tracked in group {d['group']!r} with the policy's limits only"),
    EventType(K.ERROR, "limits_failed", ("pid", "group", "classify_failed", "error"),
              "pid {pid}: applying its limits failed ({error}); the policy's limits apply"),
    # grouplimits, smcontrol
    EventType(K.LIMIT, "sched", ("group", "priority", "utilization_policy"),
              "group {group!r}: priority {priority}, utilization policy {utilization_policy}"),
    EventType(K.LIMIT, "memory", ("group", "device", "limit"), _memory_limit),
    EventType(K.LIMIT, "unseen", ("pid", "group", "device", "held", "charged", "unseen"),
              "pid {pid} (group {group!r}) holds {held} bytes on device {device} by the "
              "driver's count, {charged} charged: {unseen} bytes no probed call sized count "
              "against its group's limit"),
    EventType(K.LIMIT, "sm_cap", ("group", "device", "sm"), _sm_cap),
    EventType(K.CONFIG, "sm_unenforced", ("group", "sm"),
              "group {group!r} asks for an SM cap of {sm}%: not enforced (the daemon runs "
              "with --no-sm-limits)"),
    EventType(K.ERROR, "sm_failed", ("error", "detail"),
              "SM pacing failed ({error}: {detail}); every hold released"),
    EventType(K.PROBES, "launch_attached", ("probes",), "launch probes attached ({probes})"),
    EventType(K.PROBES, "launch_detached", (), "launch probes detached: no SM cap left"),
    EventType(K.THROTTLE, "learned",
              ("group", "device", "cap", "full_rate", "pace", "work_per_unit", "contended",
               "launcher_bound", "probe_share", "by_completion", "queued"), _learned),
    EventType(K.THROTTLE, "learn_restarted", ("group", "device", "sm_correction", "idle_s"),
              "group {group!r} device {device}: nothing launched or in flight for "
              "{idle_s:g} s while it learned its rate: learning starts over "
              "({sm_correction})"),
    EventType(K.THROTTLE, "lending", ("group", "device", "lending"),
              lambda d: f"group {d['group']!r} device {d['device']}: " + (
                  "may use what is idle (no busy group of higher or equal priority)"
                  if d["lending"] else "held to its cap again")),
    EventType(K.THROTTLE, "corrected",
              ("group", "device", "sm_correction", "gain", "util", "target", "cap", "source",
               "rate"),
              lambda d: f"group {d['group']!r} device {d['device']}: device {d['util']:.0f}% "
              f"busy where its cap of {d['cap']:g}% allows {d['target']:.0f}%, " + (
                  "while its launch budget no longer held it, re-based on what it launched"
                  if d["sm_correction"] == "runs_free" else "while the launch budget held it")
              + f": rate x{d['gain']:.3g} ({d['sm_correction']}, from {d['source']})"),
    EventType(K.THROTTLE, "resampled",
              ("group", "device", "free_rate", "full_rate", "gain", "owed_s"),
              lambda d: f"group {d['group']!r} device {d['device']}: ran free for a sample at "
              f"{d['free_rate']:.3g} units/s against a full rate of {d['full_rate']:.3g}: " + (
                  f"rate x{d['gain']:.3g} (free_sample)" if d["gain"] != 1 else "rate kept")
              + f"; {d['owed_s']:.2f} s of its budget repays the sample"),
    EventType(K.THROTTLE, "mode", ("group", "device", "sm_mode"),
              lambda d: f"group {d['group']!r} device {d['device']}: paced by " + (
                  "time, held at its launches, beside a group paced by time"
                  if d["sm_mode"] == "duty" and d.get("beside") else
                  "time, held at its synchronizes" if d["sm_mode"] == "duty"
                  else "its launch budget (it synchronizes rarely)")),
    EventType(K.THROTTLE, "slices", ("group", "device", "host_paced", "hold_ms"),
              lambda d: f"group {d['group']!r} device {d['device']}: " + (
                  f"its launching thread sets its pace: held {d['hold_ms']} ms at a time, "
                  "less often (such a loop runs slower for a while after each stop)"
                  if d["host_paced"] else
                  f"it waits for the GPU: held {d['hold_ms']} ms at a time again")),
    EventType(K.THROTTLE, "given_back", ("group", "device", "stop_share"), _given_back),
    EventType(K.THROTTLE, "overlap", ("group", "device", "overlap"),
              lambda d: f"group {d['group']!r} device {d['device']}: " + (
                  "launch-bound beside launch-bound groups only: runs beside them, without "
                  "turns, and is given back what being held costs it" if d["overlap"] else
                  "takes turns with the groups beside it again") + _overlap_reading(d)),
    EventType(K.THROTTLE, "speed",
              ("group", "device", "free_hz", "paced_hz", "ratio", "speed", "run_pct"),
              lambda d: f"group {d['group']!r} device {d['device']}: paced, it launches "
                        f"{d['paced_hz']:.0f}/s of running against {d['free_hz']:.0f}/s free "
                        f"({d['ratio']:.0%}); at a speed of {d['speed']:.0%} it runs "
                        f"{d['run_pct']:.1f}% of the time"),
    EventType(K.THROTTLE, "speed_forgotten", ("group", "device", "paced_hz", "was_hz"),
              lambda d: f"group {d['group']!r} device {d['device']}: paced, it launches "
                        f"{d['paced_hz']:.0f}/s of running, {d['was_hz']:.0f}/s when its speed "
                        "was measured: another phase, whose speed is not known yet (the first "
                        "guess until its next sample)"),
    EventType(K.THROTTLE, "alone_done",
              ("group", "group_index", "device", "alone", "outcome", "learn_s", "released"),
              _alone_done),
    EventType(K.THROTTLE, "alone_learning",
              ("group", "group_index", "device", "alone", "held", "learn_s"),
              lambda d: f"group {_group(d)} learns its rate on device {d['device']} alone: "
                        f"{_names(d['held'])} held (at most {d['learn_s']:g} s)"),
    EventType(K.THROTTLE, "turns", ("device", "turns", "period_ms"), _turns),
    EventType(K.THROTTLE, "turns_rescaled", ("device", "gains", "util", "target"),
              _turns_rescaled),
    EventType(K.THROTTLE, "turns_idle", ("device", "sm_correction", "util", "target", "off_s"),
              "device {device}: {util:.1f}% busy in turns that should fill {target:.0f}%: "
              "no turns there for {off_s:g} s"),
    # memory
    EventType(K.DENY, "killed", _DENY_FIELDS, _denied("killed (SIGKILL)")),
    EventType(K.DENY, "oom_in_kernel", _DENY_FIELDS,
              _denied("returned CUDA_ERROR_OUT_OF_MEMORY in the kernel")),
    EventType(K.DENY, "oom_rewritten", _DENY_FIELDS + ("took_ms",),
              _denied("returned CUDA_ERROR_OUT_OF_MEMORY ({took_ms:.2f} ms)")),
    EventType(K.DENY, "allowed", _DENY_FIELDS + ("reason",), _denied("allowed ({reason})")),
    EventType(K.FALLBACK, "let_through", _DENY_FIELDS + ("reason",),
              _denied("stop-rewrite refused ({reason}); call let through")),
    EventType(K.ERROR, "stop_rewrite_failed", _DENY_FIELDS[:-1] + ("error",),
              _denied("stop-rewrite failed: {error}")),
    EventType(K.ERROR, "meminfo_failed", ("pid", "error"),
              "rewriting memory info of pid {pid}: {error}"),
    # libwatch
    EventType(K.ERROR, "lib_probe_failed", ("pid", "error"),
              "pid {pid}: probing the driver library it opened: {error}"),
    EventType(K.FALLBACK, "stop_rewrite_refused", ("symbol", "lib", "reason"),
              _STOP_REWRITE_REFUSED),
    EventType(K.PROBES, "attached", ("pid", "lib", "lib_ref", "probes", "through"),
              "attached {probes} probes to {lib_ref}, mapped by pid {pid} (through {through})"),
    EventType(K.ERROR, "not_attached", ("pid", "lib", "lib_ref", "reason"), _NOT_ATTACHING),
    EventType(K.CONFIG, "not_attached", ("pid", "lib", "lib_ref", "reason"), _NOT_ATTACHING),
    EventType(K.PROBES, "detaching", ("lib", "lib_ref", "idle_s"),
              "detaching from {lib_ref}: no process used it for {idle_s:g} s"),
    # policyfile, regionpub
    EventType(K.CONFIG, "no_policy", (), "SIGHUP: no --policy to reload"),
    EventType(K.CONFIG, "policy_reloaded", ("policy",), "policy {policy} reloaded"),
    EventType(K.ERROR, "policy_failed", ("error",),
              "reloading policy: {error}; the previous policy stays in force"),
    EventType(K.ERROR, "region_failed", ("path", "error"), "--hami-regions: {error}"),
    # startup
    EventType(K.CONFIG, "nice", ("nice", "error"),
              "could not raise the daemon's CPU priority to nice {nice} ({error}): holds may "
              "outlast their time on a busy node"),
    EventType(K.ERROR, "state_write_failed", ("path", "errno", "state_write_failed", "detail"),
              "state directory: {detail}; stopped processes are recorded in memory only until "
              "writing works again (limits still apply)"),
    EventType(K.RECOVER, "left_stopped", ("pid", "stop"),
              "pid {pid} left stopped by a previous run: {stop}"),
    EventType(K.FALLBACK, "state_in_process", ("pin_dir", "error"),
              "keeping the accounting across restarts: {error}; a restart will start from zero"),
    EventType(K.STATE, "fresh", ("pin_dir",), "--fresh: kept state under {pin_dir} discarded"),
    EventType(K.STATE, "waiting", ("pids",),
              lambda d: "waiting for the previous daemon's probes to close (pid "
                        + ", ".join(str(p) for p in d["pids"]) + ")"),
    EventType(K.FALLBACK, "open_gate", ("reason",),
              "the open gate: {reason}; private libcuda copies are found by scanning /proc"),
    EventType(K.ADOPT, "adopted",
              ("adopted", "adopted_bytes", "exited", "released_bytes", "reservations", "moved",
               "threads_forgotten", "version", "previous_version"),
              "adopted {adopted} processes holding {adopted_bytes} bytes from the kept maps; "
              "{exited} exited meanwhile ({released_bytes} bytes back to their groups), "
              "{reservations} reservations given back, {moved} moved to another group"),
    EventType(K.FALLBACK, "probe_cost", ("lib", "error"),
              "measuring the launch probe's cost on {lib}: {error}; host-bound launchers will "
              "run a little under their caps"),
    EventType(K.RECOVER, "hold_released", ("pid", "symbol"),
              "pid {pid}: released from a hold at {symbol} left by a previous run"),
    EventType(K.RECOVER, "denial_finished", ("pid", "symbol"),
              "pid {pid}: {symbol} denied by a previous run: returned CUDA_ERROR_OUT_OF_MEMORY"),
    EventType(K.ERROR, "denial_unfinished", ("pid", "error"),
              "pid {pid}: finishing a denial left by a previous run: {error}"),
)

BY_KEY: dict[tuple[str, str], EventType] = {(t.kind.value, t.what): t for t in TYPES}
assert len(BY_KEY) == len(TYPES), "an event type is declared twice"


def check(kind: str | Kind, what: str, data: Mapping) -> EventType:
    """The declared type of a record; ValueError for an undeclared kind or type,
    or a payload without one of its fields."""
    k = Kind(kind)
    t = BY_KEY.get((k.value, what))
    if t is None:
        raise ValueError(f"undeclared event type {k.value}/{what}")
    missing = [f for f in t.fields if f not in data]
    if missing:
        raise ValueError(f"event {k.value}/{what} lacks {', '.join(missing)}")
    return t


def render(kind: str, what: str, data: Mapping) -> str:
    """The human line of a record. Never raises: a type this version does not
    know, or a payload its text cannot use, gives a line saying so with the payload."""
    try:
        t = check(kind, what, data)
        return t.text.format_map(data) if isinstance(t.text, str) else t.text(data)
    except Exception as e:  # noqa: BLE001 - a display must show something for any record
        try:
            raw = json.dumps(dict(data), sort_keys=True, default=str)
        except Exception:  # noqa: BLE001
            raw = repr(data)
        return f"{kind}/{what}: cannot render ({type(e).__name__}: {e}): {raw}"
