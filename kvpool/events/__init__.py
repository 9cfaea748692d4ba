"""Router-visible KV events: vLLM's wire format, and the sinks that carry them.

`types` holds the msgspec Structs, `codec` their msgpack bytes, `sinks` the in-process
sinks and `zmq_publisher` vLLM's ZMQ PUB/ROUTER publisher (pyzmq optional, imported only
when a publisher is created).
"""

from kvpool.events.codec import decode_batch, encode_batch
from kvpool.events.sinks import EventCollector, EventSink, EventStream
from kvpool.events.types import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
)
from kvpool.events.zmq_publisher import ZmqEventPublisher

__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventCollector",
    "EventSink",
    "EventStream",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "ZmqEventPublisher",
    "decode_batch",
    "encode_batch",
]
