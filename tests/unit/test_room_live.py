"""Issue 23, items 1 and 2, below the app: the teacher's run carried live (the document's bounds, the
publisher's pace, the store's live state), a room the store lost re-opened from the teacher's session, and the
room's watcher rerunning screens when the store stops and starts answering and when the live run moves."""
from __future__ import annotations

import pytest

from engine import RunSettings
from engine.inspection.trace import to_bytes
from inspector.session.limits import Limits
from inspector.session.live_run import LiveRun
from inspector.session.rooms import RoomStore
from inspector.session.rooms_live import MAX_LIVE_BYTES, MAX_TEXT_CHARS, MAX_TOP, Live, LivePublisher, LiveToken
from inspector.session.rooms_memory import MemoryBackend
from inspector.session.rooms_redis import RedisError
from inspector.session.rooms_state import Forbidden, NoRoom, RoomError, View
from inspector.session.run import inspect_run
from inspector.ui.room_push import OFFLINE, Watcher, signature


class FakeStep:
    def __init__(self, text: str, prob: float = 0.5, top=()):
        self.text, self.prob, self.top = text, prob, list(top)


class Cand:
    def __init__(self, text, prob):
        self.text, self.prob = text, prob


def test_the_live_document_round_trips_and_refuses_what_is_out_of_bounds():
    live = Live(3, "Tell me", 40, "decode", 1.0, 2, "Once upon", LiveToken(" upon", 0.25, (("a", 0.5),)))
    assert Live.from_json(live.as_json()) == live
    bad = [b"x" * (MAX_LIVE_BYTES + 1), b"{", b'{"phase": "dancing"}',
           Live(3, "p", 4, "decode", text="x" * (MAX_TEXT_CHARS + 1)).as_json(),
           Live(3, "p", 4, "decode", last=LiveToken("a", 0.5, (("b", 0.1),) * (MAX_TOP + 1))).as_json(),
           Live(3, "p", 4, "decode", last=LiveToken("a", 1.5)).as_json()]
    for data in bad:
        with pytest.raises(RoomError):
            Live.from_json(data)


def test_the_publisher_keeps_its_pace_cuts_what_it_sends_and_never_fails_the_run():
    now, sent, ended = [0.0], [], []
    pub = LivePublisher(1, "p" * 5000, 8, publish=sent.append, end=ended.append, every_s=0.15, clock=lambda: now[0])
    pub.progress(0.5)                                    # a change of phase: sent at once
    now[0] = 0.05
    pub.progress(0.9)                                    # the same phase within 0.15 s: held back
    now[0] = 0.1
    pub.token(FakeStep("Once", 0.4, [Cand("x" * 100, 0.3)] * 9))   # decode begins: sent
    now[0] = 0.2
    pub.token(FakeStep(" upon"))                         # 0.1 s later: held
    now[0] = 0.3
    pub.token(FakeStep(" a"))                            # 0.2 s later: sent, with every token so far
    assert [(d.phase, d.tokens) for d in sent] == [("prefill", 0), ("decode", 1), ("decode", 3)]
    assert sent[-1].text == "Once upon a" and len(sent[0].prompt) <= 1000
    assert len(sent[1].last.top) == MAX_TOP and all(len(t) <= 32 for t, _ in sent[1].last.top)
    pub.finished(kept=True, stopped=False)               # the end is always sent; the full run follows
    assert sent[-1].phase == "done" and ended == []

    def down(_):
        raise RedisError("connection refused")
    failing = LivePublisher(2, "p", 8, publish=down, end=down)
    failing.progress(0.1)
    failing.finished(kept=False, stopped=True)
    assert failing.failures == 3              # the progress, the end, and saying that nothing follows


def test_the_store_says_a_run_is_live_until_the_full_run_replaces_it(tiny_model):
    """Issue 31: a run reaches the room's state once, when it is published whole (one new version); while it
    generates, its live document says so."""
    store = RoomStore(MemoryBackend())
    code, token = store.create()
    v0 = store.state(code).version
    live = store.start_live(code, token, "Tell me", 8)
    assert store.state(code).version == v0                                  # starting a run: no new version
    n0, doc = store.live(code)
    assert doc.seq == live.seq and doc.phase == "queued" and doc.prompt == "Tell me"
    n1 = store.publish_live(code, token, Live(live.seq, "Tell me", 8, "decode", 1.0, 1, "Once"))
    assert n1 > n0 and store.live(code)[1].text == "Once" and store.live_version(code) == n1
    with pytest.raises(Forbidden):
        store.publish_live(code, "not-the-token", Live(live.seq, "x", 8))
    run = inspect_run(tiny_model, RunSettings(prompt="Tell me", chat=False, max_new_tokens=3))
    assert store.publish(code, token, run=to_bytes(run)).version == v0 + 1  # the whole run replaces it: one bump
    assert store.live(code)[1] is None
    late = store.publish_live(code, token, Live(live.seq, "Tell me", 8, "done", 1.0, 3, "Once upon a"))
    assert store.live(code)[1] is None and late == store.live_version(code)  # a late update of it: dropped
    second = store.start_live(code, token, "Again", 8)
    assert second.seq == live.seq + 1 and store.live(code)[1].seq == second.seq
    store.end_live(code, token, live.seq)                                   # not the run shown live: nothing
    assert store.live(code)[1].seq == second.seq
    store.end_live(code, token, second.seq)                                 # ended with nothing to show
    assert store.live(code)[1] is None and store.state(code).run_id is not None
    assert store.state(code).version == v0 + 1


def test_a_room_the_store_lost_is_reopened_under_its_code_and_an_ended_room_is_not(tiny_model):
    store = RoomStore(MemoryBackend())
    code, token = store.create()
    run = to_bytes(inspect_run(tiny_model, RunSettings(prompt="Tell me", chat=False, max_new_tokens=3)))
    before = store.publish(code, token, run=run, view=View("attention", layer=1))
    store.b = MemoryBackend()                               # what a Redis restart without persistence leaves
    assert store.state(code) is None and not store.was_ended(code)
    after = store.restore(code, token, view=View("attention", layer=1), run=run)
    assert (after.code, after.run_id, after.view) == (code, before.run_id, before.view)
    assert store.run_bytes(code, after.run_id) == run
    with pytest.raises(Forbidden):                          # the code now belongs to the restored room
        store.restore(code, "another-token", view=View())
    store.end(code, token)
    assert store.was_ended(code)
    with pytest.raises(NoRoom):
        store.restore(code, token, view=View())


class FlakyStore:
    def __init__(self, store):
        self.store, self.down = store, False

    def __getattr__(self, name):
        f = getattr(self.store, name)

        def call(*a, **k):
            if self.down:
                raise RedisError("connection refused")
            return f(*a, **k)
        return call


def test_the_watcher_reruns_screens_when_the_store_stops_and_starts_answering(monkeypatch):
    import inspector.ui.room_push as push
    store = RoomStore(MemoryBackend())
    flaky = FlakyStore(store)
    monkeypatch.setattr(push, "shared_store", lambda: flaky)
    code, token = store.create()
    reruns: list[tuple] = []
    w = Watcher(rerun=lambda sid, fragment=None: reruns.append((sid, fragment)) or True)
    w.watch("s1", "follow", code, signature("follow", store.state(code)))
    w.tick()
    assert reruns == []
    flaky.down = True
    w.tick()
    w.tick()
    assert reruns == [("s1", None)] and w._subs["s1"].seen == OFFLINE     # told once, not at every tick
    flaky.down = False
    w.tick()
    assert reruns == [("s1", None), ("s1", None)]                         # and once more when it answers


def test_the_watcher_reruns_only_the_live_panel_when_the_live_run_moves(monkeypatch):
    import inspector.ui.room_push as push
    store = RoomStore(MemoryBackend())
    monkeypatch.setattr(push, "shared_store", lambda: store)
    code, token = store.create()
    reruns: list[tuple] = []
    w = Watcher(rerun=lambda sid, fragment=None: reruns.append((sid, fragment)) or True)
    w.watch("s1", "follow", code, signature("follow", store.state(code)))
    w.tick()
    assert reruns == []
    live = store.start_live(code, token, "Tell me", 8)                     # a run starts: the screen reruns once
    w.tick()
    w.tick()
    assert reruns == [("s1", None)]
    w.watch("s1", "follow", code, signature("follow", store.state(code), live=live.seq))
    w.watch_live("s1", code, store.live_version(code), "frag-1")
    w.tick()
    assert reruns == [("s1", None)]
    store.publish_live(code, token, Live(live.seq, "Tell me", 8, "decode", 1.0, 1, "Once"))
    w.tick()
    w.tick()
    assert reruns == [("s1", None), ("s1", "frag-1")]                      # then only its live panel
    w.watch("s1", "follow", code, signature("follow", store.state(code), live=live.seq))  # a full rerun: no
    store.publish_live(code, token, Live(live.seq, "Tell me", 8, "decode", 1.0, 2, "Once upon"))  # panel yet
    w.tick()
    assert reruns == [("s1", None), ("s1", "frag-1")]
    store.publish(code, token, run=b"the whole run as trace bytes")          # the run ends: once more
    w.tick()
    w.tick()
    assert reruns == [("s1", None), ("s1", "frag-1"), ("s1", None)]


def test_live_panels_of_many_followers_share_a_rerun_budget(monkeypatch):
    """Each live panel rerun costs its process ~17 ms of CPU: with n followers in a process each panel reruns at
    most every n / LIVE_RERUNS_S seconds (POLL_S at least), so ten followers cannot take the teacher's CPU."""
    import inspector.ui.room_push as push
    store = RoomStore(MemoryBackend())
    monkeypatch.setattr(push, "shared_store", lambda: store)
    clock = [1000.0]
    monkeypatch.setattr(push.time, "monotonic", lambda: clock[0])
    code, token = store.create()
    live = store.start_live(code, token, "Tell me", 64)
    reruns: list[tuple] = []
    w = Watcher(rerun=lambda sid, fragment=None: reruns.append((sid, fragment)) or True)
    n = 30
    for k in range(n):
        w.watch(f"s{k}", "follow", code, signature("follow", store.state(code), live=live.seq))
        w.watch_live(f"s{k}", code, store.live_version(code), f"frag-{k}")
    gap = n / push.LIVE_RERUNS_S                                           # 1.5 s for 30 followers
    per_tick: list[int] = []
    for t in range(40):                                                     # 4 s of ticks, a publish at each
        store.publish_live(code, token, Live(live.seq, "Tell me", 64, "decode", 1.0, t + 1, "x" * (t + 1)))
        before = len(reruns)
        w.tick()
        per_tick.append(len(reruns) - before)
        clock[0] += push.POLL_S
    assert all(f is not None for _, f in reruns)                           # live panels only, no full reruns
    assert per_tick[0] == n and sum(per_tick) <= n * (1 + 4 / gap) + 1    # one each, then one per gap
    assert sum(per_tick) / 4.0 <= push.LIVE_RERUNS_S * 1.5
    few = Watcher(rerun=lambda sid, fragment=None: reruns.append((sid, fragment)) or True)
    few.watch("a", "follow", code, signature("follow", store.state(code), live=live.seq))
    few.watch_live("a", code, store.live_version(code), "frag-a")
    count = len(reruns)
    for t in range(10):                                                     # one follower: at every publish
        store.publish_live(code, token, Live(live.seq, "Tell me", 64, "decode", 1.0, 50 + t, "y"))
        few.tick()
        clock[0] += push.POLL_S
    assert len(reruns) - count == 10


def test_a_live_run_tells_its_observer_and_an_observer_that_fails_does_not_end_it(tiny_model):
    class Recorder:
        def __init__(self, fail=False):
            self.calls, self.fail = [], fail

        def progress(self, f):
            self.calls.append(("progress", f))

        def token(self, step):
            if self.fail:
                raise RuntimeError("observer bug")
            self.calls.append(("token", step.text))

        def finished(self, kept, stopped):
            self.calls.append(("finished", kept, stopped))

    settings = RunSettings(prompt="Tell me a story", chat=False, max_new_tokens=4, ignore_eos=True)
    for fail in (False, True):
        rec = Recorder(fail)
        live = LiveRun(settings, tiny_model.name, 0, observer=rec).start(tiny_model, Limits())
        assert live.wait(60) and live.error is None and live.record is not None
        tokens = [c[1] for c in rec.calls if c[0] == "token"]
        assert tokens == ([] if fail else [s.text for s in live.record.result.steps])
        assert rec.calls[-1] == ("finished", True, False)
        assert any(c[0] == "progress" for c in rec.calls)


def test_chinese_and_emoji_runs_reach_students_to_their_last_token():
    """Issue 31, item 7: the bound is on what is shown (characters), not on its escaping. A 1,200-token Chinese
    and emoji run used to stop updating students at token 852 (its escaped JSON passed 16 KiB)."""
    store = RoomStore(MemoryBackend())
    code, token = store.create()
    live = store.start_live(code, token, "讲一个故事 📖" * 200, 1200)
    pub = LivePublisher(live.seq, "讲一个故事 📖" * 200, 1200, publish=lambda d: store.publish_live(code, token, d),
                        end=lambda seq: None, every_s=0.0)
    texts = ["从前", "有一座山", "😀", "🐉龙", "。\n"]
    for i in range(1200):
        pub.token(FakeStep(texts[i % 5], 0.5, [Cand("山" * 40, 0.2), Cand("👩‍👩‍👧‍👦" * 8, 0.1)] * 3))
    pub.finished(kept=True, stopped=False)
    assert pub.failures == 0
    doc = store.live(code)[1]
    want = "".join(texts[i % 5] for i in range(1200))[-MAX_TEXT_CHARS:]
    assert doc.tokens == 1200 and doc.text == want and len(doc.text) == MAX_TEXT_CHARS
    worst = Live(1, "\x01" * 1000, 8, "decode", 1.0, 3, "\x07" * MAX_TEXT_CHARS,
                 LiveToken("\x1b" * 32, 0.5, (("\x00" * 32, 0.1),) * MAX_TOP))     # 6 bytes a character
    assert len(worst.as_json()) <= MAX_LIVE_BYTES and Live.from_json(worst.as_json()) == worst
