"""Session semantics over a loaded artifact: position, reset, rewind, snapshot/restore, isolation, bad input."""

from __future__ import annotations

import pytest
import torch

import kvtrace
from conftest import tiny_model
from helpers import assert_close
from kvtrace._errors import CacheOverflowError, UsageError
from kvtrace.cache.hf import cache_kwarg_name
from kvtrace.runtime.session import Snapshot
from kvtrace.spec.tolerances import tolerance_for

MAX_SEQ_LEN = 20
PROMPT_A = torch.tensor([[5, 17, 42, 8, 99, 3, 64]])  # [1, 7]
PROMPT_B = torch.tensor([[11, 12, 13, 100]])  # [1, 4]
TOL = tolerance_for(torch.float32)


@pytest.fixture(scope="module", params=["exported", pytest.param("aoti", marks=pytest.mark.compile)])
def art(request, tmp_path_factory):
    model = tiny_model("llama")
    path = tmp_path_factory.mktemp(f"session-{request.param}") / "tiny.kvt"
    kvtrace.export(model, path, max_seq_len=MAX_SEQ_LEN, backend=request.param)
    art = kvtrace.load(path)
    art.eager = model  # the reference model travels with the artifact in these tests
    return art


def eager(model, cache, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{cache_kwarg_name(model): cache}).logits


def assert_state_equal(a, b, what=""):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert_close(x, y, what=f"{what} state[{i}]")


def greedy(session, logits, n):
    """n greedy decode steps after ``logits``; returns the list of decode logits."""
    out = []
    for _ in range(n):
        logits = session.decode(logits[:, -1:].argmax(-1))
        out.append(logits)
    return out


def test_position_advances_and_chunked_prefill_equals_one_prefill(art):
    whole = art.session()
    ref = whole.prefill(PROMPT_A)
    assert whole.position == 7
    chunked = art.session()
    assert chunked.position == 0
    first = chunked.prefill(PROMPT_A[:, :1])  # T = 1 through the prefill program
    assert chunked.position == 1
    mid = chunked.prefill(PROMPT_A[:, 1:4])
    assert chunked.position == 4
    last = chunked.prefill(PROMPT_A[:, 4:])
    assert chunked.position == 7
    assert_close(torch.cat([first, mid, last], dim=1), ref, what="chunked prefill logits")
    assert_state_equal(chunked.state, whole.state, "chunked prefill")
    whole.decode(torch.tensor([[1]]))
    assert whole.position == 8


def test_reset_between_prompts_equals_fresh_sessions(art):
    s = art.session()
    la = [s.prefill(PROMPT_A)]
    la += greedy(s, la[0], 3)
    state_a = [t.clone() for t in s.state]
    s.reset()
    assert s.position == 0
    assert all(int(t.count_nonzero()) == 0 for t in s.state)  # back to kv_init = 0
    lb = [s.prefill(PROMPT_B)]
    lb += greedy(s, lb[0], 3)

    fresh_a, fresh_b = art.session(), art.session()
    ra = [fresh_a.prefill(PROMPT_A)]
    ra += greedy(fresh_a, ra[0], 3)
    rb = [fresh_b.prefill(PROMPT_B)]
    rb += greedy(fresh_b, rb[0], 3)
    for i, (x, y) in enumerate(zip(la, ra, strict=True)):
        assert_close(x, y, what=f"prompt A call {i}")
    for i, (x, y) in enumerate(zip(lb, rb, strict=True)):
        assert_close(x, y, what=f"prompt B call {i}")
    assert_state_equal(state_a, fresh_a.state, "prompt A")
    # B is shorter than A: stale slots left by A would show here if reset() did not clear them
    assert_state_equal(s.state, fresh_b.state, "prompt B after reset")
    assert s.position == fresh_b.position == 7


def test_rewind_then_decode_equals_eager_on_the_truncated_sequence(art):
    from transformers import DynamicCache

    s = art.session()
    logits = s.prefill(PROMPT_A)
    greedy(s, logits, 3)
    assert s.position == 10
    s.rewind(4)
    assert s.position == 6
    tok = torch.tensor([[77]])
    got = s.decode(tok)
    assert s.position == 7

    model = art.eager
    cache = DynamicCache(config=model.config)
    eager(model, cache, PROMPT_A[:, :6])
    ref = eager(model, cache, tok)
    assert_close(got, ref, what="decode after rewind")
    for i, layer in enumerate(cache.layers):  # the live prefix matches eager on the truncated sequence
        assert_close(s.state[2 * i][:, :, :7], layer.keys, what=f"layer {i} K")
        assert_close(s.state[2 * i + 1][:, :, :7], layer.values, what=f"layer {i} V")
    ref2 = eager(model, cache, ref.argmax(-1))
    assert_close(s.decode(ref.argmax(-1)), ref2, what="second decode after rewind")

    s.rewind(0)
    assert s.position == 8
    for bad in (-1, 9):
        with pytest.raises(UsageError, match=f"rewind\\({bad}\\).*position \\(8\\)"):
            s.rewind(bad)
    assert s.position == 8
    s.rewind(8)
    assert s.position == 0


def test_snapshot_restore_round_trips(art):
    s = art.session()
    logits = s.prefill(PROMPT_A)
    tok = logits[:, -1:].argmax(-1)
    snap = s.snapshot()
    assert isinstance(snap, Snapshot) and snap.position == 7
    kept = [t.clone() for t in snap.state]
    right_after = s.decode(tok)
    greedy(s, right_after, 4)
    assert s.position == 12
    assert_state_equal(snap.state, kept, "snapshot after more decoding")  # a copy, not a view
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(snap.state, s.state, strict=True))
    live = [t.data_ptr() for t in s.state]
    s.restore(snap)
    assert [t.data_ptr() for t in s.state] == live  # restored in place: programs keep their buffers
    assert s.position == 7
    assert_state_equal(s.state, kept, "restored state")
    assert_close(s.decode(tok), right_after, what="decode after restore")
    # a snapshot restores into another session of the same artifact too
    other = art.session()
    other.restore(snap)
    assert_close(other.decode(tok), right_after, what="decode in another session after restore")


def test_restore_refuses_a_foreign_snapshot(art):
    s = art.session()
    bad = Snapshot(3, tuple(t[:, :, :5].clone() for t in s.state), identity=s.identity)  # right id, wrong shapes
    with pytest.raises(UsageError, match="same artifact"):
        s.restore(bad)
    with pytest.raises(UsageError, match="holds 1 tensors"):
        s.restore(Snapshot(3, (s.state[0].clone(),), identity=s.identity))
    with pytest.raises(UsageError, match=r"unnamed session.*same artifact"):  # not taken from any session
        s.restore(Snapshot(3, tuple(t.clone() for t in s.state)))
    assert s.position == 0


def test_two_sessions_do_not_share_cache_memory(art):
    a, b = art.session(), art.session()
    ptrs_a = {t.data_ptr() for t in a.state}
    ptrs_b = {t.data_ptr() for t in b.state}
    assert len(ptrs_a) == len(a.state) and not ptrs_a & ptrs_b
    a.prefill(PROMPT_A)
    assert b.position == 0
    assert all(int(t.count_nonzero()) == 0 for t in b.state), "running a wrote into b's cache"
    before = [t.clone() for t in a.state]
    b.prefill(PROMPT_B)
    greedy(b, b.prefill(PROMPT_B), 2)
    assert a.position == 7
    assert_state_equal(a.state, before, "a after running b")
    # and a still continues exactly like a session that never saw b
    ref = art.session()
    ref.prefill(PROMPT_A)
    assert_close(a.decode(torch.tensor([[3]])), ref.decode(torch.tensor([[3]])), what="a after b ran")


# --- 5. bad input -----------------------------------------------------------------------------
def test_prompt_longer_than_the_cache_is_refused_untouched(art):
    s = art.session()
    long = torch.randint(0, 128, (1, MAX_SEQ_LEN + 1))
    with pytest.raises(CacheOverflowError, match=f"needs {MAX_SEQ_LEN + 1} cache slots.*max_seq_len={MAX_SEQ_LEN}"):
        s.prefill(long)
    assert s.position == 0
    assert all(int(t.count_nonzero()) == 0 for t in s.state)
    s.prefill(PROMPT_A)
    before = [t.clone() for t in s.state]
    with pytest.raises(CacheOverflowError, match=f"position 7 needs 21 cache slots.*max_seq_len={MAX_SEQ_LEN}"):
        s.prefill(torch.randint(0, 128, (1, 14)))
    assert s.position == 7
    assert_state_equal(s.state, before, "after a refused prefill")
    assert isinstance(CacheOverflowError("x"), UsageError)


def test_decoding_past_the_cache_is_refused(art):
    s = art.session()
    greedy(s, s.prefill(PROMPT_A), MAX_SEQ_LEN - 7)
    assert s.position == MAX_SEQ_LEN
    before = [t.clone() for t in s.state]
    with pytest.raises(CacheOverflowError, match=f"needs {MAX_SEQ_LEN + 1} cache slots.*max_seq_len={MAX_SEQ_LEN}"):
        s.decode(torch.tensor([[1]]))
    assert s.position == MAX_SEQ_LEN
    assert_state_equal(s.state, before, "after a refused decode")
    s.rewind(1)  # room again
    s.decode(torch.tensor([[1]]))
    assert s.position == MAX_SEQ_LEN


@pytest.mark.parametrize(
    ("call", "tokens", "match"),
    [
        ("prefill", torch.zeros(2, 7, dtype=torch.int64), "exported for batch 1; prefill got batch 2"),
        ("decode", torch.zeros(2, 1, dtype=torch.int64), "exported for batch 1; decode got batch 2"),
        ("decode", torch.zeros(1, 2, dtype=torch.int64), r"shape \[B, 1\]; got \[1, 2\]"),
        ("decode", torch.zeros(1, dtype=torch.int64), r"shape \[B, 1\]; got \[1\]"),
        ("prefill", torch.zeros(7, dtype=torch.int64), r"shape \[B, T\]; got torch.int64 \[7\]"),
        ("prefill", torch.zeros(1, 7), "integer token ids"),
        ("prefill", torch.zeros(1, 0, dtype=torch.int64), "0 tokens"),
        ("prefill", torch.tensor([[1, 128]]), r"token id 128, outside the vocabulary \[0, 128\)"),
        ("decode", torch.tensor([[-1]]), r"token id -1, outside the vocabulary \[0, 128\)"),
    ],
)
def test_bad_input_is_refused_with_usage_error(art, call, tokens, match):
    s = art.session()
    with pytest.raises(UsageError, match=match):
        getattr(s, call)(tokens)
    assert s.position == 0
    assert all(int(t.count_nonzero()) == 0 for t in s.state)


def test_int32_and_non_contiguous_tokens_are_accepted(art):
    ref = art.session().prefill(PROMPT_A)
    assert_close(art.session().prefill(PROMPT_A.to(torch.int32)), ref, what="int32 prompt")
    strided = torch.stack([PROMPT_A, PROMPT_A + 1], dim=2)[..., 0]  # [1, 7] with stride 2
    assert not strided.is_contiguous() and torch.equal(strided, PROMPT_A)
    assert_close(art.session().prefill(strided), ref, what="non-contiguous prompt")


# --- 6. trust: arguments are checked before the cache is touched (issue #12) -------------------------
def test_rewind_takes_whole_numbers_only(art):
    s = art.session()
    s.prefill(PROMPT_A)
    for bad in (1.5, True, "2", None, torch.tensor(1.5)):
        with pytest.raises(UsageError, match="whole number of tokens"):
            s.rewind(bad)
        assert s.position == 7
    s.rewind(torch.tensor(2))  # an integer 0-dim tensor is an int
    assert s.position == 5 and isinstance(s.position, int)


def test_token_lists_are_accepted_like_tensors(art):
    ref = art.session()
    want = ref.prefill(PROMPT_A)
    want_next = ref.decode(torch.tensor([[3]]))
    s = art.session()
    assert_close(s.prefill(PROMPT_A[0].tolist()), want, what="prefill of a flat list")
    assert_close(s.decode([[3]]), want_next, what="decode of [[id]]")
    assert_close(art.session().prefill(PROMPT_A.tolist()), want, what="prefill of a list of rows")


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ("hello", "token ids.*got str.*tokenizer"),
        ([1.5, 2.0], "integer token ids; got float"),
        ([[1, 2], [3]], "rows of different lengths"),
        ([True, 2], "integer token ids; got bool"),
        ([2**70], "does not fit in int64"),
        (7, "token ids.*got int"),
    ],
)
def test_bad_token_lists_are_refused_clearly(art, tokens, match):
    s = art.session()
    with pytest.raises(UsageError, match=match):
        s.prefill(tokens)
    assert s.position == 0


def test_text_only_artifact_names_what_it_accepts(art):
    s = art.session()
    with pytest.raises(UsageError, match=r"input\(s\) \['attention_mask'\].*token ids only.*no attention_mask"):
        s.prefill(PROMPT_A, attention_mask=torch.ones(1, 7, dtype=torch.long))
    with pytest.raises(UsageError, match=r"\['pixel_values'\].*accepted named inputs: none"):
        s.prefill(PROMPT_A, pixel_values=torch.zeros(1, 3))
    assert s.position == 0


def test_snapshot_is_tied_to_its_artifact(art, tmp_path):
    s = art.session()
    s.prefill(PROMPT_A)
    snap = s.snapshot()
    assert snap.identity == art.identity == s.identity
    # the same file loaded again is the same artifact
    again = kvtrace.load(art.path).session()
    again.restore(snap)
    assert again.position == 7
    # another model with the very same cache shapes is not
    other_path = tmp_path / "other.kvt"
    kvtrace.export(tiny_model("llama", seed=1), other_path, max_seq_len=MAX_SEQ_LEN, backend="exported")
    other = kvtrace.load(other_path).session()
    assert [t.shape for t in other.state] == [t.shape for t in s.state]
    with pytest.raises(UsageError, match="same artifact"):
        other.restore(snap)
    assert other.position == 0 and all(int(t.count_nonzero()) == 0 for t in other.state)


@pytest.mark.parametrize("position", [-1, MAX_SEQ_LEN + 1, 2.5, True])
def test_restore_refuses_an_impossible_position(art, position):
    import dataclasses

    s = art.session()
    s.prefill(PROMPT_B)
    forged = dataclasses.replace(s.snapshot(), position=position)
    before = [t.clone() for t in s.state]
    with pytest.raises(UsageError, match="snapshot position"):
        s.restore(forged)
    assert s.position == 4
    assert_state_equal(s.state, before, "after a refused restore")


def test_concurrent_use_of_one_session_raises_instead_of_interleaving():
    """A second thread calling into a busy session gets a UsageError; the first call completes intact."""
    import threading

    from kvtrace.runtime.session import Session
    from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec

    inside, release = threading.Event(), threading.Event()

    def slow(tokens, input_pos, *state):  # a program that waits until the test lets it finish
        inside.set()
        assert release.wait(10)
        state[0][:, :, input_pos] += 1
        return torch.zeros(tokens.shape[0], tokens.shape[1], 4)

    spec = CacheSpec(layers=(LayerSpec(LayerKind.FULL, 1, 2, 8),), batch_size=1, max_seq_len=8, dtype="float32")
    s = Session(spec, slow, slow)
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: s.prefill([[1, 2, 3]]))
    t.start()
    assert inside.wait(10)
    for call in (lambda: s.decode([[1]]), lambda: s.prefill([1]), s.reset, lambda: s.rewind(1), s.snapshot):
        try:
            call()
        except UsageError as e:
            errors.append(e)
    release.set()
    t.join(10)
    assert len(errors) == 5 and all("another thread" in str(e) for e in errors)
    assert s.position == 3  # the first call's update, and nothing else
    assert s.state[0][0, 0, :, 0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    s.decode([[4]])  # free again once the first call returned
    assert s.position == 4


def test_every_tensor_a_program_gets_lives_on_the_sessions_device():
    """Positions, tokens and named inputs are built on the state's device (here `meta`: no GPU needed)."""
    from kvtrace.runtime.session import Session
    from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec

    seen: list[str] = []

    def program(*args):
        seen.extend(str(a.device) for a in args)
        return torch.empty(1, args[0].shape[1], 4, device="meta")

    spec = CacheSpec(layers=(LayerSpec(LayerKind.FULL, 1, 2, 8),), batch_size=1, max_seq_len=8, dtype="float32")
    s = Session(spec, program, program, device="meta", key_pos=True)
    s.prefill([[1, 2, 3]])
    s.decode(torch.tensor([[4]]))
    assert seen and set(seen) == {"meta"}, seen
    assert s.position == 4


def test_an_omitted_optional_input_is_built_on_the_sessions_device(monkeypatch):
    """The default of an optional named input is made on the state's device, not on the CPU and copied."""
    from kvtrace.runtime import session as session_mod
    from kvtrace.runtime.session import Session
    from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec
    from kvtrace.spec.program import InputSpec, ProgramSpec

    made: list[str] = []
    full = torch.full

    def recording_full(*a, **kw):
        t = full(*a, **kw)
        made.append(str(t.device))
        return t

    monkeypatch.setattr(session_mod.torch, "full", recording_full)
    seen: list[str] = []

    def program(*args):
        seen.extend(str(a.device) for a in args)
        return torch.empty(1, args[0].shape[1], 4, device="meta")

    spec = CacheSpec(layers=(LayerSpec(LayerKind.FULL, 1, 2, 8),), batch_size=1, max_seq_len=8, dtype="float32")
    image = ProgramSpec("prefill_image", method="forward_image", once=True, inputs=(
        InputSpec("mask", ("B", "T", 3), "float32", binary=True),
        InputSpec("extra_mask", ("B", "T", 3), "float32", default=1.0, binary=True),
    ))
    s = Session(spec, program, program, device="meta", extra={"prefill_image": (image, program)})
    made.clear()  # the state's own allocation
    s.prefill([[1, 2]], mask=torch.ones(1, 2, 3, dtype=torch.bool, device="meta"))
    assert made == ["meta"] and set(seen) == {"meta"}, (made, seen)
