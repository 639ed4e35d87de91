"""Every page of the app on one model: an inspected run of the model (the app's own run path), then each page of
pages/ opened on it through Streamlit's AppTest, as the app's sidebar would have loaded it; prints, per page, whether it
rendered without an exception or an error box, its seconds, and the process's peak memory (RSS) after it; then presses
the page's action buttons one at a time (each an AppTest rerun, small settings first: SMALL), reporting per press its
seconds, what it raised (an exception, or the error boxes it left) and the peak RSS after it.

    python3 scripts/pages_on_model.py MODEL [--quant stored|dequantized] [--tokens N] [--prompt TEXT] [--page NAME ...]
                                      [--no-press] [--press-timeout S] [--skip KEY=REASON ...]

Pressed: every enabled button (and download button) a page shows, as it shows them (a press can reveal more: those
are pressed too, up to MAX_PRESSES a page), except the sidebar's, the rooms', Stop and the ones that only undo
(SKIPPED), and those named with --skip (reported as skipped, with the reason given). A press that runs past
--press-timeout is reported as timed out: AppTest then stops its script at its next Streamlit call (the next progress
update, as the page's Stop button does) and waits for it.

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


MAX_PRESSES = 16
SKIPPED = ("sb_", "room_", "od_stop_", "od_again_", "cmp_stop", "steer_publish", "steer_room_run", "dbg_bp_rm_",
           "dbg_reset")
# Error boxes that are a page's answer, not a fault: the NaN doctor showing the fault it injected, and a memory
# refusal (engine.memory: a copy or load that does not fit, refused before it is made)
EXPECTED = ("Stop reason **non-finite logits**", "First non-finite value", "not loaded. Choose a smaller",
            "(some kept for the caches and runs): not computed.")
# Small settings set before any press where the page shows the widget: (kind, key, value)
SMALL = (("number_input", "cmp_max_new", 2), ("number_input", "nd_max_new", 2), ("multiselect", "qz_formats", ["Q8_0"]),
         ("multiselect", "qsb_formats", ["Q8_0"]), ("text_area", "qsb_texts", "The capital of France is Paris."),
         ("number_input", "wl_budget", 5), ("number_input", "rs_tokens", 2), ("slider", "ex_random_orders", 1),
         ("number_input", "smp_draws", 100))


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--quant", default="stored", choices=["stored", "dequantized"])
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--page", action="append", default=None, help="only this page (repeatable)")
    p.add_argument("--no-press", action="store_true", help="only render each page, press nothing")
    p.add_argument("--press-timeout", type=float, default=300.0, help="seconds one press may take (default 300)")
    p.add_argument("--skip", action="append", default=[], metavar="KEY=REASON",
                   help="do not press the button of this key; the report says so, with the reason (repeatable)")
    a = p.parse_args(argv)
    from streamlit.runtime.pages_manager import PagesManager
    from streamlit.testing.v1 import AppTest

    import inspector.session.models as models
    from inspector.session.model_choices import QUANT_LABELS
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
    quant = a.quant if gguf else "dequantized"
    real_load = models.load_model

    def loader(src, *args, quant: str = "dequantized", **kw):
        # the sidebar's choice is this model; any other load a page asks for (the Quantization page's dequantised
        # twin of a file as stored) is the registry's real one, refused where it does not fit
        return model if quant == a.quant or not gguf else real_load(src, *args, quant=quant, **kw)
    models.load_model = loader
    PagesManager.uses_pages_directory = None
    source = str(Path(a.model).resolve())
    os.environ["LLM_INSPECTOR_MODEL"] = source
    models.shared_model.clear()
    models.shared_model(source, "cpu", "float32" if quant == "stored" else "auto", quant=quant)
    label = next(text for text, mode in QUANT_LABELS.items() if mode == quant)
    names = a.page or sorted(f.stem for f in (ROOT / "pages").glob("*.py"))
    pressed = 0
    failed = []
    for name in names:
        t0 = time.perf_counter()
        at = AppTest.from_file(str(ROOT / "pages" / f"{name}.py"), default_timeout=1800)
        session_of(at.session_state).run = run
        at.session_state["sb_quant"] = label              # the sidebar's "Weights" choice this model was loaded by
        at.run()
        bad, _ = problems(at)
        shown = counts(at)
        failed += [name] if bad else []
        print(f"{name:14s} {'FAILED ' + '; '.join(bad) if bad else 'ok'} ({shown}) {time.perf_counter() - t0:7.1f} s, "
              f"peak RSS {peak_gb():.2f} GB", flush=True)
        if not a.no_press and not at.exception:
            presses = press_all(at, a.press_timeout, dict(k.partition("=")[::2] for k in a.skip))
            pressed += len(presses)
            failed += [f"{name}: {k}" for k, _, bad, _ in presses if bad]
    print(f"{len(names)} pages, {pressed} presses; {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}; "
          f"peak RSS {peak_gb():.2f} GB")
    return 1 if failed else 0


def counts(at) -> str:
    return f"{len(at.get('plotly_chart'))} charts, {len(at.dataframe)} tables, {len(at.warning)} warnings"


def problems(at) -> tuple[list[str], list[str]]:
    """What the last script run raised (its exception, else the text of each error box it shows), and the error
    boxes that are the page's answer (EXPECTED)."""
    if at.exception:
        return [f"exception: {str(at.exception[0].value)[:300]}"], []
    boxes = [e.value for e in at.error]
    expected = [b[:300] for b in boxes if any(x in b for x in EXPECTED)]
    return [f"error box: {b[:300]}" for b in boxes if not any(x in b for x in EXPECTED)], expected


def pressable(at, done: set[str]) -> list:
    return [b for b in (*at.button, *at.download_button) if b.key and b.key not in done and not b.disabled
            and not b.key.startswith(SKIPPED)]


def press_all(at, timeout: float, skip: dict[str, str]) -> list[tuple[str, float, list[str], float]]:
    """Press each action button the page shows (SMALL settings first) but those in skip (key -> why), one rerun
    each: (key, seconds, problems, peak RSS GB) per press, printed as it goes."""
    for kind, key, value in SMALL:
        widgets = [w for w in getattr(at, kind) if w.key == key]
        if widgets:
            widgets[0].set_value(value)
    done: set[str] = set()
    out = []
    while len(done) < MAX_PRESSES and (todo := pressable(at, done)):
        button = todo[0]
        done.add(button.key)
        if button.key in skip:
            print(f"    skipped {button.key!r} ({button.label!r}): {skip[button.key]}", flush=True)
            continue
        print(f"    pressing {button.key!r} ({button.label!r}) ...", flush=True)
        t0 = time.perf_counter()
        try:
            button.click().run(timeout=timeout)
            bad, shown = problems(at)
        except RuntimeError as e:           # AppTest's "script run timed out"
            bad, shown = [f"timed out: {str(e)[:200]}"], []
        out.append((button.key, time.perf_counter() - t0, bad, peak_gb()))
        said = ("FAILED " + "; ".join(bad) if bad else "ok") + f" ({counts(at)})" + (
            " (shows: " + "; ".join(s[:120] for s in shown) + ")" if shown else "")
        print(f"    pressed {button.key!r} ({button.label!r}) {said} {out[-1][1]:7.1f} s, peak RSS {out[-1][3]:.2f} GB",
              flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
