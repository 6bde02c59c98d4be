"""The engine against the reference implementation and against itself: batch invariance, prefix sharing,
memory pressure, sampling."""

from __future__ import annotations

import json

import pytest
import torch

from lingctl.flood.engine.forward import MIN_ROWS
from lingctl.flood.engine.loop import Engine, EngineConfig, GenRequest
from lingctl.flood.engine.sampling import SamplingParams, request_generator, sample
from lingctl.flood.weights.model_dir import ModelDir
from tests.flood.conftest import FIXTURES, tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def prompts(n: int, seed: int = 0, shared: int = 40, vocab: int = 1024) -> list[list[int]]:
    """Varied lengths (1..60); every other prompt starts with the same ``shared`` tokens."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(2, vocab, (shared,), generator=g).tolist()
    out = []
    for i in range(n):
        own = torch.randint(2, vocab, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        out.append((system if i % 2 else []) + own)
    return out


def run(model, ps, sampling=GREEDY, **config):
    config.setdefault("kv_cache_tokens", 4096)
    engine = Engine.local(model, EngineConfig(**config))
    reqs = [GenRequest(key=i, prompt_ids=p, sampling=sampling, seed_key=f"r{i}") for i, p in enumerate(ps)]
    results = list(engine.generate(reqs))
    return {r.key: r for r in results}, engine.stats, [r.key for r in results]


@pytest.fixture(scope="module")
def model():
    m = tiny_model()
    m.eval()
    m.normalize_head_()
    return m


def full_recompute(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", ["moe-normhead", "moe-variant"])
def test_greedy_matches_the_reference_implementation(name):
    """Token for token against Ling's own BailingMoeForCausalLM (fixtures/flood/README.md says how the
    reference ids were produced), all prompts in one batch."""
    ref = json.loads((FIXTURES / "reference.json").read_text())["checkpoints"][name]
    model = ModelDir.open(FIXTURES / name).load(dtype=torch.float32)
    cases = ref["cases"]
    sampling = SamplingParams(max_tokens=len(cases[0]["generated"]), temperature=0.0)
    out, _, _ = run(model, [c["prompt"] for c in cases], sampling)
    for i, case in enumerate(cases):
        assert out[i].token_ids == case["generated"], f"prompt {i} (length {len(case['prompt'])})"
        assert out[i].finish_reason == "length"


def test_first_step_logits_are_close_to_the_reference():
    ref = json.loads((FIXTURES / "reference.json").read_text())["checkpoints"]["moe-normhead"]
    md = ModelDir.open(FIXTURES / "moe-normhead")
    model = md.load(dtype=torch.float32)
    with torch.no_grad():
        for case in ref["cases"]:
            logits = model(torch.tensor([case["prompt"]])).logits[0, -1]
            assert torch.allclose(logits, torch.tensor(case["first_logits"]), atol=1e-4)


def test_matches_recomputing_the_whole_sequence(model):
    ps = prompts(8)
    out, _, _ = run(model, ps)
    for i, p in enumerate(ps):
        assert out[i].token_ids == full_recompute(model, p, 12)


def test_a_request_gets_the_same_tokens_alone_and_among_64_others(model):
    ps = prompts(65, seed=3)
    together, stats, _ = run(model, ps)
    assert stats.scheduler.steps < 65 * 12  # they did share steps
    for i in (0, 1, 17, 64):
        alone, _, _ = run(model, [ps[i]])
        assert alone[0].token_ids == together[i].token_ids


def test_batch_invariance_is_bitwise_for_the_logits(model):
    """Stronger than equal tokens: every logit a request samples from is the same bits in any batch."""
    seen: dict[int, list[torch.Tensor]] = {}

    class Recording(Engine):
        def _on_sample(self, sched, seq, logits_V, done, **kwargs):
            seen.setdefault(seq.key.key, []).append(logits_V.clone())
            super()._on_sample(sched, seq, logits_V, done, **kwargs)

    ps = prompts(9, seed=5)
    sampling = SamplingParams(max_tokens=4, temperature=0.0)

    def logits_of(batch: list[int]) -> dict[int, list[torch.Tensor]]:
        seen.clear()
        engine = Engine.local(model, EngineConfig(kv_cache_tokens=2048))
        engine.__class__ = Recording
        list(engine.generate([GenRequest(key=i, prompt_ids=ps[i], sampling=sampling) for i in batch]))
        return dict(seen)

    together = logits_of(list(range(9)))
    for i in (0, 3, 8):
        alone = logits_of([i])[i]
        assert len(alone) == 4
        assert all(torch.equal(a, b) for a, b in zip(alone, together[i]))


def test_prefix_sharing_gives_the_same_tokens_with_fewer_prefill_tokens(model):
    ps = prompts(16, seed=7, shared=48)
    shared, s1, _ = run(model, ps, prefix_sharing=True)
    plain, s2, _ = run(model, ps, prefix_sharing=False)
    assert all(shared[i].token_ids == plain[i].token_ids for i in range(len(ps)))
    assert s1.prefix_entries >= 1 and s1.prefix_hits == 8
    assert s1.prefix_tokens_saved == 7 * 48
    assert s1.scheduler.prefill_tokens == s2.scheduler.prefill_tokens - 7 * 48
    assert all(shared[i].cached_tokens == 48 for i in range(1, 16, 2))


def test_memory_pressure_extends_appends_waits_and_preempts_without_changing_tokens(model):
    ps = prompts(12, seed=9)
    roomy, _, _ = run(model, ps)
    tight, stats, _ = run(model, ps, kv_cache_tokens=120, output_reserve=2, growth=2, max_batch_tokens=32)
    assert all(roomy[i].token_ids == tight[i].token_ids for i in range(len(ps)))
    s = stats.scheduler
    assert s.extended > 0 and s.appended > 0 and s.waits > 0 and s.preemptions > 0
    assert s.peak_used_slots <= 120


def test_results_arrive_in_completion_order(model):
    ps = prompts(4, seed=11)
    sampling = [SamplingParams(max_tokens=n, temperature=0.0) for n in (20, 1, 10, 3)]
    engine = Engine.local(model, EngineConfig(kv_cache_tokens=1024))
    order = [
        r.key
        for r in engine.generate(
            GenRequest(key=i, prompt_ids=p, sampling=s) for i, (p, s) in enumerate(zip(ps, sampling))
        )
    ]
    assert order == [1, 3, 2, 0]


def test_seeded_sampling_is_reproducible_and_batch_free(model):
    ps = prompts(6, seed=13)
    s = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=42)
    a, _, _ = run(model, ps, s)
    b, _, _ = run(model, ps[2:3], s)
    assert a[2].token_ids == b[0].token_ids
    other = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=43)
    c, _, _ = run(model, ps, other)
    assert any(a[i].token_ids != c[i].token_ids for i in range(6))


def test_eos_stops_a_request(model):
    ps = prompts(1, seed=15)
    free, _, _ = run(model, ps)
    eos = free[0].token_ids[3]
    first = free[0].token_ids.index(eos)
    engine = Engine.local(model, EngineConfig(kv_cache_tokens=1024), eos_ids=[eos])
    res = next(iter(engine.generate([GenRequest(key=0, prompt_ids=ps[0], sampling=GREEDY)])))
    assert res.finish_reason == "stop" and res.token_ids == free[0].token_ids[: first + 1]


def _one(model, prompt, sampling, eos):
    engine = Engine.local(model, EngineConfig(kv_cache_tokens=1024), eos_ids=[eos])
    return next(iter(engine.generate([GenRequest(key=0, prompt_ids=prompt, sampling=sampling)])))


def test_ignore_eos_and_min_tokens_hold_the_end_of_sequence_back_as_vllm_does(model):
    ps = prompts(1, seed=15)
    free, _, _ = run(model, ps)
    eos = free[0].token_ids[0]  # the first greedy token, made the end-of-sequence token
    assert _one(model, ps[0], GREEDY, eos).token_ids == [eos]  # stops at once
    ignoring = _one(model, ps[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), eos)
    assert ignoring.finish_reason == "length" and ignoring.token_ids == free[0].token_ids
    # min_tokens: the token is masked for the first 3, so the answer starts with the runner-up
    held = _one(model, ps[0], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=3), eos)
    assert len(held.token_ids) >= 3 and eos not in held.token_ids[:3]
    assert held.finish_reason == "length" or (held.finish_reason == "stop" and held.token_ids[-1] == eos)


def test_min_tokens_holds_stop_strings_back_too(model):
    """A stop string only counts from min_tokens on (vLLM checks stops only then): with a stop check that
    matches anything, the answer has exactly min_tokens tokens."""
    ps = prompts(1, seed=16)
    engine = Engine.local(model, EngineConfig(kv_cache_tokens=1024), stop_check=lambda ids, stops: "")
    sampling = SamplingParams(max_tokens=12, temperature=0.0, stop=["x"], min_tokens=4)
    res = next(iter(engine.generate([GenRequest(key=0, prompt_ids=ps[0], sampling=sampling)])))
    assert (res.finish_reason, len(res.token_ids)) == ("stop", 4)


def test_penalties_change_greedy_answers_and_stay_batch_invariant(model):
    """repetition_penalty discourages every token already seen: a greedy answer that repeats a token changes,
    and a request's answer is the same alone and in a batch (the penalties use its own tokens only)."""
    ps = prompts(8, seed=21)
    plain, _, _ = run(model, ps)
    strong = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=5.0)
    together, _, _ = run(model, ps, strong)
    assert any(together[i].token_ids != plain[i].token_ids for i in range(8))
    repeats = sum(len(r.token_ids) - len(set(r.token_ids)) for r in together.values())
    assert repeats < sum(len(r.token_ids) - len(set(r.token_ids)) for r in plain.values())
    for i in (0, 5):
        alone, _, _ = run(model, [ps[i]], strong)
        assert alone[0].token_ids == together[i].token_ids
    presence = SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    pres, _, _ = run(model, ps[:2], presence)
    assert pres[0].token_ids[0] == plain[0].token_ids[0]  # nothing in the output yet: the first token is the same


def test_min_p_keeps_only_tokens_near_the_most_likely_and_a_seed_repeats_it(model):
    ps = prompts(4, seed=22)
    greedy, _, _ = run(model, ps)
    # min_p=1 keeps the most likely token alone: sampling then gives the greedy answer
    only_top, _, _ = run(model, ps, SamplingParams(max_tokens=12, temperature=1.0, min_p=1.0, seed=3))
    assert all(only_top[i].token_ids == greedy[i].token_ids for i in range(4))
    loose = SamplingParams(max_tokens=12, temperature=1.5, min_p=0.05, seed=3)
    a, _, _ = run(model, ps, loose)
    b, _, _ = run(model, list(reversed(ps)), loose)
    assert all(a[i].token_ids == b[3 - i].token_ids for i in range(4))


def test_logprobs_are_the_models_own_and_do_not_depend_on_the_batch(model):
    """Each new token's log-probability (and the top 3) is the log-softmax of the model's logits at its position,
    as a plain forward pass over prompt + answer gives it; the same alone and in a batch."""
    ps = prompts(5, seed=23)
    asked = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    together, _, _ = run(model, ps, asked)
    for i in (0, 3):
        res = together[i]
        assert res.token_logprobs is not None and len(res.token_logprobs) == len(res.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([ps[i] + res.token_ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        for k, (token, (own, top)) in enumerate(zip(res.token_ids, res.token_logprobs, strict=True)):
            at = len(ps[i]) - 1 + k
            assert own == pytest.approx(float(lp[at, token]), abs=1e-4)
            assert [t for t, _ in top] == lp[at].topk(3).indices.tolist()
            assert top[0][0] == token  # greedy: the chosen token is the most likely
        alone, _, _ = run(model, [ps[i]], asked)
        assert alone[0].token_logprobs == res.token_logprobs
    plain, _, _ = run(model, ps[:1])
    assert plain[0].token_logprobs is None


def test_context_limit_and_bad_prompts_are_reported_per_request(model):
    limit = model.config.max_position_embeddings
    reqs = [
        GenRequest(key="long", prompt_ids=[5] * limit, sampling=GREEDY),
        GenRequest(key="vocab", prompt_ids=[5, 99999], sampling=GREEDY),
        GenRequest(key="edge", prompt_ids=[5] * (limit - 3), sampling=SamplingParams(max_tokens=None, temperature=0.0)),
        GenRequest(key="ok", prompt_ids=[5, 6], sampling=GREEDY),
    ]
    engine = Engine.local(model, EngineConfig(kv_cache_tokens=2048))
    out = {r.key: r for r in engine.generate(reqs)}
    assert out["long"].finish_reason == "error" and out["long"].error is not None and "context" in out["long"].error
    assert (
        out["vocab"].finish_reason == "error" and out["vocab"].error is not None and "vocabulary" in out["vocab"].error
    )
    assert out["edge"].finish_reason == "length" and len(out["edge"].token_ids) == 3
    assert out["ok"].finish_reason == "length" and len(out["ok"].token_ids) == 12


def test_matrix_products_of_four_or_more_rows_are_row_independent():
    """The property forward.py's batch invariance rests on (MIN_ROWS); if a torch or BLAS upgrade breaks
    it, this fails before the engine tests do."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    x = torch.randn(200, 64, generator=g)
    full = x @ w.T
    for m in range(MIN_ROWS, 200, 13):
        assert torch.equal((x[:m] @ w.T), full[:m])


@pytest.mark.parametrize("variant", ["int8", "w8a8", "bfloat16"])
def test_int8_and_bf16_models_are_batch_invariant_too(tiny_ckpt, variant):
    md = ModelDir.open(tiny_ckpt)
    if variant in ("int8", "w8a8"):
        model = md.load(dtype=torch.float32, quantize=variant)
    else:
        model = md.load(dtype=torch.bfloat16)
    ps = prompts(9, seed=17)
    together, _, _ = run(model, ps, SamplingParams(max_tokens=6, temperature=0.0))
    for i in (0, 5):
        alone, _, _ = run(model, [ps[i]], SamplingParams(max_tokens=6, temperature=0.0))
        assert alone[0].token_ids == together[i].token_ids


def test_top_p_below_float32_range_still_keeps_the_most_likely_token():
    """Validation refuses such values; the sampler itself must not end up with no token either."""
    logits = torch.tensor([0.5, 3.0, 1.0, -2.0])
    params = SamplingParams(temperature=1.0, top_p=1e-100)
    for seed in range(5):
        assert sample(logits, params, request_generator(seed, "x")) == 1


def test_an_unseeded_key_with_a_lone_surrogate_still_gets_a_generator():
    a, b = request_generator(None, "a\ud800"), request_generator(None, "a\ud800")
    assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))
    # Valid keys keep the generator they always had (sha256 of the UTF-8 bytes).
    assert request_generator(None, "r1").initial_seed() == request_generator(None, "r1").initial_seed()


def test_a_request_that_fails_while_sampling_fails_alone():
    """A NaN logit row (a poisoned embedding of token 7) makes the sampler raise for that request, and a stop
    check that raises on one request's text fails that one: each ends with an internal error result; the
    others, in the same steps, get exactly the tokens they get alone."""
    poisoned = tiny_model()
    poisoned.eval()
    poisoned.normalize_head_()
    with torch.no_grad():
        poisoned.model.word_embeddings.weight[7] = float("nan")
    ps = [[5, 6, 8], [7, 9], [10, 11, 12], [13, 14]]
    hot = SamplingParams(max_tokens=6, temperature=1.0, seed=1)
    boom = SamplingParams(max_tokens=6, temperature=0.0, stop=["boom"])

    def stop_check(ids: list[int], stops: list[str]) -> str | None:
        if "boom" in stops and len(ids) == 2:
            raise ValueError("cannot decode these ids")
        return None

    engine = Engine.local(poisoned, EngineConfig(kv_cache_tokens=1024), stop_check=stop_check)
    reqs = [GenRequest(key=i, prompt_ids=p, sampling=boom if i == 3 else hot) for i, p in enumerate(ps)]
    out = {r.key: r for r in engine.generate(reqs)}
    assert len(out) == 4
    assert (
        out[1].finish_reason == "error"
        and out[1].internal
        and out[1].error is not None
        and "failed while sampling" in out[1].error
    )
    assert (
        out[3].finish_reason == "error"
        and out[3].internal
        and out[3].error is not None
        and "cannot decode these ids" in out[3].error
    )
    assert len(out[3].token_ids) == 2  # what it had generated when it failed
    for i in (0, 2):
        alone = next(
            iter(
                Engine.local(poisoned, EngineConfig(kv_cache_tokens=1024)).generate(
                    [GenRequest(key=i, prompt_ids=ps[i], sampling=hot)]
                )
            )
        )
        assert out[i].finish_reason == "length" and out[i].token_ids == alone.token_ids
    assert engine.alloc.used_slots == 0  # the failed requests gave their cache back
