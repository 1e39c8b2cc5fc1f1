"""Generator: greedy/sampled decoding over a Session, stop ids, streaming text, stats."""

from __future__ import annotations

import pytest
import torch

from kvtrace._errors import CacheOverflowError, UsageError
from kvtrace.runtime.generate import Penalties, Sampling, _TextStream, generate, sample, stream
from kvtrace.runtime.session import Session
from kvtrace.spec.cache import CacheSpec, LayerKind, LayerSpec

V = 16


def _script_program(next_of, others=-10.0):
    """A fake program: logits favour next_of(last token) (10, the others ``others``); state[0] counts calls so the
    cache is touched."""

    def run(tokens, input_pos, *state):
        state[0].add_(1)
        logits = torch.full((tokens.shape[0], tokens.shape[1], V), others)
        for t in range(tokens.shape[1]):
            logits[:, t, next_of(int(tokens[0, t]))] = 10.0
        return logits

    return run


def _session(next_of, max_seq_len=32, others=-10.0):
    spec = CacheSpec(layers=(LayerSpec(LayerKind.FULL, 1, 2, max_seq_len),), batch_size=1,
                     max_seq_len=max_seq_len, dtype="float32")
    prog = _script_program(next_of, others)
    return Session(spec, prog, prog)


def test_greedy_follows_the_logits_and_stops_at_eos():
    s = _session(lambda t: t + 1)  # 3 -> 4 -> 5 -> ... ; 9 is eos
    res = generate(s, [1, 2, 3], max_new_tokens=50, eos_ids=(9,))
    assert res.tokens == [4, 5, 6, 7, 8]
    assert res.stats.stop_reason == "eos" and res.stats.new_tokens == 5 and res.stats.prompt_tokens == 3
    assert s.position == 3 + 5  # prefill + one decode per emitted token before eos
    assert res.stats.prefill_ms > 0 and res.stats.peak_rss_mib > 0


def test_max_new_tokens_and_cache_end():
    s = _session(lambda t: (t + 1) % V)
    assert generate(s, [1], max_new_tokens=4).stats.stop_reason == "max_new_tokens"
    s = _session(lambda t: (t + 1) % V, max_seq_len=6)
    res = generate(s, [1, 2], max_new_tokens=100)
    assert res.stats.stop_reason == "max_seq_len" and s.position == 6 and len(res.tokens) == 5


def test_streamed_deltas_add_up_to_the_text():
    s = _session(lambda t: t + 1)
    pieces: list[str] = []
    res = generate(s, [0], max_new_tokens=5, decode_text=lambda ts: "".join(chr(97 + t) for t in ts),
                   on_text=pieces.append)
    assert "".join(pieces) == res.text == "bcdef"


def test_stream_holds_back_incomplete_utf8():
    stream = _TextStream(lambda ts: {1: "a\ufffd", 2: "aé"}[len(ts)])
    assert stream.push([1]) == ""  # half a character: wait
    assert stream.push([1, 2]) == "aé"


def test_sampling_is_seeded_and_filters():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]])
    draws = lambda s: [int(sample(logits, s, torch.Generator().manual_seed(i))) for i in range(50)]  # noqa: E731
    assert set(draws(Sampling(temperature=1.0, top_k=2))) <= {1, 2}
    assert set(draws(Sampling(temperature=1.0, top_p=0.01))) == {1}
    assert draws(Sampling(temperature=1.0, seed=1)) == draws(Sampling(temperature=1.0, seed=1))
    assert int(sample(logits, Sampling(), None)) == 1


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"temperature": float("nan")}, {"temperature": float("inf")},
                                    {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": float("nan")},
                                    {"repetition_penalty": 0.0}, {"repetition_penalty": float("inf")},
                                    {"presence_penalty": 2.5}, {"frequency_penalty": float("nan")},
                                    {"logit_bias": {1: 101}}, {"logit_bias": {-1: 0}}, {"logit_bias": {"1": 0}},
                                    {"logit_bias": {1: float("nan")}}, {"logit_bias": ((1, 2.0), (1, 3.0))},
                                    {"logit_bias": 5}, {"logit_bias": ((1,),)}, {"logit_bias": {True: 1}}])
def test_bad_sampling_settings(kwargs):
    with pytest.raises(UsageError):
        Sampling(**kwargs)


def test_logit_bias_bans_and_favours_tokens_greedy_and_sampled():
    s = _session(lambda t: t + 1)  # 1 -> 2 -> 3 ...; each next token 10, the others -10
    assert generate(s, [1], max_new_tokens=3).tokens == [2, 3, 4]
    s.reset()
    banned = Sampling(logit_bias={3: -100, 5: 30})  # 3 never; 5 (-10 + 30 = 20) beats the favourite (10)
    assert generate(s, [1], max_new_tokens=3, sampling=banned).tokens == [5, 5, 5]
    assert banned.logit_bias == ((3, -100.0), (5, 30.0))  # kept as sorted pairs: frozen, hashable
    assert Sampling(logit_bias=[(5, 30), (3, -100)]) == banned
    draws = {int(sample(torch.zeros(1, V), Sampling(temperature=1.0, logit_bias={7: 100}), torch.Generator()
                        .manual_seed(i))) for i in range(20)}
    assert draws == {7}
    with pytest.raises(UsageError, match=r"token id 16, outside the model's vocabulary \[0, 16\)"):
        sample(torch.zeros(1, V), Sampling(logit_bias={16: 1}), None)


def test_penalties_reshape_the_logits_by_what_the_generation_holds():
    """repetition: a seen token's positive logit divided, a negative one multiplied (prompt and output); presence
    and frequency: subtracted for the output's tokens, frequency once per occurrence."""
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])  # [1, V=5]
    rep = Penalties(Sampling(repetition_penalty=2.0), [0, 1])  # the prompt holds 0 and 1
    assert rep.apply(logits).tolist() == [[1.0, -4.0, 2.0, -2.0, 1.0]]
    rep.add(torch.tensor([[2]]))
    assert rep.apply(logits).tolist() == [[1.0, -4.0, 1.0, -2.0, 1.0]]
    openai = Penalties(Sampling(presence_penalty=0.5, frequency_penalty=0.25), [0, 1])  # the prompt does not count
    assert openai.apply(logits).tolist() == logits.tolist()
    for t in (4, 4, 3):
        openai.add(t)
    assert openai.apply(logits).tolist() == [[2.0, -2.0, 2.0, -2.75, 0.0]]  # 4: 1 - 0.5 - 2 * 0.25
    with pytest.raises(UsageError, match="pass the generation's Penalties"):
        sample(logits, Sampling(repetition_penalty=1.5), None)
    assert not Sampling().penalized and Sampling(frequency_penalty=-1).penalized


def test_a_repetition_penalty_breaks_a_greedy_loop():
    loop = lambda t: 5 if t == 4 else 4  # noqa: E731 - 4 -> 5 -> 4 -> 5 ...
    assert generate(_session(loop, others=5.0), [1], max_new_tokens=6).tokens == [4, 5, 4, 5, 4, 5]
    # the loop's logit 10 becomes 10 / 3 once seen, below the unseen tokens' 5 (the prompt's 1 is seen too)
    res = generate(_session(loop, others=5.0), [1], max_new_tokens=6, sampling=Sampling(repetition_penalty=3.0))
    assert res.tokens[0] == 4 and len(set(res.tokens)) == 6 and 1 not in res.tokens


def test_bad_prompts():
    s = _session(lambda t: t)
    with pytest.raises(UsageError, match="empty"):
        generate(s, [])
    with pytest.raises(CacheOverflowError, match="40 tokens"):
        generate(s, list(range(40)))
    assert s.position == 0


def test_stream_is_the_same_generation_as_an_iterator():
    decode = lambda ts: "".join(chr(97 + t) for t in ts)  # noqa: E731
    want = generate(_session(lambda t: t + 1), [1, 2], max_new_tokens=50, eos_ids=(7,), decode_text=decode)
    s = _session(lambda t: t + 1)
    g = stream(s, [1, 2], max_new_tokens=50, eos_ids=(7,), decode_text=decode)
    assert s.position == 0  # nothing runs before the first next()
    chunks = list(g)
    assert [c.token for c in chunks] == want.tokens == [3, 4, 5, 6]
    assert "".join(c.text for c in chunks) == want.text == g.result.text == "defg"
    assert g.done and g.result.stats.stop_reason == "eos" and g.result.stats.new_tokens == 4


def test_stream_stopped_early_leaves_the_session_at_what_was_generated():
    s = _session(lambda t: (t + 1) % V)
    g = stream(s, [1, 2, 3], max_new_tokens=100)
    first = [next(g).token for _ in range(3)]
    assert first == [4, 5, 6] and not g.done
    assert s.position == 3 + 2  # prefill, then one decode per token before the one just yielded
    assert g.result.tokens == first and g.result.stats.stop_reason == ""


def test_stream_checks_its_arguments_before_any_step():
    s = _session(lambda t: t + 1, max_seq_len=4)
    with pytest.raises(CacheOverflowError, match="5 tokens but only 4"):
        stream(s, [1] * 5)
    with pytest.raises(UsageError, match="empty"):
        stream(s, [])
    assert s.position == 0


def test_a_temperature_that_rounds_to_zero_samples_greedily_not_nan():
    from kvtrace.runtime.generate import Sampling, sample

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    for t in (2.2e-311, 1e-300, 1e-40):  # 0 in float32: x / t would be 0 / 0 = nan at the maximum
        for s in (Sampling(temperature=t), Sampling(temperature=t, top_k=5, top_p=0.5)):
            assert sample(logits, s, torch.Generator().manual_seed(1)).flatten().tolist() == logits.argmax(-1).tolist()
