"""LazyContext: deferred drafter-context extension gives the drafter exactly what eager
extension would have (tokens and feature rows, in order, after any rewinds)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dartree.engine.lazy_context import LazyContext


class RecordingDrafter:
    """The drafter's context protocol (length / trim / extend / free), kept as plain lists."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.feats: dict[str, list[torch.Tensor]] = {}
        self.calls = 0

    def length(self, rid):
        return len(self.tokens.get(rid, []))

    def trim(self, rid, length):
        assert 0 <= length <= self.length(rid)
        self.tokens[rid] = self.tokens.get(rid, [])[:length]
        self.feats[rid] = self.feats.get(rid, [])[:length]

    def extend(self, rids, tokens, features):
        self.calls += 1
        assert len(rids) == len(set(rids)), "one entry per request and call"
        for rid, toks, f in zip(rids, tokens, features):
            assert f.shape[0] == len(toks)
            self.tokens.setdefault(rid, []).extend(toks)
            self.feats.setdefault(rid, []).extend(f.unbind(0))


RIDS = ("a", "b", "c")
op = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(RIDS), st.integers(1, 40)),
    st.tuples(st.just("trim"), st.sampled_from(RIDS), st.integers(0, 100)),
    st.tuples(st.just("flush"), st.lists(st.sampled_from(RIDS), unique=True), st.just(0)),
    st.tuples(st.just("cap"), st.just(None), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(op, max_size=30), max_rows=st.integers(1, 48))
def test_lazy_context_equals_eager_extension(ops, max_rows):
    eager, lazy_drafter = RecordingDrafter(), RecordingDrafter()
    lazy = LazyContext(lazy_drafter, max_bytes=12 * max_rows)   # a row: 3 fp32 features
    counter = 0
    for kind, rid, n in ops:
        if kind == "add":
            toks = list(range(counter, counter + n))
            feats = torch.arange(counter, counter + n, dtype=torch.float32)[:, None].repeat(1, 3)
            counter += n
            eager.extend([rid], [toks], [feats])
            lazy.add(rid, toks, feats)
        elif kind == "trim":
            length = min(n, eager.length(rid))
            eager.trim(rid, length)
            lazy.trim(rid, length)
        elif kind == "flush":
            lazy.flush(rid)
        else:
            lazy.flush()
            assert lazy.bytes <= 12 * max_rows
        for r in RIDS:
            assert lazy.length(r) == eager.length(r)
        assert lazy.bytes == 12 * sum(lazy.waiting(r) for r in RIDS)
    lazy.flush(RIDS)
    assert len(lazy) == 0
    for r in RIDS:
        assert lazy_drafter.tokens.get(r, []) == eager.tokens.get(r, [])
        got = torch.stack(lazy_drafter.feats[r]) if lazy_drafter.feats.get(r) else None
        want = torch.stack(eager.feats[r]) if eager.feats.get(r) else None
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)


def test_rows_wait_until_the_request_drafts_or_the_bound():
    drafter = RecordingDrafter()
    lazy = LazyContext(drafter, max_bytes=4 * 8)    # four rows of two fp32 features
    for step in range(3):                      # three plain steps: nothing reaches the drafter
        lazy.add("a", [step], torch.zeros(1, 2))
        lazy.flush()
    assert drafter.calls == 0 and lazy.length("a") == 3 and len(lazy) == 1
    lazy.add("b", [9], torch.zeros(1, 2))
    lazy.flush()                               # four rows: at the bound, not past it
    assert drafter.calls == 0
    lazy.add("a", [3], torch.zeros(1, 2))      # past it: the request holding most goes
    lazy.flush()                               # until half the bound is left
    assert drafter.calls == 1 and drafter.tokens == {"a": [0, 1, 2, 3]}
    assert lazy.waiting("b") == 1 and lazy.bytes == 8
    lazy.flush(["b"])                          # b drafts: its row goes first
    assert drafter.tokens["b"] == [9] and len(lazy) == 0 and lazy.bytes == 0
    lazy.add("a", [4], torch.zeros(1, 2))
    lazy.free("a")
    assert len(lazy) == 0 and lazy.length("a") == 4 and lazy.bytes == 0


def test_a_small_view_of_a_large_step_tensor_is_copied():
    """What waits holds the memory it is counted for: a request's rows, not the whole step's
    gathered tensor they were cut from."""
    drafter = RecordingDrafter()
    lazy = LazyContext(drafter)
    step = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    big, small = step[:6], step[6:7]
    lazy.add("a", list(range(6)), big)
    lazy.add("b", [6], small)
    kept_a, kept_b = lazy._pending["a"][1][0], lazy._pending["b"][1][0]
    assert kept_a.untyped_storage().data_ptr() == step.untyped_storage().data_ptr()
    assert kept_b.untyped_storage().nbytes() == 16 and torch.equal(kept_b, small)
    assert lazy.bytes == 7 * 16
    lazy.flush(["a", "b"])
    assert torch.equal(torch.stack(drafter.feats["b"]), small)
