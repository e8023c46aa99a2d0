"""Reports on what the controller learned: the calibration of its acceptance predictions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class CalibrationRecord:
    """The judged draft positions of one step, with what the decision predicted for them."""

    proposer: np.ndarray  # int64 [m] proposer index
    position: np.ndarray  # int64 [m] draft position, 0-based
    predicted: np.ndarray  # float64 [m] predicted conditional acceptance
    accepted: np.ndarray  # int8 [m] 1 where the position was accepted

    @classmethod
    def of(
        cls,
        alpha: np.ndarray,
        rows: np.ndarray,
        proposers: np.ndarray,
        ones: np.ndarray,
        zero: np.ndarray,
        jpos: np.ndarray,
    ) -> CalibrationRecord:
        """Every judged position of the judged rows (``rows``, ``proposers``, ``ones``, ``zero``
        int64 [m] as :func:`adaptive_spec.core.controller_kernels.learn` returns them), with the
        decision's ``alpha`` float64 [N, P, K]; ``jpos`` int64 [K], ``0..K-1``."""
        judged = jpos[None, :] < (ones + zero)[:, None]
        r_i, j_i = np.nonzero(judged)
        p = proposers[r_i]
        return cls(p, j_i, alpha[rows[r_i], p, j_i], (j_i < ones[r_i]).astype(np.int8))


def calibration_report(
    records: list[CalibrationRecord], proposers: list[str], max_k: int, bins: int = 10
) -> dict[str, Any]:
    """Predicted against observed conditional acceptance of every judged draft position in
    ``records``: per proposer, per position (mean predicted, observed rate, count) and a reliability
    table over ``bins`` equal bins of the prediction, with the expected calibration error (the
    count-weighted mean |predicted - observed| over the bins; Guo et al., "On Calibration of Modern
    Neural Networks", ICML 2017). Empty without records."""
    if not records:
        return {}
    p = np.concatenate([r.proposer for r in records])
    j = np.concatenate([r.position for r in records])
    a = np.concatenate([r.predicted for r in records])
    y = np.concatenate([r.accepted for r in records]).astype(float)
    out: dict[str, Any] = {}
    for pi, name in enumerate(proposers):
        m = p == pi
        if not m.any():
            continue
        by_pos = []
        for jj in range(max_k):
            mj = m & (j == jj)
            if mj.any():
                by_pos.append(
                    {
                        "position": jj + 1,
                        "n": int(mj.sum()),
                        "predicted": round(float(a[mj].mean()), 4),
                        "observed": round(float(y[mj].mean()), 4),
                    }
                )
        edges = np.linspace(0, 1, bins + 1)
        b = np.clip(np.searchsorted(edges, a[m], side="right") - 1, 0, bins - 1)
        rel = []
        ece = 0.0
        for k in range(bins):
            mk = b == k
            if mk.any():
                pr, ob, n = float(a[m][mk].mean()), float(y[m][mk].mean()), int(mk.sum())
                rel.append(
                    {
                        "bin": [round(edges[k], 2), round(edges[k + 1], 2)],
                        "n": n,
                        "predicted": round(pr, 4),
                        "observed": round(ob, 4),
                    }
                )
                ece += n * abs(pr - ob)
        out[name] = {
            "n": int(m.sum()),
            "by_position": by_pos,
            "reliability": rel,
            "ece": round(ece / max(int(m.sum()), 1), 4),
        }
    return out
