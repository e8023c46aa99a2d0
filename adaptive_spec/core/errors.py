"""Configuration errors reported in one line: ``NAME=value is invalid; allowed: ...; fix: ...``.

``NAME`` is what the user typed: an environment variable (``ADAPTIVE_SPEC_POLICY``), a key of a
config file, a parameter of the Python API (``policy_state``) or a command-line flag (``--policy``).

>>> str(invalid_value("--temperature", "nan", "a finite number >= 0", fix="pass e.g. --temperature 0"))
"--temperature='nan' is invalid; allowed: a finite number >= 0; fix: pass e.g. --temperature 0"
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message is one line naming it, what is allowed and the fix."""


def invalid_value(
    name: str,
    value: object,
    allowed: str,
    *,
    fix: str | None = None,
    why: str | None = None,
    cls: type[ConfigError] = ConfigError,
) -> ConfigError:
    """The :class:`ConfigError` for ``name=value`` (returned, for the caller to raise).

    Parameters
    ----------
    name : str
        The variable, key, parameter or flag, as the user wrote it.
    value : object
        The value as given (shown with ``repr``).
    allowed : str
        What is allowed, in words.
    fix : str, optional
        What to do instead.
    why : str, optional
        The specific reason, shown in parentheses after "is invalid".
    cls : type, optional
        A subclass of :class:`ConfigError` to build.
    """
    msg = f"{name}={value!r} is invalid"
    if why:
        msg += f" ({why})"
    msg += f"; allowed: {allowed}"
    if fix:
        msg += f"; fix: {fix}"
    return cls(" ".join(msg.split()))


__all__ = ["ConfigError", "invalid_value"]
