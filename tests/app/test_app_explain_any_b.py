"""Explain: B may be any token the user types, not only one of the nine stored candidates (issue 33, item 3): "why
Paris and not London" when London is rank 158. The logit shown for B is the model's own logit for that token at
that position (one forward, checked against model.logits), and a text that is not one token is named as such."""
from __future__ import annotations

import pytest
import torch

from tests.app.test_app_explain import PROMPT, forward_calls, page, run  # noqa: F401  (fixtures)

pytestmark = pytest.mark.app


def test_a_typed_b_outside_the_candidates_is_explained_with_its_own_logit(page, run, tiny_model):  # noqa: F811
    at = page.run()
    assert not at.exception, at.exception
    step = 1
    at.selectbox(key="ex_step").set_value(step).run()
    res = run.result
    stored = {c.id for c in res.steps[step].top} | {res.token_ids[step]}
    ids = list(res.prompt_ids) + list(res.token_ids[:step])
    logits = tiny_model.logits(ids)[-1].float()
    order = logits.argsort(descending=True).tolist()
    tok = tiny_model.tokenizer
    # a token far down the list (rank 150 or below) whose text is exactly that one token
    rank, b = next((r, i) for r, i in enumerate(order) if r >= 150 and tok.encode(tok.decode([i])) == [i]
                   and tok.decode([i]).strip() and "'" not in tok.decode([i]))
    text = tok.decode([b])
    assert b not in stored                                   # not a candidate the page could offer before
    at.text_input(key="ex_b_text").set_value(text).run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    captions = [c.value.replace("\\'", "'") for c in at.caption]          # plain() escapes quotes as \\'
    caption = next(c for c in captions if c.startswith(f"Step {step}:"))
    assert f"B = {text!r}" in caption, caption
    shown = next(c for c in captions if f"logit({text!r}) = " in c)
    b_logit = float(shown.split(f"logit({text!r}) = ")[1].split(". ")[0].rstrip(".,"))
    assert b_logit == pytest.approx(float(logits[b]), abs=1e-3)
    a = res.token_ids[step]
    diff = float([m.value for m in at.metric if m.label == "logit(A) − logit(B)"][-1])
    assert diff == pytest.approx(float(logits[a] - logits[b]), abs=1e-4)
    assert rank >= 150 and torch.isfinite(logits).all()


def test_a_typed_b_that_is_not_one_token_is_named(page):  # noqa: F811
    at = page.run()
    at.text_input(key="ex_b_text").set_value("London is big").run()
    assert not at.exception, at.exception
    (err,) = at.error
    assert "the B 'London is big' is" in err.value and "tokens (" in err.value
    assert "give the text of exactly one token" in err.value


def test_in_projector_mode_the_explain_tables_are_html_tables_not_grids(page):  # noqa: F811
    """Issue 33, item 6: Explain still showed small st.dataframe grids in projector mode."""
    at = page
    at.session_state["sb_projector"] = True
    at.run()
    assert not at.exception, at.exception
    assert len(at.dataframe) == 0 and len(at.table) >= 2        # the top components and the sampler stages
