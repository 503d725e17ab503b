"""HAMi-compatible limits: size parsing, environment, policy file, precedence."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hami_bpf.limits import (
    EnvLimits,
    LimitError,
    Policy,
    PolicyError,
    effective_limits,
    format_size,
    load_policy,
    parse_env_limits,
    parse_size,
    physical_to_visible,
    visible_to_physical,
)

settings.register_profile(
    "hami-limits",
    max_examples=int(os.environ.get("HAMI_HYPOTHESIS_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = settings.get_profile("hami-limits")

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


# ------------------------------------------------------------ parse_size
@pytest.mark.parametrize("text,expected", [
    ("0", 0), ("1", 1), ("4096", 4096),            # plain number = bytes (HAMi)
    ("1k", KiB), ("1K", KiB), ("300m", 300 * MiB), ("300M", 300 * MiB),
    ("8g", 8 * GiB), ("8G", 8 * GiB), ("2t", 2 * TiB),
    ("8Gi", 8 * GiB), ("512Mi", 512 * MiB), ("4Ki", 4 * KiB), ("1Ti", TiB),
    ("8GiB", 8 * GiB), ("8GB", 8 * GiB), (" 20Gi ", 20 * GiB), ("1 G", GiB),
    ("0x10", 16), ("0x1g", GiB),                   # HAMi reads with base auto-detect
])
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", [
    "", "   ", "12x", "-1", "+1", "1.5g", "g", "8 Gi x", "0x", "1e9", "08", "012g",
    "1kk", "١٢", str(2**64), "16777216t",
])
def test_parse_size_rejects(text):
    with pytest.raises(LimitError):
        parse_size(text)


def test_parse_size_messages_are_clear():
    with pytest.raises(LimitError, match="12x"):
        parse_size("12x")
    with pytest.raises(LimitError, match="empty"):
        parse_size("")
    with pytest.raises(LimitError, match="non-negative"):
        parse_size("-1")
    assert issubclass(LimitError, ValueError)


@PROFILE
@given(n=st.integers(min_value=0, max_value=2**64 - 1))
def test_format_parse_round_trip(n):
    assert parse_size(format_size(n)) == n
    assert parse_size(str(n)) == n


@PROFILE
@given(n=st.integers(min_value=0, max_value=2**20),
       unit=st.sampled_from([("k", 10), ("K", 10), ("Ki", 10), ("m", 20), ("M", 20), ("Mi", 20),
                             ("g", 30), ("G", 30), ("Gi", 30), ("t", 40), ("Ti", 40)]))
def test_suffix_round_trip(n, unit):
    suffix, shift = unit
    assert parse_size(f"{n}{suffix}") == n << shift


@PROFILE
@given(text=st.text(max_size=12))
def test_parse_size_only_raises_limit_error(text):
    try:
        v = parse_size(text)
    except LimitError:
        return
    assert 0 <= v <= 2**64 - 1


# ------------------------------------------------------------ environment
def test_env_limits_full():
    env, problems = parse_env_limits({
        "CUDA_DEVICE_MEMORY_LIMIT": "4g",
        "CUDA_DEVICE_MEMORY_LIMIT_1": "2048m",
        "CUDA_DEVICE_SM_LIMIT": "30",
        "CUDA_DEVICE_SM_LIMIT_0": "50",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/usr/local/vgpu/x.cache",
        "GPU_CORE_UTILIZATION_POLICY": "FORCE",
        "CUDA_TASK_PRIORITY": "0",
        "CUDA_VISIBLE_DEVICES": "1, GPU-abc",
        "PATH": "/usr/bin",
    })
    assert problems == []
    assert env.memory == 4 * GiB and dict(env.memory_per_device) == {1: 2 * GiB}
    assert env.memory_limit(0) == 4 * GiB and env.memory_limit(1) == 2 * GiB
    assert env.sm == 30 and env.sm_limit(0) == 50 and env.sm_limit(1) == 30
    assert env.shared_cache == "/usr/local/vgpu/x.cache"
    assert env.utilization_policy == "force"
    assert env.priority == 0
    assert env.visible_devices == ("1", "GPU-abc")


def test_env_empty_is_unlimited():
    env, problems = parse_env_limits({})
    assert problems == [] and env == EnvLimits()
    assert env.memory_limit(0) is None and env.sm_limit(0) is None and env.visible_devices is None


def test_env_zero_means_unset_like_hami():
    env, problems = parse_env_limits({
        "CUDA_DEVICE_MEMORY_LIMIT": "0", "CUDA_DEVICE_SM_LIMIT": "0",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "1g", "CUDA_DEVICE_MEMORY_LIMIT_1": "0",
    })
    assert problems == []
    assert env.memory is None and env.sm is None
    assert env.memory_limit(0) == GiB and env.memory_limit(1) is None


def test_env_per_device_zero_falls_back_to_default():
    env, _ = parse_env_limits({"CUDA_DEVICE_MEMORY_LIMIT": "2g", "CUDA_DEVICE_MEMORY_LIMIT_0": "0",
                               "CUDA_DEVICE_SM_LIMIT": "40", "CUDA_DEVICE_SM_LIMIT_0": "0"})
    assert env.memory_limit(0) == 2 * GiB and env.sm_limit(0) == 40


def test_env_malformed_is_reported_and_never_lifts_another():
    env, problems = parse_env_limits({
        "CUDA_DEVICE_MEMORY_LIMIT": "2g",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "12x",      # bad: device 0 keeps the 2g default
        "CUDA_DEVICE_MEMORY_LIMIT_x": "1g",       # bad index
        "CUDA_DEVICE_SM_LIMIT": "150",            # bad: no SM default
        "CUDA_DEVICE_SM_LIMIT_1": "20",
        "GPU_CORE_UTILIZATION_POLICY": "sometimes",
        "CUDA_TASK_PRIORITY": "high",
    })
    assert env.memory_limit(0) == 2 * GiB
    assert env.sm is None and env.sm_limit(1) == 20
    assert env.utilization_policy == "default" and env.priority is None
    names = sorted(p.name for p in problems)
    assert names == ["CUDA_DEVICE_MEMORY_LIMIT_0", "CUDA_DEVICE_MEMORY_LIMIT_x", "CUDA_DEVICE_SM_LIMIT",
                     "CUDA_TASK_PRIORITY", "GPU_CORE_UTILIZATION_POLICY"]
    assert any((p.name, p.value) == ("CUDA_DEVICE_MEMORY_LIMIT_0", "12x") for p in problems)


def test_env_malformed_default_leaves_per_device():
    env, problems = parse_env_limits({"CUDA_DEVICE_MEMORY_LIMIT": "-1", "CUDA_DEVICE_MEMORY_LIMIT_1": "1g"})
    assert [(p.name, p.value) for p in problems] == [("CUDA_DEVICE_MEMORY_LIMIT", "-1")]
    assert env.memory_limit(0) is None and env.memory_limit(1) == GiB


def test_env_disable_drops_sm_limit():
    env, _ = parse_env_limits({"CUDA_DEVICE_SM_LIMIT": "30", "GPU_CORE_UTILIZATION_POLICY": "disable"})
    assert env.sm_limit(0) is None


@PROFILE
@given(environ=st.dictionaries(
    st.sampled_from(["CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_LIMIT_0", "CUDA_DEVICE_MEMORY_LIMIT_01",
                     "CUDA_DEVICE_SM_LIMIT", "CUDA_DEVICE_SM_LIMIT_3", "CUDA_TASK_PRIORITY",
                     "GPU_CORE_UTILIZATION_POLICY", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MEMORY_SHARED_CACHE"]),
    st.text(max_size=8)))
def test_parse_env_never_raises(environ):
    env, problems = parse_env_limits(environ)
    assert all(p.name in environ and p.reason for p in problems)
    assert env.sm is None or 1 <= env.sm <= 100


# -------------------------------------------------------- device mapping
UUIDS = {"GPU-aaaa-1111": 0, "GPU-bbbb-2222": 1, "GPU-abcd-3333": 2, "GPU-cccc-4444": 3}


@pytest.mark.parametrize("cvd,visible,expected", [
    (None, 2, 2), (None, 7, None),
    ("2,0", 0, 2), ("2,0", 1, 0), ("2,0", 2, None),
    (["3"], 0, 3),
    ("GPU-bbbb-2222,0", 0, 1), ("gpu-BBBB-2222", 0, 1),
    ("GPU-c", 0, 3),            # unique prefix
    ("GPU-a,1", 0, None),       # ambiguous prefix stops the list
    ("1,9,2", 1, None),         # unknown index stops the list
    ("1,1", 1, None),           # duplicate stops the list
    ("MIG-xyz", 0, None), ("", 0, None), ("0", -1, None),
])
def test_visible_to_physical(cvd, visible, expected):
    assert visible_to_physical(visible, cvd, UUIDS) == expected


def test_visible_to_physical_without_uuid_table():
    assert visible_to_physical(5, None, {}) == 5
    assert visible_to_physical(1, "4,6", {}) == 6


def test_physical_to_visible_inverts():
    for cvd in (None, "2,0", "GPU-cccc-4444,1"):
        for phys in range(4):
            vis = physical_to_visible(phys, cvd, UUIDS)
            if vis is not None:
                assert visible_to_physical(vis, cvd, UUIDS) == phys
    assert physical_to_visible(1, "2,0", UUIDS) is None


# ----------------------------------------------------------------- policy
POLICY = """\
# site policy
[default]
memory = "8Gi"
sm = 50
priority = 1
utilization_policy = "default"

[[group]]
match = "/kubepods/burstable/pod1234*"
memory = "20Gi"
sm = 30

[[group]]
match = "/kubepods/*"
memory = { "0" = "8Gi", "1" = 4294967296 }
"""


def test_load_policy_example():
    p = load_policy(POLICY, "policy.toml")
    assert p.source == "policy.toml"
    assert p.default.memory == 8 * GiB and p.default.sm == 50 and p.default.priority == 1
    assert [r.match for r in p.rules] == ["/kubepods/burstable/pod1234*", "/kubepods/*"]
    assert [r.line for r in p.rules] == [8, 13]
    first = p.limits_for("/kubepods/burstable/pod1234-abc/ctr")
    assert first.memory == 20 * GiB and first.sm == 30
    second = p.limits_for("/kubepods/besteffort/pod9")
    assert second.memory_limit(0) == 8 * GiB and second.memory_limit(1) == 4 * GiB
    assert second.memory_limit(2) is None
    assert p.limits_for("/system.slice/x") is p.default


def test_empty_policy():
    p = load_policy("", "empty.toml")
    assert p == Policy("empty.toml") and p.limits_for("anything") is None


@pytest.mark.parametrize("text,line,fragment", [
    ('[default]\nmemory = "8Gi"\nsm = \n', 3, "invalid TOML"),
    ('[default]\nmemory = "12x"\n', 2, "12x"),
    ('[default]\nsm = 50\nmemory = 0\n', 3, "omit the key"),
    ('[default]\nsm = 101\n', 2, "sm"),
    ('[default]\n\nmemroy = "1Gi"\n', 3, "memroy"),
    ('[[group]]\nmatch = "a"\n\n[[group]]\nmemory = "1Gi"\n', 4, "match"),
    ('[[group]]\nmatch = "a"\n[[group]]\nmatch = "b"\nmemory = { "x" = "1Gi" }\n', 5, "device index"),
    ('[default]\nutilization_policy = "always"\n', 2, "utilization_policy"),
    ('[defaults]\nmemory = "1Gi"\n', 1, "defaults"),
    ('[default]\npriority = "high"\n', 2, "priority"),
    ('group = 3\n', 1, "[[group]]"),
])
def test_policy_errors_name_source_and_line(text, line, fragment):
    with pytest.raises(PolicyError) as info:
        load_policy(text, "/etc/hami-bpf/policy.toml")
    err = info.value
    assert str(err).startswith(f"/etc/hami-bpf/policy.toml:{line}: "), str(err)
    assert err.line == line and err.source == "/etc/hami-bpf/policy.toml"
    assert fragment in str(err)


def test_policy_sm_zero_is_unlimited():
    p = load_policy("[default]\nsm = 0\n", "p")
    assert p.default.sm is None


# ------------------------------------------------------------- precedence
def _policy(mem: str | None, sm: int | None) -> Policy:
    lines = ["[default]"]
    if mem is not None:
        lines.append(f'memory = "{mem}"')
    if sm is not None:
        lines.append(f"sm = {sm}")
    return load_policy("\n".join(lines) + "\n", "p")


def test_env_lowers_but_never_raises():
    pol = _policy("8Gi", 50)
    low, _ = parse_env_limits({"CUDA_DEVICE_MEMORY_LIMIT": "2g", "CUDA_DEVICE_SM_LIMIT": "10"})
    high, _ = parse_env_limits({"CUDA_DEVICE_MEMORY_LIMIT": "64g", "CUDA_DEVICE_SM_LIMIT": "100",
                                "GPU_CORE_UTILIZATION_POLICY": "disable"})
    assert effective_limits(pol, "g", low, 0) == (2 * GiB, 10)
    assert effective_limits(pol, "g", high, 0) == (8 * GiB, 50)
    assert effective_limits(pol, "g", None, 0) == (8 * GiB, 50)


def test_no_policy_env_applies_and_neither_is_unlimited():
    env, _ = parse_env_limits({"CUDA_DEVICE_MEMORY_LIMIT_1": "3g", "CUDA_DEVICE_SM_LIMIT": "25"})
    assert effective_limits(None, "g", env, 1) == (3 * GiB, 25)
    assert effective_limits(None, "g", env, 0) == (None, 25)
    assert effective_limits(None, "g", None, 0) == (None, None)
    # A policy that has nothing for this group behaves like no policy.
    assert effective_limits(load_policy("", "p"), "g", env, 1) == (3 * GiB, 25)


def test_env_per_device_uses_visible_index():
    pol = _policy("8Gi", None)
    env, _ = parse_env_limits({"CUDA_DEVICE_MEMORY_LIMIT_0": "1g", "CUDA_VISIBLE_DEVICES": "3"})
    vis = physical_to_visible(3, env.visible_devices, UUIDS)
    assert effective_limits(pol, "g", env, 3, visible_index=vis) == (GiB, None)


@PROFILE
@given(
    pol_mem=st.none() | st.integers(min_value=1, max_value=1 << 45),
    pol_sm=st.none() | st.integers(min_value=0, max_value=100),
    env_mem=st.none() | st.integers(min_value=0, max_value=1 << 45),
    env_sm=st.none() | st.integers(min_value=0, max_value=100),
    util=st.sampled_from(["default", "force", "disable"]),
    device=st.integers(min_value=0, max_value=3),
)
def test_never_raised_above_policy(pol_mem, pol_sm, env_mem, env_sm, util, device):
    text = "[default]\n"
    if pol_mem is not None:
        text += f"memory = {pol_mem}\n"
    if pol_sm is not None:
        text += f"sm = {pol_sm}\n"
    pol = load_policy(text, "p")
    environ = {"GPU_CORE_UTILIZATION_POLICY": util}
    if env_mem is not None:
        environ[f"CUDA_DEVICE_MEMORY_LIMIT_{device}"] = str(env_mem)
    if env_sm is not None:
        environ["CUDA_DEVICE_SM_LIMIT"] = str(env_sm)
    env, problems = parse_env_limits(environ)
    assert problems == []
    mem, sm = effective_limits(pol, "any", env, device)
    pol_sm_eff = pol_sm or None
    if pol_mem is not None:
        assert mem is not None and mem <= pol_mem
    if pol_sm_eff is not None:
        assert sm is not None and sm <= pol_sm_eff
    # And the env alone decides when the policy says nothing.
    if pol_mem is None:
        assert mem == (env_mem or None)
    if pol_sm_eff is None:
        assert sm == (None if util == "disable" else (env_sm or None))
