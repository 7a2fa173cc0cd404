"""The public surface of leasekeeper and leasekeeper.client is what __all__ says."""

from __future__ import annotations

import leasekeeper
import leasekeeper.client


def test_all_is_sorted_and_importable() -> None:
    """Each __all__ is sorted and names only attributes that exist."""
    for module in (leasekeeper, leasekeeper.client):
        assert module.__all__ == sorted(module.__all__)
        assert all(hasattr(module, name) for name in module.__all__)


def test_the_clients_are_exported_from_the_top() -> None:
    """from leasekeeper import LeaseClient, AsyncLeaseClient works, with the client errors."""
    for name in ("AsyncLeaseClient", "LeaseClient", "ServiceUnreachable", "StaleFence"):
        assert name in leasekeeper.__all__
    assert leasekeeper.LeaseClient is leasekeeper.client.LeaseClient


def test_implementation_modules_are_private() -> None:
    """Every public name of leasekeeper.client is defined in a _-prefixed module."""
    for name in leasekeeper.client.__all__:
        module = getattr(leasekeeper.client, name).__module__
        assert module.rsplit(".", 1)[-1].startswith("_"), (name, module)
