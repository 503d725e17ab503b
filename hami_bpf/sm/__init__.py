"""The SM-share controller: pure models that turn what the launch and
synchronize probes counted into grants and holds (no I/O; the daemon reads
the maps, steps them and writes what they decide)."""
