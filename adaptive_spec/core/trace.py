"""Step traces: one JSON line per engine step, versioned.

File layout (JSON Lines):

* line 1, the header: ``{"schema": "adaptive-spec-trace", "version": 1, "created": ISO-8601,
  "max_k": int, "proposers": [str], "feature_names": [str], "meta": {...}}``
* one line per request the first time it is seen (``"type": "request"``): ``req_id``, ``category``
  (or null), ``prompt_token_ids`` (int list), ``temperature``, ``max_tokens``;
* one line per engine step (``"type": "step"``): ``step`` (int), ``time`` (s, monotonic clock),
  ``step_time_s`` (wall time of the engine step, seconds), ``controller_time_s`` (seconds spent in the
  controller for this step), ``batch_size`` (requests in the step), ``num_verified_tokens`` (draft tokens
  verified in the step), ``num_prefill_tokens`` (prompt tokens computed in the step), ``drafter_time_s`` (seconds of the step that a draft model's pass took; 0 on other engines), ``drafter_adapters`` (whether that pass applied a LoRA adapter), ``queue_len``, ``fault`` (null or the controller error that made the step fall
  back), ``decision`` (null or the policy's facts about its decision, e.g. ``played_baseline``,
  ``probe``, ``lambda``; ``{"rest": true}`` for a rest step, in which no proposer ran and every request
  played ``none``: its rows have null ``propensity`` and ``cf_drafts`` and empty ``features``), and
  ``requests``: one object per request in the step with

  - ``req_id``; ``arm`` (``"none"`` or ``"<proposer>:<k>"``: the arm whose drafts this step verified);
  - ``drafted`` (draft tokens verified), ``accepted`` (accepted draft tokens), ``emitted`` (tokens
    committed this step, after EOS/stop/length truncation; at most accepted + 1);
  - ``emitted_token_ids`` (the committed token ids); ``num_output_before`` (output tokens before the step);
  - ``features`` (the request's context vector when the arm was chosen, names in the header);
  - ``propensity`` (probability the policy chose this arm, or null when not known exactly);
  - ``cf_drafts``: ``{proposer: [token ids]}``, the full draft (up to max_k) that every cheap proposer
    offered when the arm was chosen: with the emitted tokens this gives counterfactual acceptance;
  - ``target_argmax`` (the target's argmax at every verified position, ``drafted + 1`` ids, or null).
* a final ``{"type": "end", ...}`` line when the trace is closed normally.

Readers refuse an unknown schema or version with a clear error, and load every complete line of a
trace that was cut off mid-line (a crash while writing), reporting the cut in ``Trace.truncated``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

SCHEMA = "adaptive-spec-trace"
VERSION = 1


class TraceWriter:
    """Append step records to a JSONL trace. A write error disables tracing with a warning; it never
    raises into the engine loop.

    Parameters
    ----------
    path : str or Path
        Output file (created or truncated).
    header : dict
        Extra header fields (``max_k``, ``proposers``, ``feature_names``, ``meta``).
    """

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        self.path = Path(path)
        self.enabled = True
        self.num_records = 0
        self._f: IO[str] | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = self.path.open("w", encoding="utf-8")
        except OSError as e:
            self._disable(e)
            return
        head = {
            "schema": SCHEMA,
            "version": VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **header,
        }
        self._write(head)

    def _disable(self, err: BaseException) -> None:
        if self.enabled:
            logger.warning(
                "trace %s cannot be written (%s): tracing stopped, generation goes on",
                self.path,
                err,
            )
        self.enabled = False
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None

    def _write(self, record: dict[str, Any]) -> None:
        if not self.enabled or self._f is None:
            return
        try:
            self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
            self.num_records += 1
        except (OSError, ValueError, TypeError) as e:
            self._disable(e)

    def request(self, record: dict[str, Any]) -> None:
        """Write a ``request`` line (first sight of a request)."""
        self._write({"type": "request", **record})

    def step(self, record: dict[str, Any]) -> None:
        """Write a ``step`` line."""
        self._write({"type": "step", **record})

    def flush(self) -> None:
        if self.enabled and self._f is not None:
            try:
                self._f.flush()
            except OSError as e:
                self._disable(e)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Write the ``end`` line and close the file."""
        if self.enabled and self._f is not None:
            self._write({"type": "end", **(summary or {})})
            if self._f is not None:  # the end line itself may have failed and disabled tracing
                try:
                    self._f.close()
                except OSError as e:
                    self._disable(e)
        self._f = None
        self.enabled = False


@dataclass
class Trace:
    """A loaded trace. ``steps`` and ``requests`` hold the parsed records in file order."""

    header: dict[str, Any]
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    truncated: bool = False
    truncated_at_line: int | None = None


def read_trace(path: str | Path) -> Trace:
    """Load a trace written by :class:`TraceWriter`.

    Raises
    ------
    ValueError
        If the file is empty, its header is not an adaptive-spec trace, or its version is unknown.
    """
    path = Path(path)
    with path.open("r", encoding="utf-8") as f:
        lines = f.read().split("\n")
    if not lines or not lines[0].strip():
        raise ValueError(f"{path}: empty file, not an adaptive-spec trace")
    try:
        header = json.loads(lines[0])
    except ValueError as e:
        raise ValueError(f"{path}: the first line is not a JSON header ({e})") from None
    if not isinstance(header, dict) or header.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not an adaptive-spec trace (schema={header.get('schema')!r})")
    if header.get("version") != VERSION:
        raise ValueError(
            f"{path}: trace schema version {header.get('version')!r} is not supported; this reader reads version {VERSION}"
        )
    trace = Trace(header=header)
    body = lines[1:]
    # A file written completely ends with "\n", so the last element is "".
    for i, line in enumerate(body, start=2):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if i - 2 == len(body) - 1:  # the last, unterminated line: a cut
                trace.truncated = True
                trace.truncated_at_line = i
                logger.warning(
                    "%s: cut off at line %d; loaded %d complete steps", path, i, len(trace.steps)
                )
                break
            raise ValueError(f"{path}: line {i} is not valid JSON") from None
        kind = rec.get("type")
        if kind == "step":
            trace.steps.append(rec)
        elif kind == "request":
            trace.requests[rec["req_id"]] = rec
        elif kind == "end":
            trace.end = rec
    if trace.end is None and not trace.truncated:
        trace.truncated = True
    return trace
