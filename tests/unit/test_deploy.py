"""deploy/: the manifests against Kubernetes' own schemas, offline, plus the
checks a schema cannot make (least privilege, mounts used, args accepted).

Schemas: ``kubernetes-validate`` (PyPI) bundles the OpenAPI schemas of every
Kubernetes release as JSON Schema and validates offline; ``strict`` schemas
reject unknown fields, so a typo such as ``capabilitiez`` fails.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = ("daemonset.yaml", "policy-configmap.yaml")
# The oldest release whose schema must accept the manifests (appArmorProfile
# in securityContext is 1.30+) and the newest the validator knows.
K8S_VERSIONS = ("1.30.0", None)

ALLOWED_CAPS = {"SYS_PTRACE", "KILL", "SYS_RESOURCE", "SYS_ADMIN", "SYS_NICE"}


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def all_docs() -> list[dict]:
    return [d for name in MANIFESTS for d in docs(name)]


def daemonset() -> dict:
    return next(d for d in docs("daemonset.yaml") if d["kind"] == "DaemonSet")


def container() -> dict:
    return daemonset()["spec"]["template"]["spec"]["containers"][0]


# ------------------------------------------------------------------ schemas

def _kv():
    return pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate not installed (pip install kubernetes-validate; "
               "it is in the [test] extras)")


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("doc", all_docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_matches_kubernetes_schema(doc, version):
    kv = _kv()
    kv.validate(doc, version or kv.latest_version(), strict=True)


def test_schema_check_catches_a_typo():
    kv = _kv()
    bad = daemonset()
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilitiez"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)


def test_kustomization_builds_and_validates():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed")
    r = subprocess.run([kubectl, "kustomize", str(DEPLOY)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    built = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert sorted(d["kind"] for d in built) == sorted(d["kind"] for d in all_docs())
    assert all(d["metadata"].get("namespace") == "kube-system" for d in built)
    kv = _kv()
    for d in built:
        kv.validate(d, kv.latest_version(), strict=True)


# ------------------------------------------------------------ least privilege

def test_not_privileged_and_named_capabilities_only():
    sc = container()["securityContext"]
    assert sc.get("privileged") is False
    # CAP_SYS_ADMIN (adopting pinned maps, see the DaemonSet) is refused by
    # the API server with allowPrivilegeEscalation: false
    assert sc["allowPrivilegeEscalation"] is ("SYS_ADMIN" in sc["capabilities"]["add"])
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    added = set(sc["capabilities"]["add"])
    assert added == ALLOWED_CAPS, added


def test_every_capability_is_justified_in_a_comment():
    text = (DEPLOY / "daemonset.yaml").read_text()
    for cap in ALLOWED_CAPS:
        # a comment line naming CAP_<cap> right above its list entry
        assert re.search(rf"#\s*CAP_{cap}:.*(?:\n\s*#.*)*\n\s*-\s*{cap}\s*\n", text), cap


def test_host_pid_and_no_host_network():
    spec = daemonset()["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    assert not spec.get("hostNetwork")
    assert spec["automountServiceAccountToken"] is False


def test_mounts_and_volumes_match_and_are_justified():
    spec = daemonset()["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in container()["volumeMounts"]}
    assert set(vols) == set(mounts), "a volume without a mount or a mount without a volume"
    text = (DEPLOY / "daemonset.yaml").read_text()
    for m in container()["volumeMounts"]:
        # each mount is preceded by a comment saying why
        block = text.split(f"- name: {m['name']}\n              mountPath:")[0]
        assert block.rstrip().splitlines()[-1].strip().startswith("#"), m["name"]
    # read-only unless the agent writes there
    writable = {m["name"] for m in mounts.values() if not m.get("readOnly")}
    assert writable == {"run", "bpffs", "modules-links", "hami-vgpu-containers", "tmp"}, writable
    paths = {v["hostPath"]["path"] for v in vols.values() if "hostPath" in v}
    for needed in ("/sys/kernel/tracing", "/sys/kernel/btf", "/run/hami-bpf", "/sys/fs/bpf",
                   "/lib/modules", "/usr/src"):
        assert needed in paths, needed


def test_policy_mount_is_not_writable_by_others():
    vols = {v["name"]: v for v in daemonset()["spec"]["template"]["spec"]["volumes"]}
    mode = vols["policy"]["configMap"]["defaultMode"]
    assert mode & 0o022 == 0


# ------------------------------------------------------- args and policy

def _run_command():
    """`hami-bpf run` as click parses it, without requiring that the node's
    paths (/host/driver-lib/..., /etc/hami-bpf/...) exist here."""
    import copy

    import click

    from hami_bpf.cli.main import main
    cmd = copy.deepcopy(main.get_command(click.Context(main), "run"))
    for p in cmd.params:
        if isinstance(p.type, click.Path):
            p.type.exists = False
    return cmd


def test_daemon_args_are_accepted_by_hami_bpf_run():
    c = container()
    args = c["args"]
    assert args[0] == "run"
    cmd = _run_command()
    ctx = cmd.make_context("run", list(args[1:]))
    p = ctx.params
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    # the files named by the args live in mounted volumes
    for path in (p["policy"], *p["libcuda"], p["state_dir"], p["socket_path"]):
        assert any(str(path).startswith(mp + "/") or str(path) == mp for mp in mounts), path
    port = int(p["metrics_addr"].rsplit(":", 1)[1])
    assert port in [pt["containerPort"] for pt in c["ports"]]


def test_readiness_probe_uses_the_daemons_socket():
    c = container()
    probe = c["readinessProbe"]["exec"]["command"]
    sock = probe[probe.index("--socket") + 1]
    args = _run_command().make_context("run", list(c["args"][1:])).params
    assert sock == args["socket_path"]


def test_policy_configmap_parses():
    from hami_bpf.limits import load_policy
    cm = next(d for d in docs("policy-configmap.yaml") if d["kind"] == "ConfigMap")
    args = _run_command().make_context("run", list(container()["args"][1:])).params
    vols = {v["name"]: v for v in daemonset()["spec"]["template"]["spec"]["volumes"]}
    assert vols["policy"]["configMap"]["name"] == cm["metadata"]["name"]
    key = Path(args["policy"]).name
    policy = load_policy(cm["data"][key], key)
    assert policy is not None


# ------------------------------------------------------------------ image

def test_containerfile_copies_existing_paths_and_entrypoint_is_valid_sh():
    text = (DEPLOY / "Containerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                if src.startswith("build/"):
                    continue   # made by deploy/build-image.sh
                assert (ROOT / src).exists(), src
    assert re.search(r"^ARG BASE_IMAGE=\S*debian:12", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", text, re.M)
    assert "python3-bpfcc" in text
    r = subprocess.run(["sh", "-n", str(DEPLOY / "entrypoint.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
