"""Saving and loading a policy's learned state: versioned JSON, written atomically.

The file is ``{"format": "adaptive-spec-policy-state", "version": 1, "policy": name, "state": {...}}``.
It is written to a temporary file in the same directory, flushed and fsync'ed, then renamed over the
target (an atomic replace on POSIX), so a crash never leaves a half-written state. On load, a file that
is not valid JSON, has another format or version, or does not fit the policy (other proposers, max_k or
feature layout) is refused with a clear log line and the policy keeps its fresh state: it is never
half-loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path

from adaptive_spec.protocol import SpecPolicy

#: Environment variable: the directory of the automatic policy states ("off" disables them).
ENV_STATE_DIR = "ADAPTIVE_SPEC_STATE_DIR"

logger = logging.getLogger(__name__)

FORMAT = "adaptive-spec-policy-state"
VERSION = 1


def auto_state_path(
    policy: SpecPolicy, key: dict, proposers: list[str] | tuple[str, ...]
) -> Path | None:
    """Where ``AdaptiveSpec(policy_state="auto")`` keeps a learning policy's state: a file per model,
    dtype, machine, policy and proposer set in ``$ADAPTIVE_SPEC_STATE_DIR`` (default: the cache
    directory's ``state/``). None for policies that learn nothing (static, tables), or when the
    variable is ``off``."""
    import hashlib

    from adaptive_spec.machine import key_slug

    if not hasattr(policy, "acceptance"):
        return None
    env = os.environ.get(ENV_STATE_DIR, "").strip()
    if env.lower() in ("off", "none", "0", "false"):
        return None
    if env:
        base = Path(env).expanduser()
    else:
        from adaptive_spec.models import cache_dir

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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
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


def save_policy_state(policy: SpecPolicy, path: str | Path) -> None:
    """Write ``policy.state_dict()`` to ``path`` atomically (temporary file, fsync, rename)."""
    write_policy_state(policy_state_json(policy), path)


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
