"""The sampler shortcuts of ``adaptive_spec.vllm.sampling`` against vLLM's own rejection sampler.

A step without draft tokens sampled by :func:`sample_without_drafts` gives exactly the tokens vLLM's
``RejectionSampler.forward`` gives from the same random state (greedy, sampled, and a request with its
own generator): the bonus token is drawn first in both, and the rejection sampler draws nothing else
that reaches the output. The recovered-token noise of :func:`fix_recovered_token_noise` reproduces
vLLM's recovered tokens exactly when every request has draft tokens (the same draws in the same order)
and for a seeded request in any batch (its own generator draws the same numbers); rows of requests
without draft tokens get no noise. Runs in a subprocess: vLLM's CPU kernel overrides are registered
process-wide.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from adaptive_spec.vllm.sampling import recovered_token_noise

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
from adaptive_spec.vllm.sampling import fix_recovered_token_noise, sample_without_drafts

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
for name, temp, seeded in (("greedy", None, False), ("t0.8", 0.8, False), ("t1.3_seeded", 1.3, True)):
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

# Recovered tokens: vLLM's function against the one fix_recovered_token_noise installs.
original = rs.sample_recovered_tokens
assert fix_recovered_token_noise()
patched = rs.sample_recovered_tokens
for name, ks, seeded in (("all_rows", [2, 3, 1, 4, 2, 3], False), ("some_rows_seeded", [2, 0, 3, 0, 0, 1], True)):
    same, seeded_same, valid = [], [], []
    for trial in range(20):
        draft = [torch.randint(0, V, (k,), generator=g).tolist() for k in ks]
        flat = torch.tensor(sum(draft, []), dtype=torch.int32)
        cu = torch.tensor(ks, dtype=torch.int32).cumsum(0).to(torch.int32)
        probs = torch.softmax(torch.randn(int(sum(ks)), V, generator=g), -1)
        def md():
            return sampling(1.0, {2: torch.Generator().manual_seed(7 + trial)} if seeded else {})
        torch.manual_seed(trial)
        a = original(max(ks), ks, cu, flat, None, probs, md(), torch.device("cpu"))
        torch.manual_seed(trial)
        b = patched(max(ks), ks, cu, flat, None, probs, md(), torch.device("cpu"))
        same.append(bool(torch.equal(a, b)))
        valid.append(bool(((b >= 0) & (b < V)).all()) and b.shape == a.shape)
        if seeded:
            lo, hi = int(cu[1]), int(cu[2])  # request 2's draft positions
            seeded_same.append(bool(torch.equal(a[lo:hi], b[lo:hi])))
    out[name] = {"same": same, "seeded_same": seeded_same, "valid": valid}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def child_results() -> dict:
    import json

    proc = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["greedy", "t0.8", "t1.3_seeded"])
def test_a_step_without_drafts_samples_what_the_rejection_sampler_samples(child_results, case):
    assert child_results[case] == [True] * 20


def test_recovered_tokens_equal_vllms_when_every_request_has_drafts(child_results):
    r = child_results["all_rows"]
    assert r["same"] == [True] * 20 and all(r["valid"])


def test_recovered_tokens_of_a_seeded_request_do_not_depend_on_the_others(child_results):
    r = child_results["some_rows_seeded"]
    assert r["seeded_same"] == [True] * 20 and all(r["valid"])
    # the unseeded rows drew other numbers (fewer rows drew noise): not the same stream
    assert not all(r["same"])


def test_noise_only_for_rows_with_drafts():
    gen = {3: torch.Generator().manual_seed(11)}
    q = recovered_token_noise([2, 0, 1, 4, 0], 50, gen, torch.float32, "cpu")
    assert q.shape == (5, 50) and q.dtype == torch.float32
    assert torch.equal(q[1], torch.ones(50)) and torch.equal(q[4], torch.ones(50))
    assert (q[[0, 2, 3]] > 0).all() and not torch.equal(q[0], torch.ones(50))
    expect = torch.empty(50).exponential_(generator=torch.Generator().manual_seed(11))
    assert torch.equal(q[3], expect)  # a seeded request's row: its own generator, as in vLLM
