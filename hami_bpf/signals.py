"""Which signals end the daemon (each after the same clean-up), and the exit
status each one gives."""
from __future__ import annotations

import signal

# Signals whose default action ends the process: each gets SIGTERM's
# clean-up (resume what we stopped, detach, close). SIGKILL and SIGSTOP cannot
# be caught; SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT and SIGTRAP report a
# fault of this process and are left to their default.
FATAL_SIGNALS = tuple(sorted(
    {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
     signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF, signal.SIGIO, signal.SIGPWR,
     signal.SIGXCPU, signal.SIGXFSZ, signal.SIGSYS, signal.SIGPIPE}
    | {getattr(signal, "SIGSTKFLT", signal.SIGTERM)}
    | set(range(signal.SIGRTMIN, signal.SIGRTMAX + 1))))
# Stops asked for: exit status 0. Any other fatal signal: 128 + its number,
# as a shell reports a process it ended, after the same clean-up.
REQUESTED_STOPS = (signal.SIGTERM, signal.SIGINT)


def install(stop, reload) -> dict:
    """``stop(signum)`` on every fatal signal left at its default, ``reload()``
    on SIGHUP; returns what they replaced. The handlers only set flags."""
    old = {}
    for s in FATAL_SIGNALS:
        try:
            # Not one ignored on purpose (SIGPIPE); Python's own SIGINT
            # handler (KeyboardInterrupt) would skip the clean-up's order.
            if signal.getsignal(s) in (signal.SIG_DFL, signal.default_int_handler):
                old[s] = signal.signal(s, lambda signum, frame: stop(signum))
        except (OSError, ValueError):
            pass
    old[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda signum, frame: reload())
    return old


def ignore(old: dict) -> None:
    """Clean-up is done and the status decided: a signal still arriving (a
    burst of them, a supervisor repeating itself) must not turn a clean exit
    into death by signal, so the rest of the way out ignores them rather than
    going back to the defaults."""
    for s in old:
        signal.signal(s, signal.SIG_IGN)


def exit_status(sig: int | None) -> tuple[int, str]:
    """(exit status, how the log says it stopped) after the signal ``sig``."""
    if sig is None or sig in REQUESTED_STOPS:
        return 0, "stopped"
    try:
        name = signal.Signals(sig).name
    except ValueError:          # a real-time signal
        name = f"signal {sig}"
    return 128 + sig, f"stopped ({name})"
