"""A checksummed container file: named binary blobs plus a JSON header.

Layout (little endian):
  [0:8)    magic b"KVJXHOST"
  [8:12)   format version (uint32)
  [12:16)  crc32 of bytes [16:32)
  [16:24)  header offset (uint64)
  [24:32)  header length (uint64)
  [32:...) blobs, each 64-byte aligned
  header   UTF-8 JSON: {"meta": {...}, "blobs": {name: [offset, nbytes, crc32]}}
  [-4:]    crc32 of the header

The header goes last so blobs stream out once, their checksums computed on the
way. Writes go to a temporary file in the target's folder, are fsynced, and
replace the target atomically (os.replace), so a crash leaves either the old
file or the new one. Any mismatch on reading raises CorruptFileError.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib

import numpy as np

MAGIC = b"KVJXHOST"
VERSION = 1
_PRE = struct.Struct("<8sII QQ".replace(" ", ""))  # magic, version, crc, offset, length
_ALIGN = 64


class CorruptFileError(ValueError):
    """The file is not a host_index container, is truncated, or fails a checksum."""


def _crc(data, crc: int = 0) -> int:
    return zlib.crc32(data, crc) & 0xFFFFFFFF


def _bytes_view(a) -> memoryview:
    """A flat byte view of a C-contiguous array or bytes (empty arrays included)."""
    if isinstance(a, np.ndarray):
        return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    return memoryview(a).cast("B")


def write(path, meta: dict, blobs) -> None:
    """Writes meta and blobs atomically.

    Args:
        path: destination file.
        meta: JSON-serializable dict, serialized after the last blob (a blob generator may
            still fill it).
        blobs: iterable of (name, parts); parts is a list of C-contiguous
            arrays or bytes written back to back as one blob.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".kvjx", dir=folder)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would make the file unreadable to other users
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * _PRE.size)
            table = {}
            pos = _PRE.size
            for name, parts in blobs:
                if name in table:
                    raise ValueError(f"duplicate blob name {name!r}")
                pad = -pos % _ALIGN
                f.write(b"\0" * pad)
                pos += pad
                crc, size = 0, 0
                for part in parts:
                    mv = _bytes_view(part)
                    crc = _crc(mv, crc)
                    f.write(mv)
                    size += mv.nbytes
                table[name] = [pos, size, crc]
                pos += size
            header = json.dumps({"meta": meta, "blobs": table}, sort_keys=True).encode()
            f.write(header)
            f.write(struct.pack("<I", _crc(header)))
            tail = struct.pack("<QQ", pos, len(header))
            f.seek(0)
            f.write(_PRE.pack(MAGIC, VERSION, _crc(tail), pos, len(header)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


class Reader:
    """Validated read access to a container written by `write`."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._f = open(self.path, "rb")
        try:
            self._open()
        except BaseException:
            self._f.close()
            raise

    def _open(self):
        size = os.fstat(self._f.fileno()).st_size
        pre = self._f.read(_PRE.size)
        if len(pre) < _PRE.size or pre[:8] != MAGIC:
            raise CorruptFileError(f"{self.path}: not a kvjax host_index file")
        _, version, crc, off, hlen = _PRE.unpack(pre)
        if version != VERSION:
            raise CorruptFileError(f"{self.path}: format version {version}, expected {VERSION}")
        if crc != _crc(pre[16:]):
            raise CorruptFileError(f"{self.path}: preamble checksum mismatch")
        if off < _PRE.size or off + hlen + 4 > size:
            raise CorruptFileError(f"{self.path}: truncated ({size} bytes, header ends at "
                                   f"{off + hlen + 4})")
        self._f.seek(off)
        header = self._f.read(hlen)
        (hcrc,) = struct.unpack("<I", self._f.read(4))
        if hcrc != _crc(header):
            raise CorruptFileError(f"{self.path}: header checksum mismatch")
        try:
            doc = json.loads(header)
            self.meta = doc["meta"]
            self._blobs = {k: (int(o), int(n), int(c)) for k, (o, n, c) in doc["blobs"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptFileError(f"{self.path}: malformed header: {e}") from e
        for name, (o, n, _) in self._blobs.items():
            if o < _PRE.size or n < 0 or o + n > off:
                raise CorruptFileError(f"{self.path}: blob {name!r} lies outside the data area")

    def close(self):
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def names(self):
        return list(self._blobs)

    def nbytes(self, name: str) -> int:
        return self._entry(name)[1]

    def _entry(self, name):
        if name not in self._blobs:
            raise CorruptFileError(f"{self.path}: blob {name!r} missing")
        return self._blobs[name]

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Reads a blob into a C-contiguous array of exactly its size, checking its crc."""
        off, n, crc = self._entry(name)
        mv = _bytes_view(out)
        if mv.nbytes != n:
            raise CorruptFileError(f"{self.path}: blob {name!r} has {n} bytes, expected "
                                   f"{mv.nbytes}")
        self._f.seek(off)
        got = self._f.readinto(mv)
        if got != n:
            raise CorruptFileError(f"{self.path}: blob {name!r} truncated")
        if _crc(mv) != crc:
            raise CorruptFileError(f"{self.path}: blob {name!r} checksum mismatch")

    def has(self, name: str) -> bool:
        """Whether the file holds a blob of that name."""
        return name in self._blobs

    def read(self, name: str) -> bytes:
        out = np.empty(self.nbytes(name), np.uint8)
        self.read_into(name, out)
        return out.tobytes()
