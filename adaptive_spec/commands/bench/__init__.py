"""``adaptive-spec bench``: the adaptive controller against every peer, side by side.

* :mod:`~adaptive_spec.commands.bench.command`: the command line and the run, start to end;
* :mod:`~adaptive_spec.commands.bench.plan`: configuration names, benchmark cells, the full and quick grids,
  and the tuning of vLLM's batch-size table from static runs;
* :mod:`~adaptive_spec.commands.bench.resolve`: from the command line to the plan (draft model, cells,
  repeats) and each cell's prompts;
* :mod:`~adaptive_spec.commands.bench.launch`: the worker processes, one engine each, and merging their
  results;
* :mod:`~adaptive_spec.commands.bench.worker`: one vLLM engine per process, every configuration of its cells
  run in turn, repeats interleaved (the engine: :mod:`~adaptive_spec.commands.bench.worker_engine`; a
  cell's preparation: :mod:`~adaptive_spec.commands.bench.worker_cell`); the Hugging Face peer:
  :mod:`~adaptive_spec.commands.bench.hf_peer`;
* :mod:`~adaptive_spec.commands.bench.summary`: medians, paired ratios, best static arm, goals;
* :mod:`~adaptive_spec.commands.bench.report`: the environment, the rich table, the Markdown and the plots
  (results files: :mod:`~adaptive_spec.commands.bench.jsonio`).

``adaptive-spec bench serve`` (:mod:`~adaptive_spec.commands.bench.serve`) measures the OpenAI-compatible
server under load: ``serve_plan`` (server configurations, load patterns), ``serve_resolve`` (the resolved
plan, model, server settings, prompts), ``serve_runner`` (one server per configuration), ``serve_server``
(the server process and ``/metrics``), ``serve_passes`` and ``serve_client`` (vLLM's serving-benchmark
client), ``serve_summary`` (ratios, identity, goals, the tuned table) and ``serve_report``. The suffix
proposer's micro-benchmark is :mod:`~adaptive_spec.commands.bench.suffix`.

The design of the full run is documented in ``docs/benchmarks.md``.
"""
