"""Graph decode (runtime.graphs): the bookkeeping on CPU through EagerCapturer and fake programs, the same
decode through a real artifact's programs; on a GPU (marked cuda) real CUDA graphs, bit for bit."""

from __future__ import annotations

import pytest
import torch

import kvtrace
from conftest import tiny_model
from helpers import assert_close
from kvtrace._errors import UsageError
from kvtrace.runtime.graphs import EagerCapturer, GraphDecode, decode_buckets
from kvtrace.runtime.session import Session
from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec

SPEC = CacheSpec(layers=(LayerSpec(LayerKind.FULL, 1, 2, 16),), batch_size=1, max_seq_len=16, dtype="float32")


def test_buckets_double_up_to_max_seq_len():
    assert decode_buckets(1024) == (64, 128, 256, 512, 1024)
    assert decode_buckets(100) == (64, 100)
    assert decode_buckets(40) == (40,)
    assert decode_buckets(16, smallest=4) == (4, 8, 16)


class Recorder:
    """A fake decode program: records what it is called with, writes the token at its position into k, returns
    logits [1, 1, 3] = (token, position, L)."""

    def __init__(self):
        self.calls: list[tuple[int, ...]] = []
        self.fresh_made = 0
        self.parent: Recorder | None = None

    def fresh(self):
        self.fresh_made += 1
        child = Recorder()
        child.parent = self
        return child

    def __call__(self, tokens, input_pos, key_pos, k, v):
        (self.parent or self).calls.append((id(tokens), id(input_pos), id(key_pos), id(k), id(v)))
        k[0, 0, input_pos, 0] = tokens[0, 0].float()
        return torch.stack([tokens[0, 0].float(), input_pos[0].float(), torch.tensor(float(key_pos.shape[0]))]
                           ).reshape(1, 1, 3)


def test_graph_decode_reuses_static_buffers_and_captures_once_per_bucket():
    state = SPEC.allocate()
    program, cap = Recorder(), EagerCapturer()
    g = GraphDecode(program, state, batch=1, device=torch.device("cpu"), key_pos=True, buckets=(4, 8, 16),
                    capturer=cap)
    outs = [g(torch.tensor([[10 + p]]), p).clone() for p in range(12)]
    # each step: the token it was given, its position, the bucket's key_pos length
    assert [o.flatten().tolist() for o in outs] == [[10 + p, p, 4 if p < 4 else 8 if p < 8 else 16] for p in range(12)]
    assert g.stats.captures == 3 and cap.captured == 3 and program.fresh_made == 3  # one instance per graph
    assert g.stats.replays == 12 - 3 and g.stats.buckets == (4, 8, 16)
    tok_ids, pos_ids = {c[0] for c in program.calls}, {c[1] for c in program.calls}
    assert len(tok_ids) == 1 and len(pos_ids) == 1  # the same static token / position tensors every call
    assert {c[3] for c in program.calls} == {id(state[0])}  # the session's own state, never a copy
    assert state[0][0, 0, :12, 0].tolist() == [10 + p for p in range(12)]  # each step wrote once, where it should


def test_replayed_logits_belong_to_the_caller():
    """A replay overwrites the graph's output; what a step returned must not change afterwards."""
    g = GraphDecode(Recorder(), SPEC.allocate(), batch=1, device=torch.device("cpu"), key_pos=True, buckets=(16,),
                    capturer=EagerCapturer())
    first, second, third = (g(torch.tensor([[t]]), p) for p, t in enumerate((7, 8, 9)))
    assert first.flatten()[0] == 7 and second.flatten()[0] == 8 and third.flatten()[0] == 9


def test_a_program_without_key_pos_gets_one_graph():
    calls = []

    def program(tokens, input_pos, k, v):
        calls.append(input_pos.item())
        return torch.zeros(1, 1, 3)

    g = GraphDecode(program, SPEC.allocate(), batch=1, device=torch.device("cpu"), key_pos=False, buckets=(4, 16),
                    capturer=EagerCapturer())
    for p in range(10):
        g(torch.tensor([[1]]), p)
    assert g.stats.captures == 1 and g.stats.buckets == () and calls == list(range(10))


def test_cuda_graphs_on_a_cpu_session_is_refused():
    with pytest.raises(UsageError, match="needs a session on a CUDA device"):
        Session(SPEC, Recorder(), Recorder(), key_pos=True, cuda_graphs=True)


def test_graph_buckets_must_end_at_max_seq_len():
    with pytest.raises(UsageError, match="graph_buckets"):
        Session(SPEC, Recorder(), Recorder(), key_pos=True, cuda_graphs=True, capturer=EagerCapturer(),
                graph_buckets=(4, 8))


# --- through a real artifact: the graph path decodes what the plain one does --------------------------
MAX_SEQ_LEN = 40


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs") / "tiny.kvt"
    kvtrace.export(tiny_model("llama"), path, max_seq_len=MAX_SEQ_LEN, backend="exported", prefill_logits="last")
    return kvtrace.load(path)


def sessions(art):
    """(graph-path session through EagerCapturer with small buckets, the plain session)."""
    from kvtrace.runtime.session import Session

    prefill, decode = art._programs["prefill"], art._programs["decode"]
    g = Session(art.cache_spec, prefill, decode, key_pos=True, cuda_graphs=True, capturer=EagerCapturer(),
                graph_buckets=(8, 16, MAX_SEQ_LEN), identity=art.identity)
    return g, art.session()


def test_graph_path_decodes_as_the_plain_session_across_buckets(art):
    g, plain = sessions(art)
    ids = torch.tensor([[5, 17, 42, 8, 99]])
    lg, lp = g.prefill(ids), plain.prefill(ids)
    ptrs = [t.data_ptr() for t in g.state]
    for _ in range(30):  # positions 5 .. 34: buckets 8, 16, 40
        tok = lp[:, -1:].argmax(-1)
        lg, lp = g.decode(tok), plain.decode(tok)
        assert_close(lg, lp, what=f"logits at {plain.position}")
    for a, b in zip(g.state, plain.state, strict=True):
        assert_close(a, b, what="state")
    assert g.graphs.buckets == (8, 16, MAX_SEQ_LEN) and g.graphs.replays == 27
    assert [t.data_ptr() for t in g.state] == ptrs  # state updated in place, never reallocated


def test_reset_rewind_snapshot_restore_stay_correct_with_graphs(art):
    g, plain = sessions(art)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    tok = g.prefill(ids)[:, -1:].argmax(-1)
    plain.prefill(ids)
    snap = g.snapshot()
    toks, first = [tok], []
    for _ in range(5):
        first.append(g.decode(toks[-1]))
        toks.append(first[-1][:, -1:].argmax(-1))
    g.restore(snap)  # back before the five steps: the graphs replay the same steps, bit for bit
    assert all(torch.equal(g.decode(t), f) for t, f in zip(toks[:5], first, strict=True))
    g.rewind(2)
    assert all(torch.equal(g.decode(t), f) for t, f in zip(toks[3:5], first[3:], strict=True))
    for t in toks[:5]:
        plain.decode(t)
    assert_close(g.decode(toks[5]), plain.decode(toks[5]), what="after rewind")
    g.reset()
    plain.reset()
    assert g.position == 0 and all(not t.any() for t in g.state)
    assert_close(g.prefill(ids), plain.prefill(ids), what="prefill after reset")
    assert_close(g.decode(toks[0]), plain.decode(toks[0]), what="decode after reset")


def test_generate_through_graphs_gives_the_plain_sessions_tokens(art):
    g, plain = sessions(art)
    prompt = [5, 17, 42, 8]
    a = kvtrace.generate(g, prompt, max_new_tokens=20)
    b = kvtrace.generate(plain, prompt, max_new_tokens=20)
    assert a.tokens == b.tokens and len(a.tokens) == 20


def test_graph_path_over_an_int8_cache_decodes_as_the_plain_session(tmp_path):
    """Four state tensors per layer (K, V and their scales): the graph path passes them all, in place."""
    path = tmp_path / "int8.kvt"
    kvtrace.export(tiny_model("llama"), path, max_seq_len=MAX_SEQ_LEN, backend="exported", kv_dtype="int8")
    art = kvtrace.load(path)
    g, plain = art.session(cuda_graphs=True, capturer=EagerCapturer()), art.session()
    assert len(g.state) == 4 * 2
    lg, lp = g.prefill([[5, 17, 42]]), plain.prefill([[5, 17, 42]])
    for _ in range(10):
        tok = lp[:, -1:].argmax(-1).tolist()  # token lists work on the graph path too
        lg, lp = g.decode(tok), plain.decode(tok)
        assert_close(lg, lp, what=f"logits at {plain.position}")
    for a, b in zip(g.state, plain.state, strict=True):
        assert torch.equal(a, b)  # int8 values and float16 scales, written identically


# --- on a GPU ------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.compile
@pytest.mark.parametrize("backend", ["aoti", "exported"])
def test_cuda_graph_replay_changes_no_bit(backend, tmp_path):
    """Real CUDA graphs against the same steps without graphs (EagerCapturer, same bucketed key_pos): every
    logit and every state tensor identical, every step; and the graph session close to eager HF on the GPU."""
    from kvtrace.tools.runners import EagerRunner, SessionRunner

    model = tiny_model("llama", torch.bfloat16).cuda()
    path = tmp_path / "tiny.kvt"
    kvtrace.export(model, path, max_seq_len=MAX_SEQ_LEN, dtype="bfloat16", backend=backend, device="cuda",
                   prefill_logits="last")
    art = kvtrace.load(path)
    assert art.manifest.device == "cuda" and art.device.type == "cuda"
    g, e = art.session(cuda_graphs=True), art.session(cuda_graphs=True, capturer=EagerCapturer())
    with torch.inference_mode():
        lg, le = g.prefill([[5, 17, 42]]), e.prefill([[5, 17, 42]])
        for _ in range(MAX_SEQ_LEN - 4):
            tok = le[:, -1:].argmax(-1)
            lg, le = g.decode(tok), e.decode(tok)
            assert torch.equal(lg, le)
            assert all(torch.equal(a, b) for a, b in zip(g.state, e.state, strict=True))
    assert g.graphs.captures == len(decode_buckets(MAX_SEQ_LEN)) and g.graphs.replays > 0
    report = kvtrace.verify(EagerRunner(model), [SessionRunner(art.session(cuda_graphs=True), backend)],
                            [torch.tensor([[5, 17, 42, 8]])], steps=12, dtype=torch.bfloat16)
    assert report.passed, report.summary()
