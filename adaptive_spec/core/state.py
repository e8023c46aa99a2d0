"""Saving and loading a policy's learned state: versioned JSON, written atomically.

The file is ``{"format": "adaptive-spec-policy-state", "version": 1, "policy": name, "state": {...}}``.
It is written to a temporary file in the same directory, flushed and fsync'ed, then renamed over the
target (an atomic replace on POSIX), so a crash never leaves a half-written state. On load, a file that
is not valid JSON, has another format or version, or does not fit the policy (other proposers, max_k or
feature layout) is refused with a clear log line and the policy keeps its fresh state: it is never
half-loaded; :func:`load_or_set_aside` then moves the refused file to ``<file>.refused-<unix time>`` so
that the next save does not overwrite it. :func:`prepare_state_path`, called before anything starts,
checks that the file can be written (its directory exists or can be created, and a temporary file can be
created there) and removes the temporary files a killed write left behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from adaptive_spec.core.errors import ConfigError, invalid_value
from adaptive_spec.core.protocol import SpecPolicy

#: Environment variable: the directory of the automatic policy states ("off" disables them).
ENV_STATE_DIR = "ADAPTIVE_SPEC_STATE_DIR"

logger = logging.getLogger(__name__)

FORMAT = "adaptive-spec-policy-state"
VERSION = 1
#: ``tempfile.mkstemp``'s random part: 8 characters from ``tempfile._RandomNameSequence.characters``.
_TEMP_RANDOM = r"[a-z0-9_]{8}"


class StatePathError(ConfigError):
    """A policy-state path where the state cannot be written (named in the message, with the fix)."""


class StateSaveError(OSError):
    """Writing the policy state failed; the message names the path, the cause and the fix."""


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def auto_state_path(
    policy: SpecPolicy, key: dict, proposers: list[str] | tuple[str, ...]
) -> Path | None:
    """Where ``AdaptiveSpec(policy_state="auto")`` keeps a learning policy's state: a file per model,
    dtype, machine, policy and proposer set in ``$ADAPTIVE_SPEC_STATE_DIR`` (default: the cache
    directory's ``state/``). None for policies that learn nothing (static, tables), or when the
    variable is ``off``."""
    import hashlib

    from adaptive_spec.core.machine import key_slug

    if not hasattr(policy, "acceptance"):
        return None
    env = os.environ.get(ENV_STATE_DIR, "").strip()
    if env.lower() in ("off", "none", "0", "false"):
        return None
    if env:
        base = Path(env).expanduser()
    else:
        from adaptive_spec.core.paths import cache_dir

        base = cache_dir() / "state"
    props = "-".join(p.replace(":", "_") for p in proposers if p != "none") or "none"
    if len(props) > 60:
        props = hashlib.sha256(props.encode()).hexdigest()[:12]
    return base / f"{policy.name}-{key_slug(key)}-{props}.json"


def policy_state_json(policy: SpecPolicy) -> str:
    """Serialise ``policy.state_dict()`` into the versioned JSON document (no I/O; a fraction of a
    millisecond for the default controller), to be written later by :func:`write_policy_state`."""
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "policy": policy.name,
        "state": policy.state_dict(),
    }
    return json.dumps(payload)


def write_policy_state(data: str, path: str | Path) -> None:
    """Write a document from :func:`policy_state_json` to ``path`` atomically (temporary file in the
    same directory, fsync, rename, fsync of the directory). Raises ``OSError`` when it cannot write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def save_policy_state(policy: SpecPolicy, path: str | Path, name: str = "policy_state") -> None:
    """Write ``policy.state_dict()`` to ``path`` atomically (temporary file, fsync, rename).

    Raises
    ------
    StateSaveError
        When the file cannot be written; the message names ``name``, the path and the fix. The file
        already at ``path`` (if any) is left as it was.
    """
    try:
        write_policy_state(policy_state_json(policy), path)
    except OSError as e:
        raise StateSaveError(
            f"{name}={str(path)!r}: the policy state cannot be written ({type(e).__name__}: {e}); "
            "fix: give a file path in a writable directory"
        ) from e


def check_writable_path(path: str | Path, name: str) -> Path:
    """Check that a file can be written at ``path``: it is not a directory, its directory exists (it is
    created if needed) and a temporary file can be created there (then removed).

    Parameters
    ----------
    path : path
        The file (it need not exist yet).
    name : str
        The setting's name as the user gave it (``ADAPTIVE_SPEC_STATE``, ``--state``, ``trace``, ...).

    Raises
    ------
    StatePathError
        A :class:`~adaptive_spec.core.errors.ConfigError` naming ``name``, the path, the cause and the fix.
    """
    path = Path(path)
    allowed = "a file path in a directory that exists or can be created, and is writable"
    if path.is_dir():
        raise invalid_value(
            name,
            str(path),
            allowed,
            why="it is a directory",
            fix=f"name a file, e.g. {path / 'policy.json'}",
            cls=StatePathError,
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(prefix=_temp_prefix(path), dir=path.parent):
            pass
    except OSError as e:
        raise invalid_value(
            name,
            str(path),
            allowed,
            why=f"cannot write in {path.parent}: {type(e).__name__}: {e.strerror or e}",
            fix="give a path in a writable directory (or fix the directory's permissions)",
            cls=StatePathError,
        ) from None
    return path


def prepare_state_path(path: str | Path, name: str = "policy_state") -> list[Path]:
    """Make sure the policy state can be saved at ``path`` (:func:`check_writable_path`), before anything
    expensive starts, and remove the temporary files that an interrupted :func:`write_policy_state`
    left next to it (:func:`remove_stale_temp_files`).

    Returns
    -------
    list of Path
        The stale temporary files removed.

    Raises
    ------
    StatePathError
        When ``path`` is a directory, or its directory cannot be created or written.
    """
    return remove_stale_temp_files(check_writable_path(path, name))


def remove_stale_temp_files(path: str | Path) -> list[Path]:
    """Remove the temporary files (``.<name>.<8 random characters>``) that a write of ``path`` killed
    between creating its temporary file and renaming it left behind. Call it while no other process
    writes ``path``. Returns the files removed."""
    path = Path(path)
    pattern = re.compile(re.escape(_temp_prefix(path)) + _TEMP_RANDOM)
    removed = []
    with contextlib.suppress(OSError):
        for p in path.parent.iterdir():
            if pattern.fullmatch(p.name) and p.is_file():
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed.append(p)
    if removed:
        logger.info(
            "policy state %s: removed %d stale temporary file(s) of an interrupted save: %s",
            path,
            len(removed),
            ", ".join(p.name for p in removed),
        )
    return removed


def set_aside(path: str | Path) -> Path:
    """Rename ``path`` to ``<path>.refused-<unix time>`` (``-1``, ``-2``, ... if taken) and return the new
    path. Raises ``OSError`` when it cannot be renamed."""
    path = Path(path)
    stamp = int(time.time())
    aside = path.with_name(f"{path.name}.refused-{stamp}")
    n = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.refused-{stamp}-{n}")
        n += 1
    os.replace(path, aside)
    return aside


def load_or_set_aside(policy: SpecPolicy, path: str | Path, name: str = "policy_state") -> bool:
    """Load the state file at ``path`` into ``policy`` if it exists (:func:`load_policy_state`). A file
    that is refused is moved aside (:func:`set_aside`), so that saving later never overwrites it.

    Returns
    -------
    bool
        True when loaded; False when there was no file or it was refused (``policy`` stays fresh).

    Raises
    ------
    StatePathError
        When a refused file cannot be moved aside (the state would be overwritten at the next save).
    """
    path = Path(path)
    if not path.exists():
        return False
    if load_policy_state(policy, path):
        return True
    try:
        aside = set_aside(path)
    except OSError as e:
        raise StatePathError(
            f"{name}={str(path)!r} was refused (reason logged above) and cannot be moved aside "
            f"({type(e).__name__}: {e}); fix: move or delete it, or give another path"
        ) from None
    logger.warning(
        "policy state %s refused (reason logged above), kept as %s; the controller starts fresh",
        path,
        aside,
    )
    return False


def load_policy_state(policy: SpecPolicy, path: str | Path) -> bool:
    """Load a state file into ``policy``. Returns True when loaded; False (with a warning naming the
    reason) when the file is missing, corrupt or incompatible, leaving ``policy`` unchanged."""
    path = Path(path)
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as e:
        logger.warning("policy state %s refused: not readable JSON (%s); starting fresh", path, e)
        return False
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        logger.warning(
            "policy state %s refused: not an adaptive-spec policy state; starting fresh", path
        )
        return False
    if payload.get("version") != VERSION:
        logger.warning(
            "policy state %s refused: version %r, this build reads %d; starting fresh",
            path,
            payload.get("version"),
            VERSION,
        )
        return False
    if payload.get("policy") != policy.name:
        logger.warning(
            "policy state %s refused: saved by policy %r, this engine runs %r; starting fresh",
            path,
            payload.get("policy"),
            policy.name,
        )
        return False
    try:
        policy.load_state_dict(payload["state"])
    except (KeyError, TypeError, ValueError) as e:
        logger.warning("policy state %s refused: incompatible (%s); starting fresh", path, e)
        return False
    logger.info("policy state loaded from %s", path)
    return True


# -- a state file shared by several replicas ------------------------------------------------------
def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _combine(a: object, b: object, sign: int) -> object:
    """``a + sign * b`` on the numbers of two documents of the same layout (dicts by key, lists of the
    same length element by element); anything else, or a layout that differs, keeps ``a``."""
    if _number(a) and _number(b):
        out = a + sign * b  # type: ignore[operator]
        return int(out) if isinstance(a, int) and isinstance(b, int) else out
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _combine(v, b[k], sign) if k in b else v for k, v in a.items()}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [_combine(x, y, sign) for x, y in zip(a, b, strict=True)]
    return a


def combine_states(a: dict, b: dict, sign: int) -> dict:
    """``a + sign * b`` on the numbers of two state documents of the same layout (anything else keeps
    ``a``'s value): the difference of two states, or a state plus a difference."""
    return _combine(a, b, sign)  # type: ignore[return-value]


def has_nonzero(doc: object) -> bool:
    """Whether a state difference has a number other than 0."""
    if _number(doc):
        return doc != 0
    if isinstance(doc, dict):
        return any(has_nonzero(v) for v in doc.values())
    if isinstance(doc, list):
        return any(has_nonzero(v) for v in doc)
    return False


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def state_file_lock(path: str | Path):
    """An exclusive lock on the state file ``path`` across processes (``fcntl.flock`` on the sibling
    file ``.<name>.lock``, created if needed; released when the block ends, or by the kernel when the
    process dies). Blocks until it is free. Raises ``OSError`` when the lock file cannot be opened."""
    import fcntl

    lock = _lock_path(Path(path))
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _scalar(v: object) -> bool:
    return v is None or isinstance(v, (str, bool))


def _same_layout(a: object, b: object, indexed: bool = False) -> bool:
    """Whether two state documents have the same layout, so that their difference (:func:`_combine`)
    is a difference of counts: the same keys, list lengths and kinds of value, and the same
    non-number values inside lists (the names the numbers are indexed by, e.g. the proposers).
    A dict's own strings and flags (a cost table's ``source``, which learning changes) may
    differ: they are carried, not differenced."""
    if _number(a) and _number(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_layout(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_layout(x, y, True) for x, y in zip(a, b, strict=True))
    if _scalar(a) and _scalar(b):
        return a == b or not indexed
    return False


@dataclass(frozen=True)
class MergeResult:
    """What :func:`sync_policy_state` did to the shared state file.

    Attributes
    ----------
    mine : dict
        The ``state`` part this process pushed (its next ``base``, unless it takes ``others`` in).
    merged : dict
        The file's ``state`` after the merge (the next ``seen``).
    others : dict or None
        What the other writers added to the file since ``seen``: ``file - seen`` before this merge,
        number by number; None when that is not known (no usable file, no ``seen``, another layout).
    """

    mine: dict
    merged: dict
    others: dict | None


def sync_policy_state(
    data: str, path: str | Path, base: dict | None, seen: dict | None
) -> MergeResult:
    """Add what this process learned to the state file ``path`` that other processes (data-parallel
    replicas, other servers) write too, so that no one's update is lost (the push), and say what the
    others added since this process last saw the file (the pull).

    Under :func:`state_file_lock`, the file's state becomes ``file + (mine - base)`` on every number of
    the state (:func:`_combine`): ``mine`` is the document ``data`` (from :func:`policy_state_json`),
    ``base`` the state this process had already contributed (or loaded) when it last merged: so counts
    add up across writers instead of the last writer's overwriting the others', and a number this
    process did not change keeps the file's value. Without a usable file (missing, corrupt, another
    format, version or policy, another layout) the file becomes ``mine``. Written atomically
    (:func:`write_policy_state`).

    Parameters
    ----------
    data : str
        This process's current document (:func:`policy_state_json`).
    path : path
        The shared state file.
    base : dict or None
        The ``state`` part this process contributed at its previous merge, or, before its first
        merge, the one it started from (its fresh or just-loaded ``policy.state_dict()``). None: no
        known start, the file becomes ``mine`` (an overwrite; pass a base to merge).
    seen : dict or None
        The file's ``state`` as this process last saw it (the ``merged`` of its previous merge, or
        the file it loaded, or its fresh state when there was none). None: no pull.

    Returns
    -------
    MergeResult

    Raises
    ------
    OSError
        When the lock or the file cannot be written (the file is left as it was).
    """
    path = Path(path)
    mine = json.loads(data)
    state = mine["state"]
    with state_file_lock(path):
        disk = None
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            if (
                isinstance(doc, dict)
                and doc.get("format") == FORMAT
                and doc.get("version") == VERSION
                and doc.get("policy") == mine.get("policy")
                and isinstance(doc.get("state"), dict)
            ):
                disk = doc["state"]
        except (OSError, ValueError):
            disk = None
        merged = state
        if disk is not None and base is not None:
            merged = _combine(disk, _combine(state, base, -1), +1)
            write_policy_state(json.dumps(dict(mine, state=merged)), path)
        else:
            write_policy_state(data, path)
    others = None
    if disk is not None and seen is not None and _same_layout(disk, seen):
        others = _combine(disk, seen, -1)
    return MergeResult(mine=state, merged=merged, others=others)  # type: ignore[arg-type]


def merge_policy_state(data: str, path: str | Path, base: dict | None) -> dict:
    """The push of :func:`sync_policy_state` alone: returns the ``state`` part of ``data`` (the
    caller's next ``base``)."""
    return sync_policy_state(data, path, base, None).mine


def read_state_part(path: str | Path) -> dict | None:
    """The ``state`` part of the state file at ``path``, or None when it is missing or not a state."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None
    state = doc.get("state")
    return state if isinstance(state, dict) else None
