"""What a consumer knows of an object's producer: is it alive, ask it over the control channel, name its death.

Shared by the consumer core and the transports (below both; imports neither).
"""

from __future__ import annotations

import struct
from typing import Any, Optional, Tuple

from rdt_transports._proc import process_alive

from . import wire as _control
from .._objects.meta import ObjectMeta
from .._ray.runtime import node_id
from ..errors import ObjectFetchError, ObjectFreedError, ProducerDiedError, VersionGoneError


def probe(ctx: Any, meta: ObjectMeta, ping_timeout: float = 2.0) -> Tuple[str, str]:
    """("alive" | "dead" | "silent", why): "dead" only on proof of death (the process is gone on this node: its pid
    no longer names it, see ``_proc``; or nothing listens on its control port); "silent" when no answer came (a
    stopped process, or its node unreachable)."""
    if meta.producer.node_id == node_id() and not process_alive(meta.producer.pid, meta.producer.started):
        return "dead", f"pid {meta.producer.pid} is gone"
    why = "no answer"
    for _ in range(2):  # a pooled connection that breaks proves nothing: the second try opens a fresh one
        try:
            ctx.client.request(meta.producer.control_address, _control.REQ_PING, _control.KEY_PROCESS,
                               meta.producer.process_key, b"", ping_timeout)
            return "alive", ""
        except ConnectionRefusedError:
            return "dead", f"nothing listens on {meta.producer.control_address}"
        except (ConnectionError, _control.ProtocolError) as e:
            why = f"{type(e).__name__}: {e}"
            continue
        except Exception as e:  # a timeout or an unreachable host: silent, not proven dead
            return "silent", f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return "silent", why


def producer_alive(ctx: Any, meta: ObjectMeta, ping_timeout: float = 2.0) -> bool:
    """False only on proof of death (see :func:`probe`). A ping that times out means stuck, slow or cut off, not
    dead (a stopped process answers nothing but is alive)."""
    return probe(ctx, meta, ping_timeout)[0] != "dead"


def unreachable(meta: ObjectMeta, what: str, cause: BaseException, why: str) -> ObjectFetchError:
    """The error for a fetch that failed while the producer does not answer: name its node and address."""
    return ObjectFetchError(
        f"{what} of {meta.describe()} failed ({type(cause).__name__}: {cause}), and its producer (actor "
        f"{meta.producer.actor_id[:12] or 'driver'}, pid {meta.producer.pid}, node {meta.producer.node_id[:12]}, "
        f"control {meta.producer.control_address}) does not answer ({why}): its node may be unreachable (link "
        f"down, node removed)", object_id=meta.id_hex,
        hint="check the network path to the producer's node; fetch again once it answers, or re-run the producing "
             "method on a live actor if the node is gone",
    )


def died(meta: ObjectMeta, cause: BaseException) -> ProducerDiedError:
    """The error for an object whose producer is gone."""
    return ProducerDiedError(
        f"the producer of {meta.describe()} (actor {meta.producer.actor_id[:12] or 'driver'}, pid "
        f"{meta.producer.pid}) is unreachable: {cause}",
        object_id=meta.id_hex,
        hint="the producer died; its objects are lost. Re-run the producing method on a live actor",
    )


def freed(meta: ObjectMeta, detail: str = "was freed before it was fetched") -> ObjectFreedError:
    """The error for an object its producer no longer holds."""
    return ObjectFreedError(f"{meta.describe()} {detail}", object_id=meta.id_hex,
                            hint="keep a reference to the ObjectRef until every consumer has run")


def control_request(ctx: Any, meta: ObjectMeta, msg: int, key_id: int, key: bytes, payload: bytes,
                    timeout: float, alloc: Optional[_control.Alloc] = None) -> bytes:
    """One authenticated request to the producer's control server; typed errors for death, refusal and freeing.

    ``alloc`` receives a streamed answer's header and returns the buffers its raw bytes land in.
    """
    try:
        resp_type, resp = ctx.client.request(meta.producer.control_address, msg, key_id, key, payload, timeout,
                                             alloc)
    except (ConnectionError, OSError) as e:
        if isinstance(e, TimeoutError):
            raise
        if isinstance(e, ConnectionRefusedError) or not producer_alive(ctx, meta):
            raise died(meta, e) from e
        # Alive but it dropped the request: e.g. it left the group whose secret signed it.
        raise ObjectFetchError(
            f"the producer of {meta.describe()} is alive but refused the request ({e})", object_id=meta.id_hex,
            hint="the producer may have left the group the object was made in; re-create the group or use "
            "tensor_transport='auto'",
        ) from e
    if resp_type == _control.RESP_OK:
        return resp
    code = struct.unpack_from("!H", resp)[0] if len(resp) >= 2 else 0
    text = resp[2:].decode(errors="replace")
    if code == _control.ERR_NOT_FOUND:
        raise freed(meta, f"is gone from its producer: {text}")
    if code == _control.ERR_VERSION_GONE:
        gone = VersionGoneError(f"{meta.describe()} is a version its producer no longer serves: {text}",
                                object_id=meta.id_hex, hint="load the newest manifest")
        gone.reason = text
        raise gone
    raise ObjectFetchError(f"the producer refused to serve {meta.describe()}: {text}", object_id=meta.id_hex)
