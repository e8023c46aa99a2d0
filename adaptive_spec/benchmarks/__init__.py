"""``adaptive-spec bench``: the adaptive controller against every peer, side by side.

* :mod:`~adaptive_spec.benchmarks.plan`: configuration names, benchmark cells, the full and quick grids,
  and the tuning of vLLM's batch-size table from static runs;
* :mod:`~adaptive_spec.benchmarks.worker`: one vLLM engine per process, every configuration of its cells
  run in turn, repeats interleaved;
* :mod:`~adaptive_spec.benchmarks.summary`: medians, paired ratios, best static arm, goals;
* :mod:`~adaptive_spec.benchmarks.report`: the environment, the rich table, the JSON file and the plots.

The command itself is :mod:`adaptive_spec.bench`; the Hugging Face peer is :mod:`adaptive_spec.hf_peer`.
The design of the full run is documented in ``docs/benchmarks.md``.
"""
