"""Small CPU objects travel inside their metadata: nothing is held in the producer, no lifetime token is needed.

Export applies to every object up to ``inline_threshold`` bytes whose buffers are all on the CPU, whatever
transport it was made with (a nested token would cost ~2 ms per round trip in Ray's borrower protocol).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from .._objects.meta import ObjectMeta
from .._objects.stream_ready import wait_ready
from .base import Capabilities, Fetched, Site, Transport


class InlineTransport(Transport):
    capabilities = Capabilities(name="inline", devices=frozenset({"cpu"}), one_sided=True, self_contained=True,
                                explicit=False)

    def export(self, ctx: Any, entry: Any, chosen: str) -> Optional[Tuple[bytes, ...]]:
        flat = entry.flat
        if flat.nbytes > ctx.config.inline_threshold or flat.table.device_types - {"cpu"}:
            return None
        wait_ready(entry)
        return tuple(b.numpy().tobytes() for b in flat.buffers)

    def fetch(self, ctx: Any, meta: ObjectMeta, site: Site, deadline: float) -> Fetched:
        return Fetched([torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)
                        for b in meta.export("inline")], "inline")
