"""User transports for tests/test_transports.py (importable by Ray workers, registered through __ray_call__)."""

from __future__ import annotations

from typing import Any, Optional

import rdt
from rdt.transports import Capabilities, Fetched, SetupFailed, Site, Transport


class NeverSetsUp(Transport):
    """First in auto's chain for CPU objects, exports a marker, and can never set up in a consumer."""

    capabilities = Capabilities(name="never", devices=frozenset({"cpu"}), one_sided=True, auto_priority=1)

    def export(self, ctx: Any, entry: Any, chosen: str) -> Optional[str]:
        return "marker"

    def fetch(self, ctx: Any, meta: Any, site: Site, deadline: float) -> Fetched:
        raise SetupFailed("this transport never sets up (by design, for the test)")


class ProducerOnly(Transport):
    """Registered in the producer only: a consumer without it must get a typed error naming it."""

    capabilities = Capabilities(name="producer_only", devices=frozenset({"cpu"}))

    def export(self, ctx: Any, entry: Any, chosen: str) -> Optional[str]:
        return "here"

    def fetch(self, ctx: Any, meta: Any, site: Site, deadline: float) -> Fetched:
        raise AssertionError("never reached in a process without the transport")


def register(_self: Any, name: str) -> None:
    """(worker side) register one of the transports above in this process."""
    rdt.register_transport({"never": NeverSetsUp, "producer_only": ProducerOnly}[name]())


def unregister(_self: Any, name: str) -> None:
    """(worker side) forget it again (the actors are shared with other tests)."""
    from rdt import transports

    transports.unregister_transport(name)


def put_with(_self: Any, name: str, numel: int) -> Any:
    """(worker side) an object of ``numel`` float32 ones made with transport ``name``, as a nested ref."""
    import torch

    return [rdt.put({"w": torch.ones(numel)}, name)]
