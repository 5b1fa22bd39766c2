"""Muster: elastic rendezvous and heartbeat coordinator for PyTorch distributed training."""

from functools import cache


@cache
def version() -> str:
    """The installed distribution's version (`muster -V`, and each replica's in Status)."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("torch-muster")
    except PackageNotFoundError:  # (run from a checkout that was never installed)
        return "unknown (not installed)"
