"""The batched sampler (turbo.core.sampler.sample_batch) against a per-row reference, on hand-made logits, and in the
engine on a tiny random model: same rules, same seeds → same tokens whatever the batch, one host sync per step."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from lite.formats import LiteturboError
from turbo.core.sampler import RowSampling, sample_batch, top_logprobs

NEG = float("-inf")


# --- the per-row reference (the one-request sampler the batched one replaces) ---------------------------------
def ref_logits(logits, prompt_ids=(), output_ids=(), rep=1.0, pres=0.0, freq=0.0, banned=()):
    x = logits.float().clone()
    if rep != 1.0:
        for t in set(prompt_ids) | set(output_ids):
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t, c in Counter(output_ids).items():
        x[t] -= pres + freq * c
    for t in banned:
        x[t] = NEG
    return x


def ref_support(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """Tokens with non-zero probability, and the probabilities, after temperature → top-k → top-p → min-p."""
    x = logits.float() / temperature
    if 0 < top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], NEG)
    if top_p < 1.0:
        sx, idx = torch.sort(x, descending=True)
        p = torch.softmax(sx, -1)
        sx = sx.masked_fill((p.cumsum(-1) - p) >= top_p, NEG)
        x = torch.full_like(x, NEG).scatter(0, idx, sx)
    p = torch.softmax(x, -1)
    if min_p > 0:
        p = p.masked_fill(p < min_p * p.max(), 0.0)
    p = p / p.sum()
    return {i for i, v in enumerate(p.tolist()) if v > 0}, p


def gen(seed):
    return torch.Generator().manual_seed(seed)


# --- hand-made logits ---------------------------------------------------------------------------------------
def test_greedy_rows_are_argmax_of_the_penalised_logits():
    torch.manual_seed(0)
    logits = torch.randn(7, 64) * 3
    hist = [[1, 2, 3], [5, 5, 9], [], [4, 4, 4, 8], [0], [63, 62], [10, 11]]
    rows, refs = [], []
    for i in range(7):
        opts = dict(repetition_penalty=[1.0, 1.3, 0.7, 1.0, 2.0, 1.0, 1.1][i],
                    presence_penalty=[0.0, 0.5, 0.0, 1.0, 0.0, -0.5, 0.2][i],
                    frequency_penalty=[0.0, 0.25, 0.0, 0.5, 0.0, 0.0, 0.3][i])
        banned = {int(logits[i].argmax())} if i in (2, 5) else ()
        prompt = [7, 8, int(logits[i].argmax())]
        rows.append(RowSampling(prompt_ids=prompt, output_ids=hist[i], banned_ids=banned, **opts))
        refs.append(ref_logits(logits[i], prompt, hist[i], opts["repetition_penalty"], opts["presence_penalty"],
                               opts["frequency_penalty"], banned))
    # a sampled row in the batch changes nothing for the greedy ones
    mixed = rows[:3] + [RowSampling(temperature=1.0, top_p=0.5, generator=gen(1))] + rows[3:]
    mixed_logits = torch.cat([logits[:3], torch.randn(1, 64), logits[3:]])
    before = mixed_logits.clone()
    for lg, rs in ((logits, rows), (mixed_logits, mixed)):
        got = [s.token_id for s in sample_batch(lg, rs)]
        if rs is mixed:
            got = got[:3] + got[4:]
        assert got == [int(r.argmax()) for r in refs]
    assert torch.equal(mixed_logits, before)  # the caller's logits are not modified


def test_penalties_by_hand_through_logprobs():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0], [2.0, -2.0, 1.0, 0.0], [2.0, -2.0, 1.0, 0.0]])
    rows = [RowSampling(repetition_penalty=2.0, prompt_ids=[0], output_ids=[1, 2, 2], logprobs=4),
            RowSampling(presence_penalty=0.5, frequency_penalty=0.25, prompt_ids=[0], output_ids=[1, 2, 2],
                        logprobs=4),
            RowSampling(banned_ids={0}, logprobs=4)]
    want = [[1.0, -4.0, 0.5, 0.0], [2.0, -2.75, 0.0, 0.0], [NEG, -2.0, 1.0, 0.0]]
    out = sample_batch(logits, rows)
    for s, w in zip(out, want):
        lp = dict(s.logprobs)
        ref = torch.log_softmax(torch.tensor(w), -1).tolist()
        for t in range(4):
            if ref[t] == NEG:  # a banned token has no probability: it is no alternative
                assert t not in lp
            else:
                assert lp[t] == pytest.approx(ref[t], abs=1e-6)
    assert [s.token_id for s in out] == [0, 0, 2]  # greedy after penalties (row 3: the ban)


def test_logprobs_per_row_match_top_logprobs():
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    rows = [RowSampling(logprobs=3), RowSampling(), RowSampling(temperature=0.8, generator=gen(0), logprobs=5),
            RowSampling(logprobs=1, banned_ids={int(logits[3].argmax())})]
    out = sample_batch(logits, rows)
    assert out[1].logprobs is None
    for i in (0, 2):
        ref = top_logprobs(logits[i], rows[i].logprobs)
        assert [t for t, _ in out[i].logprobs] == [t for t, _ in ref]
        assert [v for _, v in out[i].logprobs] == pytest.approx([v for _, v in ref], abs=1e-6)
    masked = logits[3].clone()
    masked[logits[3].argmax()] = NEG
    assert out[3].logprobs[0][0] == int(masked.argmax()) == out[3].token_id


@pytest.mark.parametrize("opts", [dict(top_k=1), dict(top_k=2), dict(top_p=0.7), dict(top_p=0.9), dict(min_p=0.2),
                                  dict(top_k=3, top_p=0.8), dict(top_k=3, min_p=0.3), dict(temperature=0.5, top_p=0.8),
                                  dict(temperature=3.0, min_p=0.5), dict()])
def test_support_sets_match_the_reference(opts):
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5, -1.0, 2.5])
    opts = {"temperature": 1.0, **opts}
    want, _ = ref_support(logits, **opts)
    # a batch mixing this row with rows of other options, each row its own generator
    others = [dict(temperature=1.0, top_p=0.5), dict(temperature=0.0), dict(temperature=2.0, top_k=4),
              dict(temperature=1.0)]
    seen = Counter()
    g = gen(0)
    other_gens = [gen(100 + i) for i in range(len(others))]
    for _ in range(300):
        rows = [RowSampling(generator=g, **opts)] + [RowSampling(generator=og, **o)
                                                      for o, og in zip(others, other_gens)]
        seen[sample_batch(logits.expand(len(rows), -1), rows)[0].token_id] += 1
    assert set(seen) == want


def test_min_new_tokens_masks_stop_ids_for_every_kind_of_row():
    logits = torch.tensor([[0.0, 9.0, 1.0, 8.9]] * 3)
    banned = {1, 3}
    rows = [RowSampling(banned_ids=banned), RowSampling(temperature=1.0, generator=gen(0), banned_ids=banned),
            RowSampling(temperature=5.0, top_p=0.99, generator=gen(1), banned_ids=banned)]
    for _ in range(100):
        out = [s.token_id for s in sample_batch(logits, rows)]
        assert out[0] == 2 and not banned & set(out)


def test_same_seed_same_tokens_whatever_the_batch():
    torch.manual_seed(3)
    steps = [torch.randn(50) for _ in range(20)]
    opts = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02)

    def run(position, others):
        g = gen(7)
        other_gens = [gen(50 + i) for i in range(len(others))]
        toks = []
        for lg in steps:
            rows = [RowSampling(generator=og, **o) for o, og in zip(others, other_gens)]
            rows.insert(position, RowSampling(generator=g, **opts))
            batch = torch.randn(len(rows), 50)
            batch[position] = lg
            toks.append(sample_batch(batch, rows)[position].token_id)
        return toks

    alone = run(0, [])
    assert len(set(alone)) > 3  # it does sample
    assert run(0, []) == alone
    assert run(2, [dict(), dict(temperature=1.0), dict(temperature=0.5, top_p=0.3)]) == alone
    assert run(1, [dict(temperature=1.2, min_p=0.1)]) == alone
    assert run(3, [dict(temperature=0.7)] * 5) == alone  # only top-k/min-p elsewhere: the unsorted path


def test_row_index_picks_rows_of_the_logits():
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 0.0, 0.0], [0.0, 0.0, 7.0]])
    out = sample_batch(logits, [RowSampling(), RowSampling()], row_index=[2, 0])
    assert [s.token_id for s in out] == [2, 1]


def test_distribution_of_seeded_draws():
    p = torch.tensor([0.5, 0.3, 0.2])
    logits = p.log()
    n = 2000
    # one request drawing 2000 times, and 2000 requests drawing once in one batch
    g = gen(0)
    one = Counter(sample_batch(logits[None], [RowSampling(temperature=1.0, generator=g)])[0].token_id
                  for _ in range(n))
    batch = Counter(s.token_id for s in sample_batch(
        logits.expand(n, -1), [RowSampling(temperature=1.0, generator=gen(i)) for i in range(n)]))
    for counts in (one, batch):
        for t in range(3):
            assert abs(counts[t] / n - p[t].item()) < 0.04, counts
    # top-p 0.75 keeps {0, 1} renormalised: .625 / .375
    g = gen(1)
    tp = Counter(sample_batch(logits[None], [RowSampling(temperature=1.0, top_p=0.75, generator=g)])[0].token_id
                 for _ in range(n))
    assert set(tp) == {0, 1} and abs(tp[0] / n - 0.625) < 0.04
    # temperature 2 flattens: p ∝ p**0.5
    g = gen(2)
    t2 = Counter(sample_batch(logits[None], [RowSampling(temperature=2.0, generator=g)])[0].token_id
                 for _ in range(n))
    q = p.sqrt() / p.sqrt().sum()
    for t in range(3):
        assert abs(t2[t] / n - q[t].item()) < 0.04


def test_one_host_sync_per_call(monkeypatch):
    calls = Counter()
    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    torch.manual_seed(0)
    logits = torch.randn(5, 40)
    rows = [RowSampling(temperature=1.0, top_p=0.9, top_k=5, min_p=0.1, generator=gen(0), output_ids=[1, 1],
                        presence_penalty=0.5, frequency_penalty=0.1),
            RowSampling(repetition_penalty=1.2, prompt_ids=[3, 4], banned_ids={5}),
            RowSampling(temperature=0.7, generator=gen(1), logprobs=3),
            RowSampling(), RowSampling(temperature=1.0, top_k=3, generator=gen(2))]
    sample_batch(logits, rows)
    # on the CPU the top-p row's candidate check reads one bool (no device to wait for; an accelerator sorts instead)
    assert dict(calls) == {"tolist": 1, "__bool__": 1}
    calls.clear()
    sample_batch(logits, [RowSampling(temperature=1.0, generator=gen(0))] * 5)
    assert dict(calls) == {"tolist": 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rows_match_cpu_rules():
    dev = torch.device("cuda")
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]] * 2, device=dev)
    rows = [RowSampling(temperature=1.0, top_p=0.7, generator=torch.Generator(dev).manual_seed(0)),
            RowSampling(repetition_penalty=3.0, prompt_ids=[1])]
    seen = Counter()
    for _ in range(200):
        out = sample_batch(logits, rows)
        seen[out[0].token_id] += 1
        assert out[1].token_id == 2
    assert set(seen) == {1, 2}
    a = [sample_batch(logits[:1], [RowSampling(temperature=1.0, generator=torch.Generator(dev).manual_seed(9))])[0]
         .token_id for _ in range(5)]
    assert len(set(a)) == 1


# --- in the engine ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from tiny_models import build_key_outlier_model

    from turbo import Engine, EngineConfig

    path = build_key_outlier_model(tmp_path_factory.mktemp("tiny") / "model")
    return Engine(path, EngineConfig(dtype="float32", max_kv_tokens=1024, block_size=16, batch_invariant=True,
                                     enable_prefix_caching=False))


def _run_all(engine, reqs):
    while engine.has_unfinished():
        engine.step()
    return [r.output_ids for r in reqs]


def test_engine_seeded_generation_is_the_same_alone_and_batched(tiny_engine, monkeypatch):
    import turbo.core.engine as engine_mod
    from turbo import GenerationConfig

    e = tiny_engine
    prompt = list(range(2, 30))
    g = GenerationConfig(max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=11, ignore_eos=True)
    alone = _run_all(e, [e.add_request(prompt, g)])[0]
    assert _run_all(e, [e.add_request(prompt, g)])[0] == alone
    assert len(set(alone)) > 2

    calls = []
    real = engine_mod.sample_batch

    def counted(logits, rows, row_index=None):
        calls.append(len(rows))
        return real(logits, rows, row_index)

    monkeypatch.setattr(engine_mod, "sample_batch", counted)
    others = [GenerationConfig(max_new_tokens=20, ignore_eos=True),
              GenerationConfig(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True, logprobs=2),
              GenerationConfig(max_new_tokens=20, temperature=0.7, top_p=0.5, seed=6, ignore_eos=True,
                               repetition_penalty=1.3, presence_penalty=0.2, min_new_tokens=3)]
    reqs = [e.add_request(list(range(40, 40 + 5 * i + 3)), o) for i, o in enumerate(others)]
    reqs.insert(2, e.add_request(prompt, g))
    out = _run_all(e, reqs)
    assert out[2] == alone
    assert max(calls) == 4  # one batched call with every row that got a token in the step
    assert all(len(lp) == 2 for lp in reqs[1].logprobs) and len(reqs[1].logprobs) == 12


def test_engine_sampling_failure_ends_only_that_request(tiny_engine, monkeypatch):
    import turbo.core.engine as engine_mod
    from turbo import GenerationConfig

    e = tiny_engine
    real = engine_mod.sample_batch

    def flaky(logits, rows, row_index=None):
        if any(r.temperature == 0.7 for r in rows):
            raise RuntimeError("boom in sampling")
        return real(logits, rows, row_index)

    monkeypatch.setattr(engine_mod, "sample_batch", flaky)
    good = e.add_request([5, 6, 7], GenerationConfig(max_new_tokens=5, ignore_eos=True))
    bad = e.add_request([8, 9], GenerationConfig(max_new_tokens=5, temperature=0.7, seed=1))
    _run_all(e, [good, bad])
    assert bad.finish_reason == "error" and "boom" in str(bad.error)
    assert good.finish_reason == "length" and len(good.output_ids) == 5
    assert e.stats()["blocks_free"] == e.stats()["blocks_total"]


def test_nan_or_all_banned_logits_raise_naming_the_row():
    logits = torch.randn(3, 10)
    logits[1, 4] = float("nan")
    rows = [RowSampling(), RowSampling(), RowSampling(temperature=0.8, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(LiteturboError, match="row 1: the logits are NaN or all -inf"):
        sample_batch(logits, rows)
    logits = torch.full((2, 10), float("-inf"))
    logits[0, 3] = 1.0
    ok = sample_batch(logits[:1], rows[:1])
    assert ok[0].token_id == 3
    with pytest.raises(LiteturboError, match="row 1"):
        sample_batch(logits, [RowSampling(), RowSampling(temperature=0.8, generator=torch.Generator())])


def test_nan_logits_fail_only_their_request_and_session_recovers(tmp_path):
    """A token whose embedding is NaN: the turn that uses it fails with an error naming the request, other requests
    finish, and the session's next turn works (the failed turn's tokens and K/V are not kept)."""
    from safetensors.torch import load_file, save_file

    from tiny_models import build_key_outlier_model
    from turbo import Engine, EngineConfig

    from transformers import AutoTokenizer

    path = build_key_outlier_model(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(str(path))
    sd = load_file(str(path / "model.safetensors"))
    engine0 = Engine(path, EngineConfig(dtype="float32", max_kv_tokens=512, block_size=8))
    bad_id = engine0.encode("the")[0]
    sd["model.embed_tokens.weight"][bad_id] = float("nan")
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    engine = Engine(path, EngineConfig(dtype="float32", max_kv_tokens=512, block_size=8))
    from turbo import GenerationConfig

    g3 = GenerationConfig(max_new_tokens=3, ignore_eos=True)
    good = engine.add_request("of and to in", g3)
    bad = engine.add_request("of the and", g3)
    while engine.has_unfinished():
        engine.step()
    assert good.finish_reason == "length" and len(good.output_ids) == 3
    assert bad.finish_reason == "error" and isinstance(bad.error, LiteturboError)
    assert f"request {bad.seq.seq_id}: the logits are NaN" in str(bad.error)
    s = engine.session()
    first = s.chat("of and", max_new_tokens=2)
    with pytest.raises(LiteturboError, match="NaN"):
        s.chat("the", max_new_tokens=2)
    assert len(s.messages) == 2  # the failed turn left no message
    again = s.chat("of and", max_new_tokens=2)  # not poisoned by the failed turn's K/V
    assert isinstance(again, str) and again == first  # greedy, same conversation so far


def test_a_temperature_that_overflows_the_logits_acts_as_greedy():
    """x / T overflows float32 for a subnormal or tiny T: such a row must pick the argmax (the limit T -> 0), not
    junk drawn from NaN probabilities; a row with a usable T beside it still draws."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 5
    logits[3] = -logits[3].abs() - 1  # every logit negative: x / T -> -inf for all of them
    rows = [RowSampling(temperature=t, generator=torch.Generator().manual_seed(i))
            for i, t in enumerate((1e-45, 1e-39, 1e-38, 1e-44))]
    got = [s.token_id for s in sample_batch(logits, rows)]
    assert got == logits.argmax(-1).tolist()
    mixed = [RowSampling(temperature=1e-45), RowSampling(temperature=1.0, generator=torch.Generator().manual_seed(3))]
    out = sample_batch(logits[:2], mixed)
    ref = sample_batch(logits[1:2], [RowSampling(temperature=1.0, generator=torch.Generator().manual_seed(3))])
    assert out[0].token_id == logits[0].argmax().item() and out[1].token_id == ref[0].token_id
    inf = logits[:1].clone()
    inf[0, 7] = inf[0, 9] = float("inf")  # what a tiny repetition_penalty makes of positive seen logits
    assert sample_batch(inf, [RowSampling(temperature=1.0, generator=torch.Generator().manual_seed(0))])[0].token_id == 7


def test_logit_bias_is_added_after_the_penalties_and_shows_in_logprobs():
    from turbo import GenerationConfig

    torch.manual_seed(1)
    logits = torch.randn(2, 40)
    top = logits[0].argmax().item()
    rows = [RowSampling(logit_bias={top: -100.0, 5: 2.5}, logprobs=3), RowSampling(logprobs=3)]
    out = sample_batch(logits, rows)
    want = logits[0].clone()
    want[top] -= 100
    want[5] += 2.5
    assert out[0].token_id == want.argmax().item() != top
    assert out[0].logprobs == top_logprobs(want, 3)
    assert out[1].token_id == logits[1].argmax().item()  # the other row is untouched
    g = GenerationConfig(logit_bias={"7": 100, 3: -1.5})  # JSON object keys are strings
    assert g.logit_bias == {7: 100.0, 3: -1.5}
    for bad, why in (({"x": 1}, "not a token id"), ({1: 101}, "token 1 has 101"), ({-1: 1}, "not a token id"),
                     ({1: float("nan")}, "token 1 has nan"), ([1], "must map token ids"), ({1: True}, "True")):
        with pytest.raises(LiteturboError, match=why):
            GenerationConfig(logit_bias=bad)


def test_token_mask_rows_mixed_with_free_rows():
    """A constraint's mask (0 / -inf, float32) restricts only its row; a +inf logit it forbids gives no NaN."""
    torch.manual_seed(3)
    logits = torch.randn(3, 16)
    logits[1, 5] = float("inf")  # forbidden by row 1's mask: it must still sample among the allowed ones
    mask = torch.full((16,), float("-inf"))
    mask[[2, 7, 11]] = 0.0
    rows = [RowSampling(logprobs=3), RowSampling(token_mask=mask, logprobs=5),
            RowSampling(token_mask=mask, temperature=0.7, generator=gen(4))]
    out = sample_batch(logits, rows)
    assert out[0].token_id == int(logits[0].argmax())
    assert out[1].token_id == [2, 7, 11][int(logits[1, [2, 7, 11]].argmax())]
    assert {t for t, _ in out[1].logprobs} == {2, 7, 11}  # masked tokens are no alternatives
    ref = torch.log_softmax(logits[1, [2, 7, 11]], -1)
    assert sorted(v for _, v in out[1].logprobs) == pytest.approx(sorted(ref.tolist()), abs=1e-6)
    assert out[2].token_id in (2, 7, 11)


def test_top_p_from_candidates_keeps_the_same_nucleus_as_a_full_sort():
    """The nucleus is decided on each row's 64 largest logits when they hold the mass, by a full sort otherwise: both
    give the full stable sort's set, ties in bf16 logits (ordered by token id) and masked tokens included."""
    from turbo.core.sampler import NUCLEUS_CANDIDATES, _nucleus, _nucleus_sorted

    g = torch.Generator().manual_seed(0)
    vocab = 4096
    rows = [torch.randn(vocab, generator=g) * scale for scale in (0.3, 1.0, 3.0, 8.0)]  # flat to peaked
    rows.append((torch.randn(vocab, generator=g) * 4).to(torch.bfloat16).float())  # many exact ties
    tied = torch.full((vocab,), -5.0)
    tied[:200] = 2.0  # 200 equal top logits: the boundary falls inside a tie
    rows.append(tied)
    few = torch.full((vocab,), NEG)
    few[[5, 900, 3000]] = torch.tensor([1.0, 0.5, 0.2])  # fewer finite tokens than candidates
    rows.append(few)
    s = torch.stack(rows)
    for p in (0.05, 0.5, 0.9, 0.99, float("inf")):
        top_p = torch.full((len(rows),), p)
        got, want = _nucleus(s, top_p), _nucleus_sorted(s, top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), p
        assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])
    # the flat rows need the fallback at p = 0.9 (their 64 largest hold less), the peaked ones do not
    probs = torch.softmax(s, -1)
    top = probs.topk(NUCLEUS_CANDIDATES, -1).values.sum(-1)
    assert top[0] < 0.9 < top[3]
