"""`python -m inspector.ui.serve run app.py [streamlit options]`: Streamlit's own command line (scripts/serve.sh
starts the app this way), with Python's garbage collector made cheap before the server starts.

Streamlit collects garbage after every script run (`runner.postScriptGC`, on by default): a full gc.collect()
that walks every object the process tracks while it holds the GIL. With torch, Streamlit, plotly, pandas and
the engine imported that is about 270,000 objects, 120-200 ms of CPU after each script run. A room's following
student reruns its live panel up to about seven times a second while the teacher's run generates, so a few
students cost more CPU than there is: three followers made the teacher's 64-token run take 23.7 s instead of
4.2 s, and students on a second process stalled at "token 1" (issue 33, item 5).

So the modules the app imports are imported here first, before the server starts and so before any session
exists, and gc.freeze() moves every object then alive to the collector's permanent generation (they live as
long as the process anyway; the cyclic collector never looks at them again, reference counting still frees
them). A collection then walks only what sessions have made since: under a millisecond after three 64-token
runs of the bundled model, measured. The collector stays on, so a closed tab's runs are freed within seconds of
its session's end, as before. Nothing of a session is frozen: no session exists yet.
"""
from __future__ import annotations

import gc
import importlib
import pkgutil
import sys

import engine.threads  # noqa: E402,F401,I001  (the one thread policy, before torch loads libgomp: as app.py)

PACKAGES = ("inspector.session", "inspector.views", "inspector.ui")   # what app.py and the pages import


def preload() -> int:
    """Import what the app's script runs will import, then freeze every object alive; how many were frozen."""
    import pandas  # noqa: F401
    import plotly.graph_objects  # noqa: F401
    import streamlit  # noqa: F401
    import torch  # noqa: F401

    import engine  # noqa: F401
    for name in PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.iter_modules(package.__path__, name + "."):
            if info.name != __name__:
                importlib.import_module(info.name)
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def main(argv: list[str]) -> None:
    frozen = preload()
    print(f"LLM Inspector: {frozen:,} objects imported before the server started are left out of garbage "
          "collection (inspector/ui/serve.py)", file=sys.stderr)
    from streamlit.web.cli import main as streamlit_main
    sys.argv = ["streamlit", *argv]
    streamlit_main(prog_name="streamlit")


if __name__ == "__main__":
    main(sys.argv[1:])
