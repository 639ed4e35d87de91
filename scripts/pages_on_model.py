"""Every page of the app on one model: an inspected run of the model (the app's own run path), then each page of
pages/ opened on it through Streamlit's AppTest, as the app's sidebar would have loaded it; prints, per page, whether it
rendered without an exception or an error box, its seconds, and the process's peak memory (RSS) after it.

    python3 scripts/pages_on_model.py MODEL [--quant stored|dequantized] [--tokens N] [--prompt TEXT] [--page NAME ...]

MODEL: a Hugging Face folder or a GGUF file (`bench --sizes` writes a Llama-3.1-8B-shaped Q4_K GGUF to
$LLM_INSPECTOR_CACHE/bench-sizes/). Issue 44's check: the 8B-shaped Q4_K file as stored opens in <= 6.5 GB, decodes,
and every page works on it. Exit status 1 when a page failed. (tests/app holds each page's content on small models;
this is the same pages on a large one, too slow for the suite.)"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import engine.threads  # noqa: E402,F401  (before torch's first use: the one thread policy, set on import)


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--quant", default="stored", choices=["stored", "dequantized"])
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--page", action="append", default=None, help="only this page (repeatable)")
    a = p.parse_args(argv)
    from streamlit.runtime.pages_manager import PagesManager
    from streamlit.testing.v1 import AppTest

    import inspector.session.models as models
    from engine import RunSettings, load_model
    from inspector.session.run import inspect_run
    from inspector.ui.state import session_of

    t0 = time.perf_counter()
    gguf = a.model.endswith(".gguf")
    model = load_model(a.model, device="cpu", dtype="float32", **({"quant": a.quant} if gguf else {}))
    print(f"loaded {a.model} ({a.quant if gguf else 'folder'}) in {time.perf_counter() - t0:.1f} s, "
          f"peak RSS {peak_gb():.2f} GB, decode path: {model.accelerator.why_not or 'native'}", flush=True)
    t0 = time.perf_counter()
    run = inspect_run(model, RunSettings(prompt=a.prompt, max_new_tokens=a.tokens, chat=False))
    print(f"inspected run of {a.tokens} tokens in {time.perf_counter() - t0:.1f} s: {run.result.text!r}, "
          f"peak RSS {peak_gb():.2f} GB", flush=True)
    models.load_model = lambda *args, **kw: model            # the sidebar's loader hands out this model
    PagesManager.uses_pages_directory = None
    source = str(Path(a.model).resolve())
    os.environ["LLM_INSPECTOR_MODEL"] = source
    models.shared_model.clear()
    models.shared_model(source, "cpu", "auto")
    names = a.page or sorted(f.stem for f in (ROOT / "pages").glob("*.py"))
    failed = []
    for name in names:
        t0 = time.perf_counter()
        at = AppTest.from_file(str(ROOT / "pages" / f"{name}.py"), default_timeout=1800)
        session_of(at.session_state).run = run
        at.run()
        bad = [str(at.exception[0].value)[:200]] if at.exception else [e.value[:200] for e in at.error]
        shown = f"{len(at.get('plotly_chart'))} charts, {len(at.dataframe)} tables, {len(at.warning)} warnings"
        failed += [name] if bad else []
        print(f"{name:14s} {'FAILED ' + '; '.join(bad) if bad else 'ok'} ({shown}) {time.perf_counter() - t0:7.1f} s, "
              f"peak RSS {peak_gb():.2f} GB", flush=True)
    print(f"{len(names) - len(failed)} of {len(names)} pages rendered; peak RSS {peak_gb():.2f} GB")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
