"""The sampler shortcuts of ``adaptive_spec.vllm.sampling`` against vLLM's own rejection sampler.

A step without draft tokens sampled by :func:`sample_without_drafts` gives exactly the tokens vLLM's
``RejectionSampler.forward`` gives from the same random state (greedy, sampled, and a request with its
own generator): the bonus token is drawn first in both, and the rejection sampler draws nothing else
that reaches the output. A greedy step with drafts verified by :func:`verify_greedy` emits exactly
vLLM's tokens on bfloat16 logits with tied maxima, and every step it does not cover is left to vLLM.
The recovered tokens of :func:`fix_recovered_token_sampling`
(:func:`recovered_tokens`, inverse transform from one uniform per draft position) follow the residual
distribution ``max(p - q, 0) / Z``: chi-square against the exact probabilities, and against the tokens of
vLLM's own function on the same inputs. vLLM's parts run in a subprocess: vLLM's CPU kernel overrides are registered
process-wide.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaptive_spec.vllm.sampling import recovered_tokens

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM's CPU build is not installed (pip install -e '.[cpu]')")

CHILD = r"""
import json
import torch
from vllm.platforms import current_platform
from vllm.triton_utils import dispatcher
if "vllm.v1.sample.rejection_sampler.rejection_greedy_sample_kernel" not in dispatcher._registry:
    current_platform.register_triton_kernel_overrides()
import vllm.v1.sample.rejection_sampler as rs
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from adaptive_spec.vllm.cpu_fixes import fix_cpu_expand_kernel
from adaptive_spec.vllm.sampling import (
    fix_recovered_token_sampling, sample_without_drafts, verify_greedy,
)

sampler = Sampler()
rej = rs.RejectionSampler(sampler)  # before the expand fix: its constructor warms vLLM's launcher up
fix_cpu_expand_kernel()
B, V = 6, 211


def sampling(temperature, generators=None):
    greedy = temperature is None
    return SamplingMetadata(
        temperature=None if greedy else torch.full((B,), temperature),
        all_greedy=greedy, all_random=not greedy, top_p=None, top_k=None,
        generators=generators or {}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(B),
        presence_penalties=torch.zeros(B), repetition_penalties=torch.ones(B),
        output_token_ids=[[] for _ in range(B)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )


def no_drafts():
    z = torch.zeros(B, dtype=torch.int32)
    return SpecDecodeMetadata(
        draft_token_ids=torch.zeros(0, dtype=torch.int32), num_draft_tokens=[0] * B,
        cu_num_draft_tokens=z, cu_num_sampled_tokens=torch.arange(1, B + 1, dtype=torch.int32),
        target_logits_indices=torch.zeros(0, dtype=torch.int32),
        bonus_logits_indices=torch.arange(B, dtype=torch.int32),
        logits_indices=torch.arange(B, dtype=torch.int32),
    )


out = {}
g = torch.Generator().manual_seed(5)
for name, temp, seeded in (("greedy", None, False), ("t1.3_seeded", 1.3, True)):
    same = []
    for trial in range(20):
        logits = torch.randn(B, V, generator=g) * 2.0
        def gens():
            return {2: torch.Generator().manual_seed(100 + trial)} if seeded else {}
        torch.manual_seed(trial)
        a = rej.forward(no_drafts(), None, logits.clone(), sampling(temp, gens()))
        torch.manual_seed(trial)
        b = sample_without_drafts(sampler, no_drafts(), logits.clone(), sampling(temp, gens()))
        same.append(bool(torch.equal(a.sampled_token_ids, b.sampled_token_ids))
                    and a.sampled_token_ids.dtype == b.sampled_token_ids.dtype
                    and tuple(b.sampled_token_ids.shape) == (B, 1))
    out[name] = same

# Greedy verification: steps with drafts (0-5 per request, some accepted, some placeholders), bfloat16
# logits rounded to integers so that rows hold ties at their maximum.
import dataclasses
from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor

from tests.test_sampling_reference import spec_metadata  # vLLM's layout of a step with drafts

greedy_same, emitted, ties = [], 0, 0
for trial in range(40):
    n = torch.randint(0, 6, (B,), generator=g).tolist()
    if trial == 0:
        n = [0] * B
    md, rows = spec_metadata([[0] * k for k in n])
    logits = (torch.randn(rows, V, generator=g) * 2.5).round().to(torch.bfloat16)
    ties += int(((logits == logits.max(-1, keepdim=True).values).sum(-1) > 1).sum())
    am = logits.float().argmax(-1)
    drafts, o = [], 0
    for i, k in enumerate(n):
        if k and trial % 7 == 3 and i == 0:  # vLLM's placeholder drafts of a new request
            drafts.append([-1] * k)
        else:
            drafts.append([int(am[o + j]) if torch.rand(1, generator=g) < 0.75
                           else int(torch.randint(0, V, (1,), generator=g)) for j in range(k)])
        o += k + 1
    md, _ = spec_metadata(drafts)
    a = rej.forward(md, None, logits.clone(), sampling(None))
    b = verify_greedy(md, logits.clone(), sampling(None))
    greedy_same.append(b is not None and a.sampled_token_ids.dtype == b.sampled_token_ids.dtype
                       and bool(torch.equal(a.sampled_token_ids, b.sampled_token_ids)))
    emitted += int((a.sampled_token_ids >= 0).sum())
out["greedy_verify"] = {"same": greedy_same, "emitted": emitted, "ties": ties}
md, rows = spec_metadata([[1, 2], [3], [], [4, 5, 6], [7], [8]])
logits = torch.randn(rows, V, generator=g)
bias = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
unused = verify_greedy(md, logits, dataclasses.replace(sampling(None), logitsprocs=LogitsProcessors([bias])))
bias.biases = {0: {5: 3.0}}
declined = {
    "sampled": sampling(0.8),
    "logprobs": dataclasses.replace(sampling(None), max_num_logprobs=0),
    "penalties": dataclasses.replace(sampling(None), no_penalties=False),
    "bad_words": dataclasses.replace(sampling(None), bad_words_token_ids={1: [[3]]}),
    "logit_bias": dataclasses.replace(sampling(None), logitsprocs=LogitsProcessors([bias])),
}
out["greedy_declines"] = {k: verify_greedy(md, logits, v) is None for k, v in declined.items()}
out["greedy_declines"]["synthetic"] = verify_greedy(md, logits, sampling(None), synthetic_mode=True) is None
out["greedy_declines"]["unused_bias_taken"] = unused is not None

# Recovered tokens: vLLM's function against the one fix_recovered_token_sampling installs, on many
# positions that share one target row (vocabulary 16): token counts of each, compared in the parent.
original = rs.sample_recovered_tokens
assert fix_recovered_token_sampling()
patched = rs.sample_recovered_tokens
VS, N = 16, 6000
row = torch.softmax(torch.randn(VS, generator=g) * 1.5, -1)
row[3] = 0.0  # a token the target never emits (top-k / top-p)
row = row / row.sum()
draft = torch.full((N,), 5, dtype=torch.int32)
cu = torch.arange(1, N + 1, dtype=torch.int32)
probs = row.expand(N, VS).contiguous()
md = SamplingMetadata(
    temperature=torch.ones(N), all_greedy=False, all_random=True, top_p=None, top_k=None,
    generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
    frequency_penalties=torch.zeros(N), presence_penalties=torch.zeros(N),
    repetition_penalties=torch.ones(N), output_token_ids=[[] for _ in range(N)],
    allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
)
torch.manual_seed(1)
a = original(1, [1] * N, cu, draft, None, probs, md, torch.device("cpu"))
torch.manual_seed(2)
b = patched(1, [1] * N, cu, draft, None, probs, md, torch.device("cpu"))
out["recovered"] = {
    "row": row.tolist(),
    "vllm": torch.bincount(a.long(), minlength=VS).tolist(),
    "ours": torch.bincount(b.long(), minlength=VS).tolist(),
    "dtype_same": a.dtype == b.dtype,
}

# Sampled steps without a seeded request: the bonus tokens of a step without drafts
# (sample_without_drafts) and the tokens of a step with n-gram-like drafts (verify_sampled), many
# identical requests in one batch, against vLLM's rejection sampler on the same inputs (token counts,
# compared in the parent).
from adaptive_spec.vllm.sampling import verify_sampled

VD, ND, TD = 6, 12000, 0.9


def sampled_md(n, temps):
    return dataclasses.replace(
        sampling(0.5), temperature=torch.tensor(temps, dtype=torch.float32),
        all_random=all(t > 0 for t in temps), frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)],
    )


rows = torch.randn(3, VD, generator=g) * 1.5
md, _ = spec_metadata([[]] * ND)
torch.manual_seed(3)
a = rej.forward(md, None, rows[:1].repeat(ND, 1), sampled_md(ND, [TD] * ND)).sampled_token_ids
torch.manual_seed(4)
b = sample_without_drafts(sampler, md, rows[:1].repeat(ND, 1), sampled_md(ND, [TD] * ND))
out["no_drafts_sampled"] = {
    "rows": rows.tolist(), "temperature": TD,
    "vllm": torch.bincount(a.view(-1).long(), minlength=VD).tolist(),
    "ours": torch.bincount(b.sampled_token_ids.view(-1).long(), minlength=VD).tolist(),
    "shape_dtype": [list(b.sampled_token_ids.shape), str(b.sampled_token_ids.dtype)],
}
# Drafts [2, 4] on rows 0 and 1, the bonus row 2; and a placeholder draft [-1] on row 0.
joint = {}
for name, drafts in (("two_drafts", [2, 4]), ("placeholder", [-1])):
    md, _ = spec_metadata([drafts] * ND)
    logits = rows[: len(drafts) + 1].repeat(ND, 1)
    res = {}
    for who, seed in (("vllm", 5), ("ours", 6)):
        torch.manual_seed(seed)
        if who == "vllm":
            o = rej.forward(md, None, logits.clone(), sampled_md(ND, [TD] * ND))
        else:
            o = verify_sampled(md, None, logits.clone(), sampled_md(ND, [TD] * ND))
        seqs = {}
        for t in o.sampled_token_ids.tolist():
            seqs[str(t)] = seqs.get(str(t), 0) + 1
        res[who] = seqs
        res[who + "_dtype"] = str(o.sampled_token_ids.dtype)
    joint[name] = res
out["sampled_joint"] = joint

# A mixed step: greedy requests next to sampled ones. The greedy requests' tokens are vLLM's exactly.
mixed_same = []
temps = [0.0, 0.8, 0.0, 1.2, 0.0, 0.5]
for trial in range(30):
    n = torch.randint(0, 5, (B,), generator=g).tolist()
    n[0] = max(n[0], 1)
    md, nrows = spec_metadata([[0] * k for k in n])
    logits = (torch.randn(nrows, V, generator=g) * 2.5).round()
    am = logits.argmax(-1)
    drafts, o = [], 0
    for i, k in enumerate(n):
        drafts.append([int(am[o + j]) if torch.rand(1, generator=g) < 0.7
                       else int(torch.randint(0, V, (1,), generator=g)) for j in range(k)])
        o += k + 1
    md, _ = spec_metadata(drafts)
    ref = rej.forward(md, None, logits.clone(), sampled_md(B, temps)).sampled_token_ids
    got = verify_sampled(md, None, logits.clone(), sampled_md(B, temps)).sampled_token_ids
    greedy_rows = [i for i, t in enumerate(temps) if t == 0.0]
    mixed_same.append(bool(torch.equal(ref[greedy_rows], got[greedy_rows])))
out["sampled_mixed_greedy_rows"] = mixed_same

md, nrows = spec_metadata([[1, 2], [3], [], [4, 5, 6], [7], [8]])
logits = torch.randn(nrows, V, generator=g)
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

minp = object.__new__(MinPLogitsProcessor)  # a request with min_p > 0 in the batch
minp.min_p_count = 1
base = sampled_md(B, [0.8] * B)
sampled_declines = {
    "all_greedy": verify_sampled(md, None, logits, sampling(None)),
    "no_drafts": verify_sampled(spec_metadata([[]] * B)[0], None, logits[:B], base),
    "draft_probs": verify_sampled(md, torch.rand(10, V), logits, base),
    "top_k": verify_sampled(md, None, logits, dataclasses.replace(base, top_k=torch.full((B,), 5))),
    "top_p": verify_sampled(md, None, logits, dataclasses.replace(base, top_p=torch.full((B,), 0.9))),
    "logprobs": verify_sampled(md, None, logits, dataclasses.replace(base, max_num_logprobs=0)),
    "penalties": verify_sampled(md, None, logits, dataclasses.replace(base, no_penalties=False)),
    "min_p": verify_sampled(
        md, None, logits, dataclasses.replace(base, logitsprocs=LogitsProcessors([minp]))
    ),
    "seeded": verify_sampled(
        md, None, logits, dataclasses.replace(base, generators={1: torch.Generator().manual_seed(1)})
    ),
    "synthetic": verify_sampled(md, None, logits, base, synthetic_mode=True),
}
out["sampled_declines"] = {k: v is None for k, v in sampled_declines.items()}
out["sampled_taken"] = verify_sampled(md, None, logits, base) is not None
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def child_results() -> dict:
    import json

    proc = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["greedy", "t1.3_seeded"])
def test_a_step_without_drafts_samples_what_the_rejection_sampler_samples(child_results, case):
    assert child_results[case] == [True] * 20


def test_greedy_verification_emits_what_the_rejection_sampler_emits(child_results):
    r = child_results["greedy_verify"]
    assert r["same"] == [True] * 40
    # the comparison covers rows with tied maxima and accepted drafts (more tokens than bonus tokens)
    assert r["ties"] > 0 and r["emitted"] > 40 * 6


def test_greedy_verification_declines_what_it_does_not_cover(child_results):
    assert child_results["greedy_declines"] == {
        "sampled": True,
        "logprobs": True,
        "penalties": True,
        "bad_words": True,
        "logit_bias": True,
        "synthetic": True,
        "unused_bias_taken": True,
    }


def test_recovered_tokens_follow_the_residual_distribution_as_vllms_do(child_results):
    from scipy.stats import chi2_contingency, chisquare

    r = child_results["recovered"]
    assert r["dtype_same"]
    row = torch.tensor(r["row"], dtype=torch.float64)
    resid = row.clone()
    resid[5] = 0.0  # the draft token (n-gram: q is one-hot on it)
    resid /= resid.sum()
    vllm_n, ours_n = torch.tensor(r["vllm"]), torch.tensor(r["ours"])
    for counts in (vllm_n, ours_n):
        assert int(counts.sum()) == 6000
        assert (
            counts[5] == 0 and counts[3] == 0
        )  # never the draft token, never a zero-probability one
    keep = resid > 0
    expected = (resid[keep] * 6000).numpy()
    assert chisquare(ours_n[keep].numpy(), expected).pvalue > 1e-3
    assert (
        chisquare(vllm_n[keep].numpy(), expected).pvalue > 1e-3
    )  # the check can tell: vLLM passes
    assert chi2_contingency([vllm_n[keep].numpy(), ours_n[keep].numpy()]).pvalue > 1e-3


def test_recovered_tokens_with_draft_probabilities_sample_max_p_minus_q():
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(3)
    V, N = 12, 8000
    p = torch.softmax(torch.randn(V, generator=g), -1)
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    resid = (p - q).clamp_min(0).double()
    resid /= resid.sum()
    torch.manual_seed(0)
    tok = recovered_tokens(
        [1] * N,
        torch.zeros(N, dtype=torch.int32),
        q.expand(N, V).contiguous(),
        p.expand(N, V).contiguous(),
        {},
    )
    counts = torch.bincount(tok.long(), minlength=V)
    assert tok.dtype == torch.int32 and tok.shape == (N,)
    assert (counts[resid == 0] == 0).all()
    keep = resid > 0
    assert chisquare(counts[keep].numpy(), (resid[keep] * N).numpy()).pvalue > 1e-3


def test_a_seeded_requests_recovered_tokens_depend_on_its_generator_only():
    g = torch.Generator().manual_seed(4)
    V = 50
    probs = torch.softmax(torch.randn(7, V, generator=g), -1)
    draft = torch.randint(0, V, (7,), generator=g, dtype=torch.int32)

    def run(ks: list[int], rows: slice, global_seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)
        gens = {1: torch.Generator().manual_seed(99)}
        return recovered_tokens(ks, draft[rows], None, probs[rows], gens)

    # request 1 owns positions 2:5 in the first batch and 0:3 in the second
    a = run([2, 3, 2], slice(0, 7), 0)[2:5]
    b = run([0, 3, 0], slice(2, 5), 123)
    assert torch.equal(a, b)
    assert not (a == draft[2:5]).any()  # never the request's own draft token


def test_an_all_zero_residual_returns_a_valid_id_and_no_positions_return_nothing():
    p = torch.zeros(2, 6)
    p[:, 4] = 1.0  # the target puts all its mass on the draft token: never rejected
    tok = recovered_tokens([1, 1], torch.tensor([4, 4], dtype=torch.int32), None, p, {})
    assert ((tok >= 0) & (tok < 6)).all()
    empty = recovered_tokens([0, 0], torch.zeros(0, dtype=torch.int32), None, torch.zeros(0, 6), {})
    assert empty.shape == (0,)


@pytest.mark.parametrize("vocab", [700, 2048, 2500])
def test_inverse_transform_equals_one_full_float64_cumulative_sum(vocab: int):
    from adaptive_spec.vllm.sampling import inverse_transform

    g = torch.Generator().manual_seed(vocab)
    n = 3000
    w = torch.rand(n, vocab, generator=g) ** 4
    w[torch.rand(n, vocab, generator=g) < 0.3] = 0.0
    exclude = torch.randint(0, vocab, (n,), generator=g)
    u = torch.rand(n, dtype=torch.float64, generator=g)
    u[0], u[1] = 0.0, 1.0 - 2.0**-53  # the two ends
    for ex in (None, exclude):
        ref_w = w.double().clone()
        if ex is not None:
            ref_w[torch.arange(n), ex] = 0.0
        c = ref_w.cumsum(-1)
        ref = torch.searchsorted(c, (u * c[:, -1]).unsqueeze(1), right=True).squeeze(1)
        ref = ref.clamp_max(vocab - 1)
        got = inverse_transform(w, u, ex)
        assert got.dtype == torch.int64 and got.shape == (n,)
        assert (ref_w[torch.arange(n), got] > 0).all()  # never a zero-weight column
        assert (got == ref).float().mean() > 0.999  # the rest differ only at float64 rounding
        assert got[0] == int(torch.nonzero(ref_w[0])[0])  # u = 0: the first positive column
        assert got[1] == int(torch.nonzero(ref_w[1])[-1])  # u -> 1: the last positive column


def _speculative_sampling_outcomes(rows: list, drafts: list[int], temperature: float) -> dict:
    """Exact probability of each output row of one request (its tokens, -1 padded) under speculative
    sampling with one-hot drafts: position j accepts draft d_j with probability p_j(d_j); the first
    rejection emits a sample of p_j without d_j; a full acceptance emits a bonus sample of the last
    row. A negative draft id is always rejected and its position emits a sample of the whole p_j."""
    p = torch.softmax(torch.tensor(rows, dtype=torch.float64) / temperature, -1)
    k, width = len(drafts), len(drafts) + 1
    outcomes: dict[str, float] = {}
    reach = 1.0
    for j, d in enumerate(drafts):
        resid = p[j].clone()
        if d >= 0:
            resid[d] = 0.0
        for tok in range(p.shape[1]):
            if resid[tok] > 0:
                seq = [*drafts[:j], tok] + [-1] * (width - j - 1)
                outcomes[str(seq)] = reach * float(resid[tok])
        if d < 0:
            return outcomes
        reach *= float(p[j, d])
    for tok in range(p.shape[1]):
        outcomes[str([*drafts, tok])] = reach * float(p[k, tok])
    return outcomes


def test_a_sampled_step_without_drafts_samples_the_targets_distribution(child_results):
    from scipy.stats import chi2_contingency, chisquare

    r = child_results["no_drafts_sampled"]
    assert r["shape_dtype"] == [[12000, 1], "torch.int32"]
    p = torch.softmax(torch.tensor(r["rows"][0], dtype=torch.float64) / r["temperature"], -1)
    for counts in (r["vllm"], r["ours"]):
        assert sum(counts) == 12000
        assert chisquare(counts, (p * 12000).numpy()).pvalue > 1e-3
    assert chi2_contingency([r["vllm"], r["ours"]]).pvalue > 1e-3


@pytest.mark.parametrize("case", ["two_drafts", "placeholder"])
def test_sampled_verification_follows_speculative_sampling_as_vllm_does(child_results, case):
    from scipy.stats import chi2_contingency, chisquare

    r = child_results["sampled_joint"][case]
    rows = child_results["no_drafts_sampled"]["rows"]
    drafts = [2, 4] if case == "two_drafts" else [-1]
    exact = _speculative_sampling_outcomes(rows[: len(drafts) + 1], drafts, 0.9)
    assert r["ours_dtype"] == r["vllm_dtype"] == "torch.int32"
    keys = sorted(exact)
    # vLLM's rejection sampler reads a placeholder draft (-1) as the last vocabulary id: it "accepts"
    # it with that id's probability and then emits a bonus token. Only the two-draft case compares it.
    whom = ("vllm", "ours") if case == "two_drafts" else ("ours",)
    for who in whom:  # vLLM passes too: the check can tell
        seen = r[who]
        assert set(seen) <= set(exact), set(seen) - set(exact)  # no impossible output
        counts = [seen.get(k, 0) for k in keys]
        assert sum(counts) == 12000
        expected = [exact[k] * 12000 for k in keys]
        # pool the rare outcomes so that every expected count is >= 5
        big = [i for i, e in enumerate(expected) if e >= 5]
        small = [i for i, e in enumerate(expected) if e < 5]
        obs = [counts[i] for i in big] + ([sum(counts[i] for i in small)] if small else [])
        exp = [expected[i] for i in big] + ([sum(expected[i] for i in small)] if small else [])
        assert chisquare(obs, exp).pvalue > 1e-3
    if case != "two_drafts":
        return
    both = sorted(set(r["vllm"]) | set(r["ours"]))
    table = [[r["vllm"].get(k, 0) for k in both], [r["ours"].get(k, 0) for k in both]]
    keep = [i for i in range(len(both)) if table[0][i] + table[1][i] >= 10]
    assert chi2_contingency([[row[i] for i in keep] for row in table]).pvalue > 1e-3


def test_sampled_verification_gives_greedy_requests_vllms_tokens(child_results):
    assert child_results["sampled_mixed_greedy_rows"] == [True] * 30


def test_sampled_verification_declines_what_it_does_not_cover(child_results):
    assert child_results["sampled_declines"] == {
        "all_greedy": True,
        "no_drafts": True,
        "draft_probs": True,
        "top_k": True,
        "top_p": True,
        "logprobs": True,
        "penalties": True,
        "min_p": True,
        "seeded": True,
        "synthetic": True,
    }
    assert child_results["sampled_taken"]  # and it does take a step it covers
