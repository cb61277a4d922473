"""Per-device tuning tables: the data that says how fast kernels run.

A family's shipped table is a JSON file beside this module (``gemv.json``,
``flash_decode.json``): an ordered list of rules, each ``{"match": {...},
"config": {...}}``.  Every rule whose ``match`` holds for a call applies, in
order, later rules overriding earlier ones, so a table reads from the
general to the particular.  A condition is ``key: value`` (equal), ``key:
[values]`` (one of), or ``key_min`` / ``key_max`` / ``key_multiple`` on a
number; a condition on a value the call does not know (``m=None``) fails.
The call always knows ``sm`` (the target's compute capability, e.g. 90) and
``target``, so rules can be keyed by device.

``python -m ptxgen tune`` measures configs on the present GPU and stores the
winners in the user's cache, ``$PTXGEN_CACHE_DIR/tuning/<family>.json``
(default ``~/.cache/ptxgen``), keyed by device name and call; a family's
selector prefers such an entry over the shipped table.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib

__all__ = ["load_table", "matches", "cascade", "cache_dir", "user_config", "store_user_config",
           "call_key"]

_HERE = pathlib.Path(__file__).parent


@functools.lru_cache(maxsize=None)
def load_table(family: str) -> tuple:
    """The shipped rules of ``family`` (a tuple of ``(match, config)``)."""
    path = _HERE / f"{family}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no tuning table for kernel family {family!r} ({path})") from None
    rules = []
    for i, r in enumerate(data["rules"]):
        if set(r) - {"match", "config", "why"}:
            raise ValueError(f"{path}: rule {i} has unknown keys {sorted(set(r) - {'match', 'config', 'why'})}")
        rules.append((dict(r.get("match", {})), dict(r["config"])))
    return tuple(rules)


def matches(cond: dict, call: dict) -> bool:
    """Whether every condition of ``cond`` holds for ``call``."""
    for key, want in cond.items():
        for suffix, test in (("_min", lambda v, w: v >= w), ("_max", lambda v, w: v <= w),
                             ("_multiple", lambda v, w: v % w == 0)):
            if key.endswith(suffix):
                base = key[:-len(suffix)]
                if base not in call:
                    raise ValueError(f"tuning rule tests unknown call key {base!r}")
                v = call[base]
                if v is None or not test(v, want):
                    return False
                break
        else:
            if key not in call:
                raise ValueError(f"tuning rule tests unknown call key {key!r}")
            v = call[key]
            if isinstance(want, list):
                if v not in want:
                    return False
            elif v != want:
                return False
    return True


def cascade(family: str, call: dict) -> dict:
    """The fields every matching rule of ``family``'s table sets, in order."""
    out = {}
    for cond, cfg in load_table(family):
        if matches(cond, call):
            out.update(cfg)
    return out


def cache_dir() -> pathlib.Path:
    """``$PTXGEN_CACHE_DIR`` or ``~/.cache/ptxgen``."""
    return pathlib.Path(os.environ.get("PTXGEN_CACHE_DIR") or
                        pathlib.Path.home() / ".cache" / "ptxgen")


def call_key(call: dict) -> str:
    """The user cache's key for a call: its items in a fixed order."""
    return ",".join(f"{k}={call[k]}" for k in sorted(call))


def _user_file(family: str) -> pathlib.Path:
    return cache_dir() / "tuning" / f"{family}.json"


def user_config(family: str, device: str | None, call: dict) -> dict | None:
    """The config ``python -m ptxgen tune`` stored for ``call`` on ``device``
    (a device name), or None."""
    if not device:
        return None
    path = _user_file(family)
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    entry = data.get(device, {}).get(call_key(call))
    return dict(entry["config"]) if entry else None


def store_user_config(family: str, device: str, call: dict, config: dict, meta: dict) -> pathlib.Path:
    """Record ``config`` (with ``meta``: timings, date) for ``call`` on
    ``device`` in the user cache, atomically; returns the file."""
    path = _user_file(family)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        data = {}
    data.setdefault(device, {})[call_key(call)] = {"config": config, **meta}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path
