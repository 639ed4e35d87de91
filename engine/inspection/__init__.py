"""Inspection: what the engine's hooks see, and the record of a run.

- `probe`: the Probe a forward offers every named stage to (its configuration: capture, statistics, replace
  hooks), and `inspection_probe`, the app's full inspection; `plans` and `probe_views` choose what a stage costs;
  `interventions` holds HookContext and ready-made replace functions; `stop_points` where a forward stops.
- `recording`: what a probe saw (statistics, captures, timing marks, what it watched): the part a run keeps.
- `stats` (the batcher, one door: `add`), `stat_sources`, `row_stats`, `attention_stats` (with
  `attention_blocks`, `attention_partials`): per-row statistics of every stage (STAT_NAMES) and of attention.
- `stages`: the names of the forward's stages.
- `trace`, `trace_check`: the run record (a generation, its recording, loops, the first non-finite value)
  and its validated file format; `nonfinite` and `loops` compute what the record keeps.

Inspection sits below the model (engine.model offers its stages to the probe): it imports the modules under the
model (engine.results' run results, engine.progress, engine.sampling, engine.kv_cache ...), never the model itself, the
generation loop (engine.generate), the batch layer (engine.batch), a tool (engine.tools), the report (engine.report) or
a bench (engine.bench); tests/unit/test_layout.py holds the order."""
