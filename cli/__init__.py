"""The click front end (installed as hami_bpf.cli)."""
