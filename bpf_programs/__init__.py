"""BPF C sources, loaded from disk by bcc (package data)."""
