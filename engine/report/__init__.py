"""The take-home report of one run: `data` (what it shows, as plain data), `figures` (its charts) and `html`
(one self-contained HTML file). Built on engine.inspection's run record and engine.tools' doctor."""
