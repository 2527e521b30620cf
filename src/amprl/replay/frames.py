"""The replay table's frames: how they are encoded, where they sit in the frame ring, and
the in-memory cache of them.

``FrameCache`` is a part of ``ReplayTable`` (it is mixed into it, see ``table.py``) and works
on the table's state (``state.py``), which ``ReplayTable.__init__`` sets up. Its methods that touch the
ring or the cache run with the table's lock held. It is its own module because the frames'
encoding and caching are a concern of their own beside keys, priorities and Redis writes.
"""

from __future__ import annotations

import lz4.block
import numpy as np

from amprl.envs.spec import EnvSpec
from amprl.errors import Unavailable
from amprl.replay.state import TableState


def resolve_compression(compression: str, spec: EnvSpec) -> str:
    """"auto" means lz4 for uint8 image frames (2-D or more), none for vectors."""
    if compression == "auto":
        return "lz4" if spec.frame_dtype == np.uint8 and len(spec.frame_shape) >= 2 else "none"
    return compression


class FrameCache(TableState):
    """The frame ring and its cache of encoded frames (a part of ``ReplayTable``)."""

    @staticmethod
    def _encode_frames(frames: np.ndarray) -> list[bytes]:
        return [lz4.block.compress(f, store_size=False) for f in frames]

    def _encode_chunk_frames(self, frames: np.ndarray) -> tuple[list[bytes] | None, bytes, np.ndarray]:
        """A chunk's frames as stored: (one encoded block per frame, or None when the dense
        pool keeps them raw; the blob written to Redis; each frame's offset in it)."""
        num_frames = int(frames.shape[0])
        if self.compression == "none":
            encoded = None
            frames_blob = np.ascontiguousarray(frames).tobytes()
            offsets = np.arange(num_frames + 1, dtype=np.int64) * self.frame_nbytes
            if not self.dense:
                mv = memoryview(frames_blob)
                encoded = [bytes(mv[i * self.frame_nbytes:(i + 1) * self.frame_nbytes])
                           for i in range(num_frames)]
        else:
            encoded = self._encode_frames(frames)
            offsets = np.zeros(num_frames + 1, dtype=np.int64)
            np.cumsum([len(e) for e in encoded], out=offsets[1:])
            frames_blob = b"".join(encoded)
        return encoded, frames_blob, offsets

    def _decode_frame(self, blob: bytes) -> np.ndarray:
        if self.compression == "lz4":
            blob = lz4.block.decompress(blob, uncompressed_size=self.frame_nbytes)
        return np.frombuffer(blob, dtype=self.frame_dtype).reshape(self.frame_shape)

    def _frame_slots(self, frame_base: int, count: int) -> np.ndarray:
        return (frame_base + np.arange(count, dtype=np.int64)) % self.frame_capacity

    def _chunk_entry(self, cid: int) -> tuple[int, int, int, int, int]:
        return self.chunks[cid - self.chunks[0][0]]  # live chunk ids are consecutive

    def _split_blob(self, cid: int, blob: bytes) -> list[bytes]:
        off = self._offsets[cid].tolist()
        mv = memoryview(blob)
        return [bytes(mv[off[i]:off[i + 1]]) for i in range(len(off) - 1)]

    def _cache_frames(self, cid: int, encoded: list[bytes]) -> None:
        """Puts a live chunk's encoded frames in memory, dropping the oldest cached chunks
        beyond cache_max_bytes (never the one just added)."""
        _, _, _, fbase, f = self._chunk_entry(cid)
        slots = self._frame_slots(fbase, f)
        if self.dense:
            raw = np.frombuffer(b"".join(encoded), dtype=self.frame_dtype)
            self.frame_pool[slots] = raw.reshape(f, *self.frame_shape)
            return
        if cid in self._cached:
            return
        holder = np.empty(f, dtype=object)
        holder[:] = encoded
        self.frame_pool[slots] = holder
        nbytes = sum(len(e) for e in encoded)
        self._cached[cid] = nbytes
        self.cache_bytes += nbytes
        while self.cache_bytes > self.cache_max_bytes and len(self._cached) > 1:
            self._uncache(next(iter(self._cached)))

    def _uncache(self, cid: int) -> None:
        nbytes = self._cached.pop(cid, None)
        if nbytes is None:
            return
        self.cache_bytes -= nbytes
        _, _, _, fbase, f = self._chunk_entry(cid)
        self.frame_pool[self._frame_slots(fbase, f)] = None

    def _gather_encoded(self, fids: np.ndarray) -> np.ndarray:
        """Encoded frames of global frame ids (object array); cache misses are fetched
        from Redis, one pipelined round trip for all their chunks (lock held)."""
        fslots = fids % self.frame_capacity
        encoded = self.frame_pool[fslots]
        # numpy's stubs take no None operand; on an object array it compares each element
        missing = np.flatnonzero(np.equal(encoded, None))  # type: ignore[call-overload]
        if missing.size:
            cids = np.unique(self.frame_chunk[fslots[missing]]).tolist()
            fetched = {}
            for cid, blob in zip(cids, self.storage.load_frames(cids)):
                if blob is None:
                    raise Unavailable(f"Redis lost the frames of live chunk {cid} (it restarted "
                                      f"without its last writes?); replay reconciles its index "
                                      f"within a second: retry")
                fetched[cid] = self._split_blob(cid, blob)
                self._cache_frames(cid, fetched[cid])
            for i in missing.tolist():
                cid = int(self.frame_chunk[fslots[i]])
                encoded[i] = fetched[cid][int(fids[i]) - self._chunk_entry(cid)[3]]
        return encoded
