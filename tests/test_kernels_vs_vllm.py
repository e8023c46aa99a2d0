"""The reference verification agrees with vLLM's own rejection sampler (greedy exactly,
stochastic in distribution).

vLLM 0.32's ``vllm.v1.sample.rejection_sampler.rejection_sample`` takes the same flattened
layout (drafts back to back, inclusive cumulative counts) but the target logits without the
bonus rows, already divided by the temperature, and the bonus tokens sampled beforehand. It
runs in a subprocess: on the CPU build its Triton kernels are replaced by C++ overrides that
are registered process-wide, which must happen once per process.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch
from adaptive_spec.kernels import flatten_drafts, verify
from scipy.stats import chi2_contingency

pytestmark = pytest.mark.vllm

CHILD = r"""
import sys
import torch
from vllm.platforms import current_platform
from vllm.triton_utils import dispatcher
if "vllm.v1.sample.rejection_sampler.rejection_greedy_sample_kernel" not in dispatcher._registry:
    current_platform.register_triton_kernel_overrides()
import vllm.v1.sample.rejection_sampler as rs
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.logits_processor import LogitsProcessors

torch.manual_seed(1234)
outs = []
for case in torch.load(sys.argv[1]):
    b = len(case["num_draft"])
    greedy = case["temperature"] is None
    md = SamplingMetadata(
        temperature=None if greedy else case["temperature"],
        all_greedy=greedy, all_random=not greedy, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(b), presence_penalties=torch.zeros(b),
        repetition_penalties=torch.ones(b), output_token_ids=[[] for _ in range(b)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )
    outs.append(rs.rejection_sample(
        case["draft"].to(torch.int32), case["num_draft"], case["max_spec_len"],
        case["cu"].to(torch.int32), case["draft_probs"], case["target_logits"],
        case["bonus"], md,
    ))
torch.save(outs, sys.argv[2])
"""


def _bonus_rows(cu: torch.Tensor) -> torch.Tensor:
    return cu + torch.arange(cu.shape[0])


def _run_vllm(cases: list[dict], tmp_path) -> list[torch.Tensor]:
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(cases, src)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(dst)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(dst)


def _greedy_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(0, 6, (24,), generator=g).tolist()
    ks[0] = 0
    vocab = 97
    drafts = [torch.randint(0, vocab, (k,), generator=g) for k in ks]
    d, cu = flatten_drafts(drafts)
    logits = torch.randn(d.numel() + len(ks), vocab, generator=g)
    am = logits.argmax(-1)
    bonus_rows = _bonus_rows(cu)
    target_rows = torch.ones(logits.shape[0], dtype=torch.bool)
    target_rows[bonus_rows] = False
    # copy the target argmax into about 70 % of the draft positions
    keep = torch.rand(d.numel(), generator=g) < 0.7
    d = torch.where(keep, am[target_rows], d)
    return logits, d, cu, ks, target_rows, bonus_rows


def _stochastic_case(seed: int, n: int, vocab: int, k: int, with_q: bool, temperature: float):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(k + 1, vocab, generator=g) * 1.5
    q = torch.softmax(torch.randn(k, vocab, generator=g), -1)
    if with_q:
        draws = [torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)]
    else:
        draws = [torch.full((n,), int(q[j].argmax())) for j in range(k)]
    d = torch.stack(draws, 1).reshape(-1)
    logits = base.repeat(n, 1)
    cu = torch.arange(1, n + 1) * k
    p_bonus = torch.softmax(base[k] / temperature, -1)
    bonus = torch.multinomial(p_bonus, n, replacement=True, generator=g)
    return logits, d, cu, (q.repeat(n, 1) if with_q else None), bonus


def _histograms(a: torch.Tensor, b: torch.Tensor) -> tuple[list[int], list[int]]:
    ca = Counter(tuple(r[r >= 0].tolist()) for r in a)
    cb = Counter(tuple(r[r >= 0].tolist()) for r in b)
    keys = sorted(set(ca) | set(cb))
    rows_a, rows_b, rare_a, rare_b = [], [], 0, 0
    for key in keys:
        if ca[key] + cb[key] < 20:  # pool rare outcomes into one cell
            rare_a += ca[key]
            rare_b += cb[key]
        else:
            rows_a.append(ca[key])
            rows_b.append(cb[key])
    if rare_a + rare_b:
        rows_a.append(rare_a)
        rows_b.append(rare_b)
    return rows_a, rows_b


N, VOCAB, K, TEMP = 20_000, 5, 3, 0.9


def _stochastic_vllm_case(with_q: bool):
    logits, d, cu, q, bonus = _stochastic_case(7 if with_q else 8, N, VOCAB, K, with_q, TEMP)
    bonus_rows = _bonus_rows(cu)
    target_rows = torch.ones(logits.shape[0], dtype=torch.bool)
    target_rows[bonus_rows] = False
    case = dict(
        draft=d,
        num_draft=[K] * N,
        max_spec_len=K,
        cu=cu,
        draft_probs=q,
        target_logits=logits[target_rows] / TEMP,
        bonus=bonus[:, None],
        temperature=torch.full((N,), TEMP),
    )
    return case, (logits, d, cu, q)


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    """All cases through vLLM in one subprocess (importing vLLM takes seconds)."""
    greedy_cases, greedy_ours = [], []
    for seed in range(3):
        logits, d, cu, ks, target_rows, bonus_rows = _greedy_case(seed)
        max_k = max(ks)
        greedy_cases.append(
            dict(
                draft=d,
                num_draft=ks,
                max_spec_len=max_k,
                cu=cu,
                draft_probs=None,
                target_logits=logits[target_rows],
                bonus=logits[bonus_rows].argmax(-1, keepdim=True),
                temperature=None,
            )
        )
        greedy_ours.append(verify(logits, d, cu, max_k=max_k))
    stoch = {wq: _stochastic_vllm_case(wq) for wq in (True, False)}
    outs = _run_vllm(
        [*greedy_cases, stoch[True][0], stoch[False][0]], tmp_path_factory.mktemp("vllm")
    )
    return {
        "greedy": list(zip(greedy_ours, outs[:3], strict=True)),
        True: (stoch[True][1], outs[3]),
        False: (stoch[False][1], outs[4]),
    }


def test_greedy_matches_vllm_exactly(vllm_runs) -> None:
    for mine, theirs in vllm_runs["greedy"]:
        assert torch.equal(mine.output_token_ids, theirs.to(torch.int64))


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
def test_stochastic_matches_vllm_in_distribution(vllm_runs, with_q: bool) -> None:
    (logits, d, cu, q), theirs = vllm_runs[with_q]
    seeds = torch.randint(0, 2**62, (N,), generator=torch.Generator().manual_seed(99))
    mine = verify(logits, d, cu, draft_probs=q, temperature=torch.full((N,), TEMP), seeds=seeds)
    a, b = _histograms(mine.output_token_ids, theirs.to(torch.int64))
    assert len(a) >= 5
    res = chi2_contingency([a, b])
    assert res.pvalue > 1e-3, (res, a, b)
    # same acceptance-length distribution, checked on its own as well
    acc_mine = torch.bincount(mine.num_accepted, minlength=K + 1)
    acc_theirs = torch.bincount((theirs >= 0).sum(1) - 1, minlength=K + 1)
    seen = (acc_mine + acc_theirs) > 0
    assert chi2_contingency([acc_mine[seen].tolist(), acc_theirs[seen].tolist()]).pvalue > 1e-3


def test_the_comparison_has_power(vllm_runs) -> None:
    """vLLM's stochastic outputs differ in distribution from a greedy run on the same inputs."""
    (logits, d, cu, q), theirs = vllm_runs[True]
    greedy = verify(logits, d, cu, draft_probs=q)
    a, b = _histograms(greedy.output_token_ids, theirs.to(torch.int64))
    assert chi2_contingency([a, b]).pvalue < 1e-6
