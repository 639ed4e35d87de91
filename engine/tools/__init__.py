"""Tools built on the engine's public API (engine.model.Model.forward / run_blocks, engine.generate,
engine.inspection): the doctors (`doctor`: NaN and precision, `why_loop`, `rescue`), the explainers
(`explain`, `patching`, `attribution`), `quant` (quantised copies), `breakpoints` and the generation
debugger's conditions. Nothing in the core or in engine.inspection imports a tool."""
