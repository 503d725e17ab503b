"""What the duty pacer is expected to give, worked out here rather than taken
from its own code (`duty._Key.run_pct`), so a test that uses it checks the
pacer against the rule, not against itself."""
from __future__ import annotations

from hami_bpf.sm import duty


def allowed(cap: float) -> float:
    """The share of the time (percent) a launch-bound group alone on its
    device runs in DUTY mode: its cap, plus what being held costs it."""
    return min(cap / (1.0 - duty.HOST_STOP_SHARE), 99.0)
