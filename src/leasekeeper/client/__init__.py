"""The Python client of leasekeeper: leases that renew themselves and say when they are lost.

``LeaseClient`` (sync, a renewal thread per held lease) and ``AsyncLeaseClient``
(asyncio, a renewal task) speak the HTTP API over httpx; ``FenceGuard`` keeps the
highest fencing token per resource in your own database. Errors are the classes
of ``leasekeeper``'s one exception tree.
"""

from leasekeeper.client._async import AsyncHeldLease, AsyncLeaseClient
from leasekeeper.client._common import current_lease
from leasekeeper.client._fence import FenceGuard
from leasekeeper.client._renewer import AsyncRenewalWorker, AsyncSignal, RenewalWorker
from leasekeeper.client._results import Completed, Lease, Released
from leasekeeper.client._sync import HeldLease, LeaseClient
from leasekeeper.client._timing import RenewalPlan

__all__ = [
    "AsyncHeldLease",
    "AsyncLeaseClient",
    "AsyncRenewalWorker",
    "AsyncSignal",
    "Completed",
    "FenceGuard",
    "HeldLease",
    "Lease",
    "LeaseClient",
    "Released",
    "RenewalPlan",
    "RenewalWorker",
    "current_lease",
]
