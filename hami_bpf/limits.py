"""HAMi-compatible limit configuration: environment variables and the policy file.

Pure parsing: callers pass file contents and environments in as strings/dicts.

Environment (what HAMi's device plugin injects into a container)
----------------------------------------------------------------
``CUDA_DEVICE_MEMORY_LIMIT`` / ``CUDA_DEVICE_MEMORY_LIMIT_<i>``
    Memory limit for every device / for the process's visible device ``i``
    (the CUDA ordinal the process sees, not the host's index). Parsed by
    `parse_size`. As in HAMi-core, 0 means "not set": a per-device 0 falls
    back to the default, a default of 0 means unlimited.
``CUDA_DEVICE_SM_LIMIT`` / ``CUDA_DEVICE_SM_LIMIT_<i>``
    Percent of SMs, 0..100; 0 means unlimited (HAMi-core logs "0 means no
    limit" and treats a missing default as 100). Per-device 0 falls back.
``CUDA_DEVICE_MEMORY_SHARED_CACHE``  path of HAMi-core's shared region file.
``GPU_CORE_UTILIZATION_POLICY``  default | force | disable. HAMi-core matches
    only the all-lower or all-upper spelling and silently treats anything else
    as default; we accept any case and report other values.
``CUDA_TASK_PRIORITY``  integer; HAMi-core uses 1 when unset.
``CUDA_VISIBLE_DEVICES``  comma-separated indices or (prefixes of) UUIDs.

Policy file (TOML)
------------------
::

    [default]               # groups that no [[group]] rule matches
    memory = "8Gi"          # every device; or per (host) device index:
                            # memory = { "0" = "8Gi", "1" = "4Gi" }
    sm = 50                 # percent 0..100, 0 = unlimited; optional
    priority = 1            # optional int
    utilization_policy = "default"   # default | force | disable; optional

    [[group]]               # rules are tried in file order; first match wins
    match = "/kubepods/burstable/pod1234*"   # fnmatch against the group name
    memory = "20Gi"
    sm = 30

Sizes are integers (bytes) or strings accepted by `parse_size` (all suffixes
are 1024-based, as in HAMi). A policy memory limit of 0 is rejected rather
than read as "unlimited": leave the key out for that. Unknown keys are errors,
so a typo cannot silently drop a limit.

Precedence (`effective_limits`): a process may lower its group's limit through
its environment but never raise it above the policy. With no policy the
environment applies; with neither, unlimited.

Bounds: every value here comes from a workload, so each is parsed within a
fixed length (`VALUE_MAX` characters for a number, `VISIBLE_MAX` entries of
`CUDA_VISIBLE_DEVICES`, `DEVICE_INDEX_MAX` digits of a device suffix) before
any conversion: Python's int() raises past 4300 digits, and a handler that
raises leaves a process unclassified. Values past a bound are malformed.
"""
from __future__ import annotations

import fnmatch
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

__all__ = [
    "LimitError",
    "PolicyError",
    "parse_size",
    "format_size",
    "EnvLimits",
    "parse_env_limits",
    "visible_to_physical",
    "physical_to_visible",
    "LimitSpec",
    "GroupRule",
    "Policy",
    "load_policy",
    "effective_limits",
    "UTILIZATION_POLICIES",
    "HAMI_DEFAULT_PRIORITY",
]

UTILIZATION_POLICIES = ("default", "force", "disable")
HAMI_DEFAULT_PRIORITY = 1
SIZE_MAX = 2**64 - 1  # HAMi-core stores limits in a size_t

# Longest number (after stripping blanks) read from a workload: 2**64 is 20
# digits, "0x" and 16 hex digits 18, with a "KiB"-style suffix a few more.
VALUE_MAX = 64
DEVICE_INDEX_MAX = 3           # digits of a per-device suffix (_<i>)
VISIBLE_MAX = 64               # CUDA_VISIBLE_DEVICES entries read (a node has at most 16 GPUs)
VISIBLE_ENTRY_MAX = 128        # characters of one entry (a MIG UUID is ~50)
PRIORITY_MAX = 1 << 31         # |CUDA_TASK_PRIORITY|: HAMi-core reads it as a C int
SHOWN_MAX = 64                 # characters of a malformed value quoted in a message

MEM_ENV = "CUDA_DEVICE_MEMORY_LIMIT"
SM_ENV = "CUDA_DEVICE_SM_LIMIT"

_EMPTY: Mapping[int, int] = MappingProxyType({})


class LimitError(ValueError):
    """Malformed size, percentage or environment value."""


def shown(value: str) -> str:
    """A workload's value as quoted in a message: at most SHOWN_MAX characters."""
    if len(value) <= SHOWN_MAX:
        return repr(value)
    return f"{value[:SHOWN_MAX]!r}... ({len(value)} characters)"


def clipped(value: str, limit: int = SHOWN_MAX) -> str:
    """As `shown`, unquoted."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}... ({len(value)} characters)"


class PolicyError(ValueError):
    """Invalid policy file; the message starts with ``source:line:``."""

    def __init__(self, source: str, line: int | None, message: str):
        self.source = source
        self.line = line
        self.reason = message
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {message}")


# ------------------------------------------------------------------ sizes
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_SIZE_RE = re.compile(r"(0[xX][0-9a-fA-F]+|[0-9]+)\s*(?:([kKmMgGtT])(i|iB|B)?)?")


def parse_size(text: str) -> int:
    """Parse a memory size into bytes.

    HAMi-core's rule (get_limit_from_env): a plain number is bytes; a final
    ``k``/``K``, ``m``/``M`` or ``g``/``G`` multiplies by 1024, 1024**2 or
    1024**3; the number is read with C's base auto-detection, so ``0x..`` is
    hexadecimal. HAMi-core is lenient in ways that hide mistakes: it stops at
    the first non-digit (``"12x"`` becomes 12 bytes, ``"8Gi"`` becomes 8
    bytes) and a leading ``0`` switches to octal. We accept the same numbers
    and suffixes, plus the Kubernetes-style ``Ki``/``Mi``/``Gi``/``Ti`` (and
    ``KiB``/``GB``-style spellings, all 1024-based) and ``t``/``T``, and
    reject everything else, including leading-zero numbers whose meaning
    differs between HAMi (octal) and a human (decimal). Surrounding
    whitespace is ignored. 0 is valid here; callers decide what 0 means.
    """
    if not isinstance(text, str):
        raise LimitError(f"size must be a string, not {type(text).__name__}")
    s = text.strip()
    if not s:
        raise LimitError("empty size")
    if len(s) > VALUE_MAX:
        raise LimitError(f"{shown(text)}: longer than {VALUE_MAX} characters, not a size")
    m = _SIZE_RE.fullmatch(s)
    if m is None:
        if s.startswith(("-", "+")):
            raise LimitError(f"{shown(text)}: size must be a non-negative whole number")
        raise LimitError(
            f"{shown(text)}: not a size (expected bytes or a number with k/m/g/t or Ki/Mi/Gi/Ti)")
    digits, unit = m.group(1), (m.group(2) or "").lower()
    if len(digits) > 1 and digits[0] == "0" and digits[1] not in "xX":
        raise LimitError(f"{shown(text)}: leading zero is ambiguous (HAMi-core reads it as octal)")
    value = int(digits, 0) << (10 * _UNITS[unit])
    if value > SIZE_MAX:
        raise LimitError(f"{shown(text)}: larger than 2**64-1 bytes")
    return value


def format_size(n: int) -> str:
    """Shortest exact rendering that `parse_size` reads back, e.g. '8Gi'."""
    if n < 0:
        raise ValueError("negative size")
    for suffix, shift in (("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def _parse_percent(text: str) -> int:
    s = text.strip()
    if len(s) > VALUE_MAX or not s.isdigit() or not s.isascii():
        raise LimitError(f"{shown(text)}: expected a whole percentage 0..100")
    v = int(s)
    if v > 100:
        raise LimitError(f"{shown(text)}: percentage above 100")
    return v


# -------------------------------------------------------------- environment
@dataclass(frozen=True)
class EnvLimits:
    """Limits a process asked for through its environment. Per-device maps are
    keyed by the process's visible device index; entries of 0 are not stored
    (HAMi falls back to the default for them)."""

    memory: int | None = None                      # bytes, every device; None = unlimited
    memory_per_device: Mapping[int, int] = field(default_factory=lambda: _EMPTY)
    sm: int | None = None                          # percent 1..100; None = unlimited
    sm_per_device: Mapping[int, int] = field(default_factory=lambda: _EMPTY)
    shared_cache: str | None = None
    utilization_policy: str = "default"
    priority: int | None = None                    # None: unset (HAMi uses 1)
    visible_devices: tuple[str, ...] | None = None  # None: unset (all visible); (): none

    def memory_limit(self, visible_index: int) -> int | None:
        return self.memory_per_device.get(visible_index, self.memory)

    def sm_limit(self, visible_index: int) -> int | None:
        if self.utilization_policy == "disable":
            return None  # HAMi ignores the core limit under "disable"
        return self.sm_per_device.get(visible_index, self.sm)


_PER_DEVICE_RE = re.compile(r"(0|[1-9][0-9]*)")


@dataclass(frozen=True)
class EnvProblem:
    """One malformed variable of a process environment, ignored. Name and
    value are clipped: a workload chooses them."""
    name: str
    value: str
    reason: str


def parse_env_limits(environ: Mapping[str, str]) -> tuple[EnvLimits, list[EnvProblem]]:
    """Read the HAMi variables from a process environment. Never raises: each
    malformed variable is skipped (its neighbours still apply) and described
    in the returned list."""
    problems: list[EnvProblem] = []

    def bad(name: str, value: str, reason: str) -> None:
        problems.append(EnvProblem(clipped(name), clipped(value), reason))

    def size(name: str) -> int | None:
        value = environ[name]
        try:
            return parse_size(value)
        except LimitError as e:
            bad(name, value, str(e))
            return None

    def percent(name: str) -> int | None:
        value = environ[name]
        try:
            return _parse_percent(value)
        except LimitError as e:
            bad(name, value, str(e))
            return None

    memory = size(MEM_ENV) if MEM_ENV in environ else None
    sm = percent(SM_ENV) if SM_ENV in environ else None
    mem_dev: dict[int, int] = {}
    sm_dev: dict[int, int] = {}
    for name in sorted(environ):
        for prefix, parse, into in ((MEM_ENV + "_", size, mem_dev), (SM_ENV + "_", percent, sm_dev)):
            if not name.startswith(prefix):
                continue
            suffix = name[len(prefix):]
            if len(suffix) > DEVICE_INDEX_MAX or not _PER_DEVICE_RE.fullmatch(suffix):
                bad(name, environ[name], f"{shown(suffix)} is not a device index")
                continue
            v = parse(name)
            if v:  # 0 and malformed both fall back to the default
                into[int(suffix)] = v

    policy = "default"
    raw = environ.get("GPU_CORE_UTILIZATION_POLICY")
    if raw is not None:
        if raw.strip().lower() in UTILIZATION_POLICIES:
            policy = raw.strip().lower()
        else:
            bad("GPU_CORE_UTILIZATION_POLICY", raw, "expected default, force or disable")

    priority = None
    raw = environ.get("CUDA_TASK_PRIORITY")
    if raw is not None:
        s = raw.strip()
        if len(s) <= VALUE_MAX and re.fullmatch(r"[+-]?[0-9]+", s, re.ASCII) and \
                abs(int(s)) < PRIORITY_MAX:
            priority = int(s)
        else:
            bad("CUDA_TASK_PRIORITY", raw, "expected an integer")

    cache = environ.get("CUDA_DEVICE_MEMORY_SHARED_CACHE") or None
    visible = None
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is not None:
        visible = tuple(p.strip() for p in visible_entries(raw))

    return (
        EnvLimits(
            memory=memory or None,
            memory_per_device=MappingProxyType(mem_dev),
            sm=sm or None,
            sm_per_device=MappingProxyType(sm_dev),
            shared_cache=cache,
            utilization_policy=policy,
            priority=priority,
            visible_devices=visible,
        ),
        problems,
    )


def visible_entries(raw: str) -> list[str]:
    """The first VISIBLE_MAX entries of a CUDA_VISIBLE_DEVICES value (the rest
    can name no device: a valid list has no repeats and a node at most 16 GPUs)."""
    if not raw.strip():
        return []
    return raw.split(",", VISIBLE_MAX)[:VISIBLE_MAX]


def _resolve_visible(
    cuda_visible_devices: Sequence[str] | str | None, uuid_to_index: Mapping[str, int]
) -> list[int] | None:
    """Physical indices in visible order, following CUDA's rules: the list is
    cut at the first entry that is invalid, unknown, ambiguous or repeated.
    None means unset (identity mapping)."""
    if cuda_visible_devices is None:
        return None
    if isinstance(cuda_visible_devices, str):
        entries = visible_entries(cuda_visible_devices)
    else:
        entries = list(cuda_visible_devices)[:VISIBLE_MAX]
    known = set(uuid_to_index.values())
    lowered = {u.lower(): i for u, i in uuid_to_index.items()}
    out: list[int] = []
    for raw in entries:
        e = raw.strip()
        idx: int | None = None
        if len(e) > VISIBLE_ENTRY_MAX:
            break                     # names no device: the list ends here, as CUDA's does
        if e.isascii() and e.isdigit():
            idx = int(e)
            if known and idx not in known:
                idx = None
        elif e:
            low = e.lower()
            idx = lowered.get(low)
            if idx is None:
                hits = {i for u, i in lowered.items() if u.startswith(low)}
                idx = hits.pop() if len(hits) == 1 else None
        if idx is None or idx in out:
            break
        out.append(idx)
    return out


def visible_to_physical(
    visible_index: int,
    cuda_visible_devices: Sequence[str] | str | None,
    uuid_to_index: Mapping[str, int],
) -> int | None:
    """Host device index behind a process's CUDA ordinal, or None when that
    ordinal does not exist for the process (or names a MIG instance / unknown
    UUID). `uuid_to_index` maps full GPU UUIDs ("GPU-...") to host indices;
    UUID prefixes are accepted when unique, like CUDA does."""
    if visible_index < 0:
        return None
    order = _resolve_visible(cuda_visible_devices, uuid_to_index)
    if order is None:
        known = set(uuid_to_index.values())
        return visible_index if not known or visible_index in known else None
    return order[visible_index] if visible_index < len(order) else None


def physical_to_visible(
    device: int,
    cuda_visible_devices: Sequence[str] | str | None,
    uuid_to_index: Mapping[str, int],
) -> int | None:
    """Inverse of `visible_to_physical`; None if the process cannot see `device`."""
    order = _resolve_visible(cuda_visible_devices, uuid_to_index)
    if order is None:
        known = set(uuid_to_index.values())
        return device if device >= 0 and (not known or device in known) else None
    return order.index(device) if device in order else None


# ------------------------------------------------------------------- policy
@dataclass(frozen=True)
class LimitSpec:
    memory: int | None = None                      # bytes, every device
    memory_per_device: Mapping[int, int] = field(default_factory=lambda: _EMPTY)  # host index -> bytes
    sm: int | None = None                          # percent 1..100; None = unlimited
    priority: int | None = None
    utilization_policy: str | None = None

    def memory_limit(self, device: int) -> int | None:
        return self.memory_per_device.get(device, self.memory)

    def sm_limit(self) -> int | None:
        return None if self.utilization_policy == "disable" else self.sm


@dataclass(frozen=True)
class GroupRule:
    match: str       # fnmatch pattern (case-sensitive) against the group name
    limits: LimitSpec
    line: int | None = None


@dataclass(frozen=True)
class Policy:
    source: str
    default: LimitSpec | None = None
    rules: tuple[GroupRule, ...] = ()

    def __post_init__(self) -> None:
        # Rules indexed once, so a lookup does not try every rule: literal
        # patterns by name, the others by the literal text before their first
        # wildcard (a group name can only match a pattern whose prefix it
        # starts with). Patterns are compiled at their first use.
        literal: dict[str, int] = {}
        by_prefix: dict[str, list[int]] = {}
        for i, rule in enumerate(self.rules):
            m = _WILDCARD_RE.search(rule.match)
            if m is None:
                literal.setdefault(rule.match, i)
            else:
                by_prefix.setdefault(rule.match[:m.start()], []).append(i)
        object.__setattr__(self, "_literal", literal)
        object.__setattr__(self, "_by_prefix", by_prefix)
        object.__setattr__(self, "_prefix_lengths", sorted({len(p) for p in by_prefix}))
        object.__setattr__(self, "_compiled", {})
        object.__setattr__(self, "_found", {})

    def _matches(self, i: int, group: str) -> bool:
        match = self._compiled.get(i)
        if match is None:
            match = self._compiled[i] = re.compile(fnmatch.translate(self.rules[i].match)).match
        return match(group) is not None

    def limits_for(self, group: str) -> LimitSpec | None:
        """First matching rule (fnmatch, case-sensitive), else [default], else None."""
        found = self._found.get(group)
        if found is None:
            best = self._literal.get(group, len(self.rules))
            for n in self._prefix_lengths:
                if n > len(group):
                    break
                for i in self._by_prefix.get(group[:n], ()):
                    if i >= best:
                        break             # in file order: an earlier match won already
                    if self._matches(i, group):
                        best = i
                        break
            if len(self._found) >= _FOUND_MAX:
                self._found.clear()
            found = self._found[group] = (best,)
        best = found[0]
        return self.rules[best].limits if best < len(self.rules) else self.default


_WILDCARD_RE = re.compile(r"[*?\[]")
_FOUND_MAX = 1 << 16          # group names whose rule a Policy remembers


_TOML_POS_RE = re.compile(r"\(at line (\d+), column (\d+)\)")
_HEADER_RE = re.compile(r"^\s*\[\[?\s*([A-Za-z0-9_\-\"'. ]+?)\s*\]\]?")
_SPEC_KEYS = {"memory", "sm", "priority", "utilization_policy"}


class _Lines:
    """Best-effort line finder for semantic errors: tomllib keeps no positions."""

    def __init__(self, text: str):
        self.lines = text.splitlines()
        # Header lines by table name, found in one pass: looking each rule's
        # header up from the top made loading quadratic in the rules.
        self.headers: dict[str, list[int]] = {}
        for i, line in enumerate(self.lines):
            m = _HEADER_RE.match(line)
            if m:
                self.headers.setdefault(m.group(1).strip("\"'"), []).append(i + 1)

    def table(self, name: str, nth: int = 0) -> int | None:
        found = self.headers.get(name, ())
        return found[nth] if nth < len(found) else None

    def key(self, table_line: int | None, key: str) -> int | None:
        start = table_line or 0  # 1-based header line == 0-based index of next line
        pat = re.compile(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=")
        for i in range(start, len(self.lines)):
            if i > start and _HEADER_RE.match(self.lines[i]):
                break
            if pat.match(self.lines[i]):
                return i + 1
        return table_line


def _policy_size(value: Any) -> int:
    if isinstance(value, bool):
        raise LimitError("expected a size, not a boolean")
    if isinstance(value, int):
        if value < 0 or value > SIZE_MAX:
            raise LimitError(f"{value}: size out of range")
        n = value
    elif isinstance(value, str):
        n = parse_size(value)
    else:
        raise LimitError(f"expected a size (integer bytes or a string like \"8Gi\"), got {value!r}")
    if n == 0:
        raise LimitError("memory limit of 0; omit the key for unlimited")
    return n


def _spec(table: Mapping[str, Any], allowed: set[str], fail: Any) -> LimitSpec:
    for key in table:
        if key not in allowed:
            fail(key, f"unknown key {key!r} (expected one of {', '.join(sorted(allowed))})")
    memory: int | None = None
    per_dev: dict[int, int] = {}
    raw = table.get("memory")
    if isinstance(raw, dict):
        for dev, v in raw.items():
            if not _PER_DEVICE_RE.fullmatch(dev):
                fail("memory", f"memory: {dev!r} is not a device index")
            try:
                per_dev[int(dev)] = _policy_size(v)
            except LimitError as e:
                fail("memory", f"memory[{dev!r}]: {e}")
    elif raw is not None:
        try:
            memory = _policy_size(raw)
        except LimitError as e:
            fail("memory", f"memory: {e}")
    sm = table.get("sm")
    if sm is not None and (isinstance(sm, bool) or not isinstance(sm, int) or not 0 <= sm <= 100):
        fail("sm", f"sm: expected a whole percentage 0..100, got {sm!r}")
    prio = table.get("priority")
    if prio is not None and (isinstance(prio, bool) or not isinstance(prio, int)):
        fail("priority", f"priority: expected an integer, got {prio!r}")
    util = table.get("utilization_policy")
    if util is not None and util not in UTILIZATION_POLICIES:
        fail("utilization_policy", f"utilization_policy: expected one of {', '.join(UTILIZATION_POLICIES)}, got {util!r}")
    return LimitSpec(
        memory=memory,
        memory_per_device=MappingProxyType(per_dev),
        sm=sm or None,  # HAMi: 0 = unlimited
        priority=prio,
        utilization_policy=util,
    )


def load_policy(text: str, source: str) -> Policy:
    """Parse a policy file's text; `source` (usually the path) names it in errors."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = _TOML_POS_RE.search(msg)
        line = int(m.group(1)) if m else None
        if m:
            msg = f"{msg[:m.start()].rstrip()} (column {m.group(2)})"
        raise PolicyError(source, line, f"invalid TOML: {msg}") from None

    lines = _Lines(text)

    def failer(table: str, nth: int = 0):
        header = lines.table(table, nth)

        def fail(key: str | None, message: str) -> None:
            line = lines.key(header, key) if key else header
            raise PolicyError(source, line, message)

        return fail

    for key in doc:
        if key not in ("default", "group"):
            line = lines.table(key) or lines.key(None, key)
            raise PolicyError(source, line, f"unknown top-level key {key!r} (expected [default] or [[group]])")

    default = None
    if "default" in doc:
        if not isinstance(doc["default"], dict):
            raise PolicyError(source, lines.key(None, "default"), "[default] must be a table")
        default = _spec(doc["default"], _SPEC_KEYS, failer("default"))

    rules: list[GroupRule] = []
    groups = doc.get("group", [])
    if not isinstance(groups, list):
        raise PolicyError(source, lines.table("group") or lines.key(None, "group"),
                          "group must be an array of tables: use [[group]]")
    for n, g in enumerate(groups):
        fail = failer("group", n)
        if not isinstance(g, dict):
            fail(None, f"group #{n + 1} must be a table")
        match = g.get("match")
        if not isinstance(match, str) or not match:
            fail("match" if "match" in g else None, f"group #{n + 1}: 'match' must be a non-empty string")
        spec = _spec(g, _SPEC_KEYS | {"match"}, fail)
        rules.append(GroupRule(match=match, limits=spec, line=lines.table("group", n)))
    return Policy(source=source, default=default, rules=tuple(rules))


# --------------------------------------------------------------- precedence
def _lower(policy_value: int | None, env_value: int | None) -> int | None:
    if policy_value is None:
        return env_value
    if env_value is None:
        return policy_value
    return min(policy_value, env_value)


def effective_limits(
    policy: Policy | None,
    group: str,
    env: EnvLimits | None,
    device: int,
    *,
    visible_index: int | None = None,
) -> tuple[int | None, int | None]:
    """(memory bytes, sm percent) for a process of `group` on host `device`;
    None = unlimited. The environment can only lower what the policy grants.
    Env per-device variables are keyed by the process's own CUDA ordinal:
    pass `visible_index` (see `physical_to_visible`) when it differs from
    `device`. "disable" as utilization policy drops that side's SM limit."""
    spec = policy.limits_for(group) if policy is not None else None
    vis = device if visible_index is None else visible_index
    env_mem = env.memory_limit(vis) if env is not None else None
    env_sm = env.sm_limit(vis) if env is not None else None
    pol_mem = spec.memory_limit(device) if spec is not None else None
    pol_sm = spec.sm_limit() if spec is not None else None
    return _lower(pol_mem, env_mem), _lower(pol_sm, env_sm)


def effective_sched(policy: Policy | None, group: str, env: EnvLimits | None) -> tuple[int, str]:
    """(priority, utilization policy) for a process of `group`. Priorities are
    HAMi's: a smaller number is a higher priority (0 high, 1 the default). A
    process can lower its group's priority through CUDA_TASK_PRIORITY, never
    raise it above the policy's; "force" from either side wins over
    "default", so neither can loosen the other."""
    spec = policy.limits_for(group) if policy is not None else None
    prios = [p for p in ((spec.priority if spec else None), (env.priority if env else None))
             if p is not None]
    prio = max(prios) if prios else HAMI_DEFAULT_PRIORITY
    pols = {(spec.utilization_policy if spec else None) or "default",
            (env.utilization_policy if env else None) or "default"}
    return prio, ("force" if "force" in pols else "default")
