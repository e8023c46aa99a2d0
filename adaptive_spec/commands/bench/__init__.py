"""``adaptive-spec bench``: the adaptive controller against every peer, side by side.

* :mod:`~adaptive_spec.commands.bench.plan`: configuration names, benchmark cells, the full and quick grids,
  and the tuning of vLLM's batch-size table from static runs;
* :mod:`~adaptive_spec.commands.bench.worker`: one vLLM engine per process, every configuration of its cells
  run in turn, repeats interleaved;
* :mod:`~adaptive_spec.commands.bench.summary`: medians, paired ratios, best static arm, goals;
* :mod:`~adaptive_spec.commands.bench.report`: the environment, the rich table, the JSON file and the plots.

The command itself is :mod:`adaptive_spec.commands.bench.command`; the Hugging Face peer is :mod:`adaptive_spec.commands.bench.hf_peer`.
The design of the full run is documented in ``docs/benchmarks.md``.
"""
