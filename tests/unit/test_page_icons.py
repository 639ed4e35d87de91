"""The app's page icons are emoji. Streamlit makes a page's icon (st.Page(icon=…), st.set_page_config(page_icon=…))
the browser's favicon: an emoji becomes an inline SVG, a `:material/name:` icon a link to
fonts.gstatic.com/…/materialsymbolsrounded/name/…, which every student's browser would fetch from that public
server (and miss on a network without internet). tests/browser/test_nothing_from_outside.py checks the
served app's requests; this checks the sources, fast."""
from __future__ import annotations

import ast
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "app.py", *sorted((ROOT / "pages").glob("*.py")), *sorted((ROOT / "inspector" / "ui").glob("*.py"))]


def _icon_arguments(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every page icon the file gives Streamlit: st.Page's icon (keyword or third argument)
    and set_page_config's page_icon."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        wanted = {"Page": "icon", "set_page_config": "page_icon"}.get(name)
        if wanted is None:
            continue
        args = [k.value for k in node.keywords if k.arg == wanted]
        if name == "Page" and len(node.args) >= 3:
            args.append(node.args[2])
        found += [(a.lineno, a.value if isinstance(a, ast.Constant) else ast.unparse(a)) for a in args]
    return found


def _is_emoji(text: str) -> bool:
    """Pictographs (So), with variation selectors / joiners only: no ASCII, no :shortcode: of any kind."""
    return bool(text) and all(unicodedata.category(c) == "So" or c in "\ufe0f\u200d" for c in text)


def test_no_material_icon_in_the_app_frame():
    assert ":material/" not in (ROOT / "app.py").read_text()


def test_every_page_icon_is_an_emoji():
    icons = {f"{p.name}:{line}": value for p in SOURCES for line, value in _icon_arguments(p)}
    pages = [k for k in icons if k.startswith("app.py:")]
    assert len(pages) >= 15, icons          # page_icon and the fourteen pages of app.py are all found
    assert {k: v for k, v in icons.items() if not (isinstance(v, str) and _is_emoji(v))} == {}


def test_the_emoji_check_tells_the_two_kinds_apart():
    assert _is_emoji("🔬") and _is_emoji("⏱️") and _is_emoji("🗜️")
    assert not _is_emoji(":material/biotech:") and not _is_emoji(":microscope:") and not _is_emoji("")
