"""``verify=True``: after a rank's runs landed, and before its read ends (so the version cannot change meanwhile),
the producer's checksum of each parameter's ranges is compared with the bytes landed here; a mismatch names the
parameter, the rank and the targets."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np
import torch

from .._consumer import versions
from .._consumer.ranges import Landed, Runs
from .._objects.checksum import tensor_ranges_crc
from .._process.versions import encode_ranges
from ..errors import ChecksumMismatchError
from .publish import Shards

SUM_CHUNK = 32768  # ranges per checksum request (24 bytes each: well inside a control frame)


def check(ctx: Any, shards: Shards, runs: Runs, landed: Landed, keep: Sequence[torch.Tensor], names: List[str],
          deadline: float) -> int:
    """Compare the producer's CRC-32C per parameter (leaf) of this rank's runs with the bytes landed in ``keep``;
    ChecksumMismatchError names the parameter and the rank. The bytes checked."""
    group, buf, off, n, target, dst = runs.leaf, landed.buf, landed.off, runs.n, runs.target, runs.dst
    views: Dict[int, torch.Tensor] = {}  # CPU bytes or a GPU's, checksummed where they are
    for t in np.unique(target).tolist():
        views[t] = keep[t].reshape(-1).view(torch.uint8)
    for lo in range(0, len(n), SUM_CHUNK):
        hi = lo + SUM_CHUNK
        theirs = versions.sums(ctx, shards.meta, encode_ranges(group[lo:hi], buf[lo:hi], off[lo:hi], n[lo:hi]),
                               deadline)
        # the same ranges as they landed here: a group's runs contiguous in a target are read as one range
        ours = tensor_ranges_crc(views, group[lo:hi], target[lo:hi], dst[lo:hi], n[lo:hi])
        for g, crc in ours.items():
            if theirs.get(g) != crc:
                param = shards.params[g].name
                into = sorted({names[t] for gg, t in zip(group[lo:hi].tolist(), target[lo:hi].tolist()) if gg == g})
                err = ChecksumMismatchError(
                    f"parameter {param!r} from {shards.source} (version {shards.version}), landed in "
                    f"target(s) {into}: the bytes' CRC-32C is {crc:08x}, the producer's {theirs.get(g, 0):08x}",
                    rank=shards.rank, object_id=shards.meta.id_hex,
                    hint="the bytes changed between the producer's checksum and the read (an in-place update "
                         "without shards.fence()), or were corrupted on the way; the targets hold wrong bytes: "
                         "load again")
                err.param, err.version = param, shards.version
                raise err
    return int(n.sum())
