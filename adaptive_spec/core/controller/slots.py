"""Per-request slots: the row of a tracked request's acceptance history and of the safety tracker."""

from __future__ import annotations

import numpy as np

from adaptive_spec.core.safety import BaselineTracker


class RequestSlots:
    """Slots of the requests the controller tracks, and their acceptance histories.

    A request seen first gets a free slot (a released one first) with a cleared history, and the
    safety tracker's slot restarts at its output position. Per slot and proposer (``P`` of them):
    ``hist_rate`` float64 (moving average of the per-position acceptance rate), ``hist_n`` float64
    (its updates) and ``hist_b`` int64 (its history bucket,
    :data:`adaptive_spec.core.acceptance.HIST_EDGES`), kept up to date by the compiled learning
    (:func:`adaptive_spec.core.controller_kernels.learn`); rows grow by doubling.
    """

    def __init__(self, P: int) -> None:
        self.index: dict[str, int] = {}  # request id -> slot
        self._free: list[int] = []
        self._last_ids: list[str] | None = None  # the last batch's requests and their slots
        self._last_slots = np.zeros(0, dtype=np.int64)
        self.hist_rate = np.zeros((16, P))
        self.hist_n = np.zeros((16, P))
        self.hist_b = np.zeros((16, P), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.index)

    def of(self, req_ids: list[str], positions: np.ndarray, tracker: BaselineTracker) -> np.ndarray:
        """Each request's slot (int64 [N]), assigning one to a request seen first (at output
        position ``positions[i]``); the caller checks that the tracker's slots are in step with
        ``positions``."""
        if req_ids == self._last_ids:  # the same batch as the last decision: its slots
            return self._last_slots
        out = self._assign(req_ids, positions, tracker)
        self._last_ids, self._last_slots = req_ids, out
        return out

    def _assign(
        self, req_ids: list[str], positions: np.ndarray, tracker: BaselineTracker
    ) -> np.ndarray:
        out = np.empty(len(req_ids), dtype=np.int64)
        slot = self.index
        for i, rid in enumerate(req_ids):
            s = slot.get(rid)
            if s is None:
                s = self._free.pop() if self._free else len(slot)
                slot[rid] = s
                if s >= self.hist_rate.shape[0]:
                    self._grow(max(2 * self.hist_rate.shape[0], s + 1))
                self.hist_rate[s] = 0.0
                self.hist_n[s] = 0.0
                self.hist_b[s] = 0
                tracker.reset_slot(s, int(positions[i]))
            out[i] = s
        tracker.ensure(int(out.max()) + 1 if len(out) else 0)
        return out

    def _grow(self, rows: int) -> None:
        for name in ("hist_rate", "hist_n", "hist_b"):
            old = getattr(self, name)
            new = np.zeros((rows, old.shape[1]), dtype=old.dtype)
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def release(self, req_id: str, tracker: BaselineTracker) -> None:
        """Free the slot of a request that left (nothing if it had none); the tracker's slot is reset
        and its pending baseline drafts dropped."""
        s = self.index.pop(req_id, None)
        self._last_ids = None
        if s is not None:
            tracker.reset_slot(s, 0)
            self._free.append(s)
