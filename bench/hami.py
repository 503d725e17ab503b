#!/usr/bin/env python3
"""Run the hami-bpf CLI straight from a checkout, without installing it.

The device machine has no package registry, so bench scripts run the daemon
from the source tree: `cli/` is installed as `hami_bpf.cli`, so alias it here.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import hami_bpf  # noqa: E402
import importlib.util  # noqa: E402

spec = importlib.util.spec_from_file_location(
    "hami_bpf.cli", os.path.join(ROOT, "cli", "__init__.py"),
    submodule_search_locations=[os.path.join(ROOT, "cli")])
mod = importlib.util.module_from_spec(spec)
sys.modules["hami_bpf.cli"] = mod
spec.loader.exec_module(mod)
hami_bpf.cli = mod

from hami_bpf.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
