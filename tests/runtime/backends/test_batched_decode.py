"""In-flight batching on ONNX Runtime: every request's tokens equal the same request decoded alone, whatever joins,
leaves or is cancelled around it; the KV pool keeps each slot's rows where they are."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from glance_runtime.backends.batch_rounds import BatchRounds, open_batch
from glance_runtime.backends.device_buffers import HostDevice
from glance_runtime.backends.kv_pool import KVPool
from glance_runtime.backends.ort_backend import OrtBackend
from glance_runtime.backends.registry import Source, open_session
from glance_runtime.decode.batch_budget import EXPLORE_WINDOWS, WINDOW_ROUNDS, BatchBudget, BatchCost, ModeSwitch
from glance_runtime.decode.batch_loop import BatchLoop, Request
from glance_runtime.decode.calibration import Calibration
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.decode.tree import Tree, build_tree
from glance_runtime.errors import GlanceError
from glance_runtime.formats.tasks import read
from glance_runtime.prompt.codec import exported_codec
from glance_runtime.prompt.messages import user_turn

ROOT = Path(__file__).resolve().parents[3]
DEFAULT = ROOT / "models" / "glance-vl-tiny-onnx"
BUDGETS = (0, 1, 3, 7, 15, 63)
CAPACITY = 3


@pytest.fixture(scope="module")
def shipped():
    """The shipped default on one thread: a single-sequence backend (the reference decode) and a batched one."""
    single = OrtBackend(DEFAULT, threads=1)
    batched = OrtBackend(DEFAULT, threads=1, max_batch=CAPACITY)
    codec = exported_codec(single.manifest)
    tasks = [t for kind in ("receipt", "chart", "scene", "caption") for t in read(ROOT / "examples" / kind / "tasks.jsonl")[:2]]
    prompts = [codec.encode([user_turn(t.prompt, [str(t.image)])]) for t in tasks]
    prompts.append(codec.encode([user_turn("Say something long about nothing at all.", [])]))
    yield single, BatchLoop(BatchRounds(batched)), codec, prompts
    single.close()
    batched.close()


def _alone(cache: dict, single, prompt_index: int, prompts, cfg: DecodeConfig, stops: tuple[int, ...]) -> list[int]:
    key = (prompt_index, cfg.max_new_tokens, cfg.budget, cfg.speculative, stops)
    if key not in cache:
        cache[key] = decode(single, prompts[prompt_index], cfg, stops).tokens
    return cache[key]


_ALONE: dict = {}

request_plans = st.lists(st.fixed_dictionaries({
    "prompt": st.integers(0, 8), "budget": st.sampled_from(BUDGETS), "max_new": st.integers(1, 40),
    "arrive": st.integers(0, 6), "cancel": st.one_of(st.none(), st.integers(0, 8)),
    "stop": st.sampled_from(["eos", "none", "answer"]),
}), min_size=1, max_size=6)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans=request_plans)
def test_each_batched_answer_equals_the_request_alone(shipped, plans):
    """Arrival rounds, prompt and answer lengths, budgets (plain steps among trees), stop tokens (the model's, none,
    or one from inside the answer) and cancellations: each sequence's tokens are those of its request decoded alone
    (a cancelled one's, a prefix of them, cut at a round boundary). More requests than slots wait for one."""
    single, loop, codec, prompts = shipped
    requests, expected = [], []
    for plan in plans:
        cfg = DecodeConfig(max_new_tokens=plan["max_new"], budget=plan["budget"], speculative=plan["budget"] > 0)
        stops = tuple(codec.stop_ids) if plan["stop"] == "eos" else ()
        if plan["stop"] == "answer":
            free = _alone(_ALONE, single, plan["prompt"], prompts, replace(cfg, max_new_tokens=40), ())
            stops = (free[len(free) // 2],)
        expected.append(_alone(_ALONE, single, plan["prompt"], prompts, cfg, stops))
        requests.append(Request(prompts[plan["prompt"]], cfg, stops))
    waiting = sorted(range(len(plans)), key=lambda i: plans[i]["arrive"])
    round_no = 0
    while waiting or loop.active:
        while waiting and plans[waiting[0]]["arrive"] <= round_no and loop.free_slots():
            loop.join(requests[waiting.pop(0)])
        for i, plan in enumerate(plans):
            if plan["cancel"] is not None and plan["cancel"] == round_no and not requests[i].done \
                    and requests[i].slot is not None:
                loop.cancel(requests[i])
        loop.step()
        round_no += 1
    for plan, request, want in zip(plans, requests, expected):
        got = request.result.tokens
        if plan["cancel"] is None:
            assert got == want
        else:
            assert got == want[:len(got)]
    assert not loop.active


def test_a_batch_of_every_budget_is_speculative_and_exact(shipped):
    """Six requests at once over three slots: drafted rounds happen (tau > 1) and every answer is the alone one."""
    single, loop, codec, prompts = shipped
    cfgs = [DecodeConfig(max_new_tokens=30, budget=b) for b in (1, 3, 7, 15, 63, 7)]
    requests = [Request(prompts[i], cfg, codec.stop_ids) for i, cfg in enumerate(cfgs)]
    results = loop.run(requests)
    for i, (cfg, result) in enumerate(zip(cfgs, results)):
        assert result.tokens == decode(single, prompts[i], cfg, codec.stop_ids).tokens
    assert max(r.tau for r in results) > 1.5
    assert any(len(r.rounds) and r.rounds[0].drafted for r in results)


def test_a_batch_projects_its_rows_in_runs_a_lone_pass_could_make(shipped):
    """The trees' rows of a round go through the vocab graph a lone pass's worth at a time (bounded activations, and
    a TensorRT vocab engine's row bound): with runs of 5 rows, every answer is still the alone one."""
    single, loop, codec, prompts = shipped
    rounds = loop.rounds
    runs = []
    vocab = rounds.base.graphs["vocab"]
    original, step = vocab.run, rounds.projection_rows
    assert step == max(rounds.base.max_tree, rounds.block_size - 1)

    def counted(inputs, outputs):
        runs.append(inputs["hidden"].shape[0])
        original(inputs, outputs)

    vocab.run, rounds.projection_rows = counted, 5
    try:
        cfgs = [DecodeConfig(max_new_tokens=20, budget=b) for b in (7, 15, 3)]
        results = loop.run([Request(prompts[i], cfg, codec.stop_ids) for i, cfg in enumerate(cfgs)])
    finally:
        vocab.run, rounds.projection_rows = original, step
    for i, (cfg, result) in enumerate(zip(cfgs, results)):
        assert result.tokens == decode(single, prompts[i], cfg, codec.stop_ids).tokens
    assert max(runs) <= 5 and runs.count(5) > 1


def test_a_slot_keeps_its_conversation_for_the_next_turn(shipped):
    """A follow-up that starts with the slot's committed rows prefills only the rest and answers as a full prefill
    would, while other slots decode beside it."""
    single, loop, codec, prompts = shipped
    cfg = DecodeConfig(max_new_tokens=20, budget=7)
    first = loop.join(Request(prompts[0], cfg, codec.stop_ids), slot=1)
    other = loop.join(Request(prompts[3], cfg, codec.stop_ids), slot=0)
    while loop.active:
        loop.step()
    history = [user_turn("What is the total?", [str(ROOT / "examples/receipt/images/receipt_000.png")]),
               {"role": "assistant", "content": codec.decode(first.result.tokens)},
               user_turn("And the tax?", [])]
    follow = codec.encode(history)
    committed = loop.rounds.slots[1].start
    shared = int(np.argmin(np.append(follow.input_ids[:committed] == np.concatenate(
        [prompts[0].input_ids, first.result.tokens])[:committed], False)))
    assert shared > prompts[0].length // 2
    turn = loop.join(Request(follow, cfg, codec.stop_ids, keep=shared), slot=1)
    while loop.active:
        loop.step()
    assert turn.result.tokens == decode(single, follow, cfg, codec.stop_ids).tokens
    assert other.result.tokens == decode(single, prompts[3], cfg, codec.stop_ids).tokens


def test_joining_and_leaving_never_moves_another_slots_rows(shipped):
    """A sequence's rows in slot 0 are byte-identical before and after two others join slots 1 and 2, decode in
    batched rounds and leave."""
    _, loop, codec, prompts = shipped
    cfg = DecodeConfig(max_new_tokens=40, budget=7)
    loop.join(Request(prompts[1], DecodeConfig(max_new_tokens=3, budget=0), codec.stop_ids), slot=0)
    while loop.active:
        loop.step()
    cache = loop.rounds.slots[0].kv
    rows, before = cache.length, [r.copy() for r in cache.host_view()]
    visitors = [loop.join(Request(prompts[i], cfg, codec.stop_ids), slot=i) for i in (1, 2)]
    while loop.active:
        loop.step()
    assert all(v.done and len(v.result.rounds) > 1 for v in visitors)
    assert cache.length == rows
    assert all(np.array_equal(a, b) for a, b in zip(before, cache.host_view()))


def test_the_pool_is_one_allocation_sized_by_batch_and_context():
    device = HostDevice()
    pool = KVPool(device, layers=3, kv_heads=2, head_dim=8, slots=4, max_context=32)
    assert pool.nbytes == 2 * 3 * 4 * 32 * 2 * 8 * 4
    assert [t.shape for t in pool.tensors()] == [(4, 32, 2, 8)] * 6
    cache = pool.cache(2)
    src = device.empty((6, 5, 2, 8), np.float32)
    src.host[:] = np.arange(src.host.size, dtype=np.float32).reshape(src.host.shape)
    row = pool.row_bytes
    pool.write(2, 3, src, row * 1, row * 5, 2)  # rows 1..2 of each of the 6 layer blocks
    cache.length = 5
    for layer, past in enumerate(cache.past()):
        got = device.download(past)
        assert np.array_equal(got[3:5], src.host[layer, 1:3])
        assert not got[:3].any()
    with pytest.raises(GlanceError, match="--max-context"):
        pool.write(2, 31, src, 0, row * 5, 2)


def test_batching_is_refused_in_one_line_where_it_cannot_run(shipped, tmp_path):
    single, *_ = shipped
    with pytest.raises(GlanceError, match="above the 16 .* --max-batch 17"):
        OrtBackend(DEFAULT, threads=1, max_batch=17)
    with pytest.raises(GlanceError, match="one sequence; open it with --max-batch 2"):
        BatchRounds(single)
    with pytest.raises(GlanceError, match="torch reference decodes one request at a time"):
        open_session(Source("torch", model=ROOT / "models" / "glance-vl-tiny", max_batch=4))


def test_batched_auto_gives_each_request_its_alone_answer(shipped):
    """`--budget auto` in a batch (the batch's policy picks the trees): tokens as decoded alone."""
    single, _, codec, prompts = shipped
    session = open_session(Source("onnxruntime", artifacts=DEFAULT, threads=1, max_batch=CAPACITY))
    loop = open_batch(session)
    assert loop.policy is not None
    cfg = replace(session.config, max_new_tokens=30)
    requests = [Request(p, cfg, codec.stop_ids) for p in prompts[:5]]
    loop.run(requests)
    plain = DecodeConfig(max_new_tokens=30, budget=0, speculative=False)
    for prompt, request in zip(prompts, requests):
        assert request.result.tokens == decode(single, prompt, plain, codec.stop_ids).tokens
    session.backend.close()


def _policy(theta, law=(2.0, 0.5)) -> BatchBudget:
    policy = BatchBudget(BatchCost(theta), Calibration(law=law), max_nodes=15)
    policy.switch.drafting = True  # past the windows that measure whether drafting pays at all
    return policy


def test_batched_auto_drafts_only_where_the_batch_gains():
    """Constructed costs, no timing: a free head drafts every sequence; a dear head drafts none (plain steps);
    a confident anchor drafts before an unsure one."""
    surprisals, caps = [0.1, 6.0, 0.2, None], [7, 7, 7, None]
    assert _policy([1.0, 0.001, 0.001, 0.0, 0.0]).plan(surprisals, caps)[:3] == [7, 7, 7]
    assert _policy([1.0, 0.05, 0.05, 50.0, 0.0]).plan(surprisals, caps) == [None, None, None, None]
    some = _policy([1.0, 0.05, 0.01, 0.35, 0.0]).plan(surprisals, caps)
    assert some[0] == 7 and some[1] is None and some[3] is None


def test_batched_auto_cuts_trees_as_rows_get_dear():
    """The same drafted trees keep fewer nodes when a verified row costs more, and never fewer than the anchor."""
    rng = np.random.default_rng(0)
    trees = []
    for anchor in range(4):
        logp = np.sort(np.log(rng.dirichlet(np.ones(8), size=7)), axis=1)[:, ::-1]
        ids = np.argsort(rng.random((7, 8)), axis=1)
        trees.append(build_tree(anchor, ids, logp, 15))
    cheap = _policy([1.0, 0.01, 0.01, 0.3, 0.0]).cut(trees, [0.5] * 4, drafted=4)
    dear = _policy([1.0, 0.01, 0.6, 0.3, 0.0]).cut(trees, [0.5] * 4, drafted=4)
    assert sum(t.size for t in dear) < sum(t.size for t in cheap)
    assert all(1 <= t.size <= s.size for t, s in zip(dear, trees))
    assert all(np.array_equal(t.tokens, s.tokens[:t.size]) for t, s in zip(cheap, trees))


def test_batched_cost_tells_a_sequences_own_cost_from_a_drafted_nodes():
    """Constructed timings: plain rounds of 2..8 sequences teach the per-sequence cost, drafted rounds the draft's;
    a node costs the profile's slope on this machine's scale (the profile timed at half its speed), however the
    rounds' nodes and drafts go together."""
    truth = dict(a=0.5, s=0.3, r=0.03, k=0.6)
    cost = BatchCost([0.25, 0.15, 0.015, 0.3, 0.0])
    for round_ in range(200):
        sequences = 2 + round_ % 7
        drafted = (round_ // 7) % 3 * (sequences // 2)  # plain, half and all but one drafting, in turn
        width = 5 if drafted else 1
        rows = sequences + 4 * drafted
        ms = truth["a"] + truth["s"] * sequences + truth["r"] * (sequences * (width - 1) + rows - sequences) \
            + truth["k"] * drafted
        cost.observe(sequences, width, rows, drafted, ms)
    a, s, r, k, _ = cost.theta
    assert abs(s - truth["s"]) < 0.06 and abs(k - truth["k"]) < 0.1 and abs(a - truth["a"]) < 0.3
    assert r == pytest.approx(0.015 * (a + s) / 0.4) and abs(r - truth["r"]) < 0.006


def test_batched_auto_keeps_a_deep_tree_shorter_where_widening_pads_more_sequences():
    """The verify pass is padded to the widest tree: a node that widens it costs a row for every sequence, so
    the same deep chain keeps fewer nodes beside seven plain steps than beside one."""
    chain = build_tree(0, np.arange(7)[:, None], np.full((7, 1), -0.05), 15)
    kept = {}
    for sequences in (2, 8):
        trees = [chain] + [Tree.root(a) for a in range(1, sequences)]
        cut = _policy([1.0, 0.1, 0.025, 0.3, 0.0]).cut(trees, [0.1] * sequences, drafted=1)
        kept[sequences] = cut[0].size
        assert all(t.size == 1 for t in cut[1:])
    assert 1 < kept[8] < kept[2]


def _windows(switch: ModeSwitch, count: int, rate_when_drafting, rate_plain: float) -> list[bool]:
    """`count` windows of constructed rates (no timing); `rate_when_drafting(n)` for the n-th drafting window in a
    row. Returns whether each window drafted."""
    seen, run = [], 0
    for _ in range(count):
        seen.append(switch.drafting)
        run = run + 1 if switch.drafting else 0
        rate = rate_when_drafting(run) if switch.drafting else rate_plain
        for _ in range(WINDOW_ROUNDS):
            switch.observe(10, 10 / rate)
    return seen


def test_batched_auto_keeps_drafting_only_while_it_gives_more_tokens_per_second():
    """Constructed windows, no timing: plain steps first, then drafts; the faster choice is kept, the other looked
    at (a window to settle, one measured) once in EXPLORE_WINDOWS kept windows; a changed load turns it back."""
    switch = ModeSwitch()
    seen = _windows(switch, 3 * EXPLORE_WINDOWS, lambda n: 1.5, 1.0)
    plain = [i for i, drafting in enumerate(seen) if not drafting]
    assert plain[0] == 0 and all(seen[1:EXPLORE_WINDOWS + 1])
    assert len(plain) <= 1 + 2 * 3 and all(b == a + 1 for a, b in zip(plain[1::2], plain[2::2]))
    seen = _windows(switch, 3 * EXPLORE_WINDOWS, lambda n: 0.5, 1.0)  # drafting now loses
    assert seen[4:].count(True) <= 2 * 3  # plain steps within 4 windows, then only its looks at drafting


def test_a_switch_set_to_draft_first_measures_plain_steps_next():
    """A caller that starts the batch drafting (as `benchmarks/gpu_check.py` does) gets the untried plain steps
    measured next, then the faster choice."""
    switch = ModeSwitch()
    switch.drafting = True
    seen = _windows(switch, 8, lambda n: 2.0, 1.0)
    assert seen[:3] == [True, False, False] and all(seen[3:])


def test_batched_auto_does_not_keep_a_mode_for_the_batch_the_other_left():
    """The first drafting window after plain steps finishes the sequences plain steps gathered (here 3x the plain
    rate), then drafting runs at 0.8x: the window after a change is not counted, so plain steps stay."""
    switch = ModeSwitch()
    seen = _windows(switch, 4 * EXPLORE_WINDOWS, lambda n: 3.0 if n == 1 else 0.8, 1.0)
    assert seen.count(True) <= 2 * 4 + 1, seen


def test_a_row_gather_on_the_host_moves_what_a_copy_a_row_moves():
    """The host's one-gather `copy_rows` against the copy-a-row path a GPU takes, on scattered rows."""
    from glance_runtime.backends.device_buffers import Device

    device = HostDevice()
    src = device.empty((12, 6), np.float32)
    src.host[:] = np.arange(72, dtype=np.float32).reshape(12, 6)
    rows_to, rows_of = np.array([5, 0, 9, 2]), np.array([11, 3, 3, 0])
    gathered, looped = device.empty((10, 6), np.float32), device.empty((10, 6), np.float32)
    device.copy_rows(gathered, rows_to, src, rows_of, src.row_bytes)
    Device._d2d_rows(device, looped, rows_to, src, rows_of, src.row_bytes)
    assert np.array_equal(gathered.host, looped.host)
    assert np.array_equal(gathered.host[rows_to], src.host[rows_of])
    with pytest.raises(ValueError, match="past its buffers"):
        device.copy_rows(gathered, np.array([10]), src, np.array([0]), src.row_bytes)
