"""The program a reading process runs: read file ranges into a shared ring, report each.

Started by :mod:`ondeck.loading.process_pool` as ``python -I -S read_worker.py
RING_FD SOCKET_FD``; it imports the standard library only, so it starts in milliseconds
and holds a few MiB. It first sends ``READY``. Messages on the socket (SOCK_SEQPACKET, one
per datagram):

- ``b"O" + file id`` with a file descriptor attached: keep that file open under the id;
- one ``READ`` or more, back to back (each ``b"R"``, file id, ring offset, file offset,
  length, tag): read each range into the ring in turn and answer each with ``REPLY``
  (tag, status, byte reached): status 0 when done, an errno when the read failed, -1 when
  the file ended first;
- ``b"C"``: close every file. The process exits when the socket closes.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import sys

READ = struct.Struct("<cIQQQI")
REPLY = struct.Struct("<Iiq")
OPEN = struct.Struct("<cI")
READY = b"ready"
# The most reads one message asks for: a process holds at most this many slots.
MAX_READS = 32
FILE_ENDED = -1


def serve(ring_fd: int, socket_fd: int) -> None:
    ring = mmap.mmap(ring_fd, os.fstat(ring_fd).st_size)
    view = memoryview(ring)
    channel = socket.socket(fileno=socket_fd)
    channel.send(READY)
    files: dict[int, int] = {}
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(channel, READ.size * MAX_READS, 4)
        except (ConnectionError, OSError):
            return
        if not message:
            return
        kind = message[:1]
        if kind == b"R":
            for _, file_id, ring_offset, offset, length, tag in READ.iter_unpack(message):
                status, reached = read_range(files[file_id], view, ring_offset, offset, length)
                try:
                    channel.send(REPLY.pack(tag, status, reached))
                except OSError:  # the loading process is gone
                    return
        elif kind == b"O":
            _, file_id = OPEN.unpack(message)
            if file_id in files:  # a load that failed before closing its files
                os.close(files[file_id])
            files[file_id] = fds[0]
        elif kind == b"C":
            for fd in files.values():
                os.close(fd)
            files.clear()


def read_range(fd: int, view: memoryview, ring_offset: int, offset: int, length: int):
    done = 0
    while done < length:
        try:
            count = os.preadv(fd, [view[ring_offset + done : ring_offset + length]], offset + done)
        except OSError as error:
            return error.errno or 5, offset + done
        if count == 0:
            return FILE_ENDED, offset + done
        done += count
    return 0, offset + done


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
