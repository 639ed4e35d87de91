"""Attention in projector mode (issue 33, item 6): its table is an HTML table in the projector's type, not the
13-px st.dataframe grid."""
from __future__ import annotations

from tests.app.test_app_pages_b import pages, tiny_app  # noqa: F401  (fixtures)


def test_attention_shows_an_html_table_on_the_projector(tiny_app, pages):  # noqa: F811
    at = tiny_app.switch_page(pages["sampling"].replace("sampling", "attention")).run()
    assert not at.exception, at.exception
    grids = len(at.dataframe)
    assert grids >= 1                                            # off the projector: the usual grid
    at.sidebar.toggle(key="sb_projector").set_value(True).run()
    assert not at.exception, at.exception
    assert len(at.dataframe) == 0 and len(at.table) >= 1
