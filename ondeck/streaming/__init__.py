"""Block streaming: run a component whose repeated blocks do not all fit the device.

A denoising step calls a transformer's blocks in the same order every time. When a
stage cannot hold its component within the budget, the blocks that fit stay resident,
evenly spaced along the list, and the others wait in pinned host memory (read once
from the files) and are copied into a few device slots: the next streamed block on a
side stream while the current one computes. Where the host budget has no room for the
pinned copies, the blocks without one are read from the files each pass through a small
pinned ring. On unified memory nothing streams: a host copy there frees nothing.

``layout`` is the pure arithmetic the plan uses, ``file_reads`` the host side of it;
``host`` holds the host copies, ``file_ring`` the ring; ``streamer`` is the runtime for
one component; ``pipeline`` connects them to the budget policy.
"""

from .layout import (
    BlockSizes,
    StreamingChoice,
    StreamingInputs,
    StreamLayout,
    evenly_spaced,
    plan_streaming,
    stream_layout,
)
from .packing import describe_blocks
from .pipeline import BlockStreaming, StreamOptions
from .streamer import BlockStreamer, StreamStats, find_block_lists, find_blocks

__all__ = [
    "BlockSizes",
    "BlockStreamer",
    "BlockStreaming",
    "StreamLayout",
    "StreamOptions",
    "StreamingChoice",
    "StreamStats",
    "StreamingInputs",
    "describe_blocks",
    "evenly_spaced",
    "find_block_lists",
    "find_blocks",
    "plan_streaming",
    "stream_layout",
]
