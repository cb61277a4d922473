"""Module cache: keys, the in-process level, and the on-disk cubin store.

Pure Python (no CUDA calls): :mod:`ptxgen.driver.module` compiles the cubin
with ptxas (:func:`ptxgen.driver.jit.compile_cubin`) and hands the bytes here;
without ptxas nothing is stored (the driver's JIT keeps its own cache).

On disk, one directory per key under ``$PTXGEN_CACHE_DIR`` (default
``~/.cache/ptxgen``, or ``$XDG_CACHE_HOME/ptxgen``)::

    <root>/cubin/<key>/module.cubin   header + cubin bytes
    <root>/cubin/<key>/meta.json      what the key was made of (for people)

``module.cubin`` starts with a 56-byte header: the magic ``b"PTXGENCUBIN\\0"``,
the format version (u32), the payload length (u64) and the payload's SHA-256.
A short file, a bad magic/version, a length or digest mismatch is a corrupt
entry: :meth:`DiskCache.get` deletes it and returns None so the caller
rebuilds. Writes go to a temporary file in the same directory, are fsync'ed
and renamed over the target with ``os.replace`` (atomic on POSIX).
``PTXGEN_NO_CACHE=1`` bypasses both levels.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
import threading
from pathlib import Path

__all__ = [
    "CACHE_FORMAT",
    "CorruptCacheEntry",
    "DiskCache",
    "MemoryCache",
    "cache_dir",
    "cache_enabled",
    "decode_entry",
    "disk_key",
    "encode_entry",
    "module_key",
    "ptx_hash",
]

#: 2: cubins from ptxas, whole programs (1: from the driver's linker, relocatable)
CACHE_FORMAT = 2
MAGIC = b"PTXGENCUBIN\0"
_HEADER = struct.Struct("<12sIQ32s")
HEADER_SIZE = _HEADER.size  # 56
_ENTRY_FILE = "module.cubin"
_META_FILE = "meta.json"


class CorruptCacheEntry(ValueError):
    """An on-disk cache entry failed its header, length or digest check."""


def cache_dir() -> Path:
    """Root of the on-disk cache: ``$PTXGEN_CACHE_DIR``, else ``~/.cache/ptxgen``."""
    env = os.environ.get("PTXGEN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "ptxgen"


def cache_enabled() -> bool:
    """False when ``PTXGEN_NO_CACHE`` is set to 1/true/yes/on."""
    return os.environ.get("PTXGEN_NO_CACHE", "").strip().lower() not in ("1", "true", "yes", "on")


def _text_bytes(ptx) -> bytes:
    return ptx.encode() if isinstance(ptx, str) else bytes(ptx)


def ptx_hash(ptx) -> str:
    """SHA-256 hex digest of the PTX text (str or bytes)."""
    return hashlib.sha256(_text_bytes(ptx)).hexdigest()


def _options_repr(options) -> str:
    items = sorted(dict(options or {}).items())
    return json.dumps(items, separators=(",", ":"))


def module_key(ptx, options=None) -> str:
    """In-process key: SHA-256 of the PTX text and the JIT options."""
    h = hashlib.sha256(_text_bytes(ptx))
    h.update(b"\0options\0" + _options_repr(options).encode())
    return h.hexdigest()


def disk_key(ptx, arch: str, driver_version: int, options=None, version: str | None = None,
             compiler: str = "") -> str:
    """On-disk key, hashing everything that changes the cubin.

    Parameters
    ----------
    ptx : str or bytes
        PTX text.
    arch : str
        Device target, e.g. ``"sm_90"``.
    driver_version : int
        ``cuDriverGetVersion`` (the JIT lives in the driver).
    options : dict, optional
        JIT options.
    version : str, optional
        ptxgen version; defaults to ``ptxgen.__version__``.
    compiler : str
        What compiled the cubin: ptxas's release line.
    """
    if version is None:
        import ptxgen

        version = ptxgen.__version__
    fields = {
        "format": CACHE_FORMAT,
        "ptxgen": version,
        "ptx_sha256": ptx_hash(ptx),
        "arch": arch,
        "driver": int(driver_version),
        "options": _options_repr(options),
        "compiler": compiler,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def encode_entry(payload: bytes) -> bytes:
    """Header + payload, the exact bytes of a ``module.cubin`` file."""
    payload = bytes(payload)
    return _HEADER.pack(MAGIC, CACHE_FORMAT, len(payload), hashlib.sha256(payload).digest()) + payload


def decode_entry(data: bytes) -> bytes:
    """The payload of a ``module.cubin`` file.

    Raises
    ------
    CorruptCacheEntry
        Short file, bad magic or version, wrong length, or digest mismatch.
    """
    if len(data) < HEADER_SIZE:
        raise CorruptCacheEntry(f"short file: {len(data)} bytes, header needs {HEADER_SIZE}")
    magic, fmt, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptCacheEntry(f"bad magic {magic!r}")
    if fmt != CACHE_FORMAT:
        raise CorruptCacheEntry(f"format {fmt}, expected {CACHE_FORMAT}")
    payload = data[HEADER_SIZE:]
    if len(payload) != length:
        raise CorruptCacheEntry(f"payload is {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCacheEntry("payload digest mismatch")
    return payload


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class DiskCache:
    """The on-disk cubin store (see the module docstring for the layout).

    Parameters
    ----------
    root : path-like, optional
        Defaults to :func:`cache_dir`.

    Attributes
    ----------
    corrupt_count : int
        Number of corrupt entries found (and removed) by this instance.
    """

    __slots__ = ("root", "corrupt_count")

    def __init__(self, root=None):
        self.root = Path(root) if root is not None else cache_dir()
        self.corrupt_count = 0

    def entry_dir(self, key: str) -> Path:
        """Directory that holds the entry for ``key``."""
        return self.root / "cubin" / key

    def entry_path(self, key: str) -> Path:
        """Path of the ``module.cubin`` file for ``key``."""
        return self.entry_dir(key) / _ENTRY_FILE

    def get(self, key: str) -> bytes | None:
        """Payload for ``key``, or None when absent or corrupt (a corrupt entry is removed)."""
        path = self.entry_path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError:
            return None
        try:
            return decode_entry(data)
        except CorruptCacheEntry:
            self.corrupt_count += 1
            self.invalidate(key)
            return None

    def put(self, key: str, payload: bytes, meta: dict | None = None) -> Path | None:
        """Store ``payload`` atomically; returns the file path, or None if the disk refused."""
        d = self.entry_dir(key)
        try:
            d.mkdir(parents=True, exist_ok=True)
            if meta is not None:
                _atomic_write(d / _META_FILE, json.dumps(meta, indent=1, sort_keys=True).encode())
            path = d / _ENTRY_FILE
            _atomic_write(path, encode_entry(payload))
            return path
        except OSError:
            return None  # a read-only or full disk must not break loading

    def invalidate(self, key: str) -> None:
        """Remove the entry for ``key`` (no error if absent)."""
        shutil.rmtree(self.entry_dir(key), ignore_errors=True)

    def clear(self) -> None:
        """Remove every cubin entry under this root."""
        shutil.rmtree(self.root / "cubin", ignore_errors=True)


class MemoryCache:
    """Thread-safe in-process map ``(device ordinal, module key) -> Module``."""

    __slots__ = ("_items", "_lock")

    def __init__(self):
        self._items: dict = {}
        self._lock = threading.Lock()

    def get(self, key):
        """The cached object or None."""
        return self._items.get(key)

    def put(self, key, value):
        """Insert unless present; returns the object that is now cached."""
        with self._lock:
            return self._items.setdefault(key, value)

    def pop(self, key, value=None):
        """Remove ``key`` (only if it maps to ``value`` when given)."""
        with self._lock:
            if key in self._items and (value is None or self._items[key] is value):
                del self._items[key]

    def clear(self):
        """Forget everything (modules stay loaded while referenced elsewhere)."""
        with self._lock:
            self._items.clear()

    def __len__(self):
        return len(self._items)


memory_cache = MemoryCache()
