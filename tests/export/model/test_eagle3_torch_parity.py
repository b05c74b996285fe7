"""EAGLE-3 heads on the torch reference: lossless against the greedy oracle through the real loop, and the head's
step drafts checked against an independent causal run of the head.

Heads are random and written in the published layout (`save_eagle3`), then loaded as a user's would be: without
and with a draft vocabulary and an `embed_tokens` of their own, and (VL families) one rotating with M-RoPE. Seeded
drafts make full, partial and zero acceptance happen on purpose, also across the turns of a conversation.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from glance_export.model.adapters import Snapshot
from glance_export.model.eagle3 import Eagle3Head, load_eagle3
from glance_export.model.torch_backend import TorchBackend, greedy_reference
from glance_runtime.backends.seeded import SeededDrafter
from glance_runtime.decode.loop import DecodeConfig, decode
from glance_runtime.defaults import EAGLE3_DEPTH
from glance_runtime.prompt.messages import user_turn
from support import ALL_FAMILIES, SEEDS, VL_FAMILIES, converse, tiny_eagle3_head

MAX_NEW = 24
DRAFT_VOCAB = 96
VARIANTS = {"plain": {}, "vocab_embed": dict(draft_vocab=DRAFT_VOCAB, own_embeddings=True),
            "mrope": dict(draft_vocab=DRAFT_VOCAB, mrope=True)}
CASES = [(f, v) for f in ALL_FAMILIES for v in VARIANTS if v != "mrope" or f in VL_FAMILIES]
BUDGETS = {"chain1": (1, 1), "chain7": (7, 1), "b7": (7, 8), "b63": (63, 8)}


@pytest.fixture(scope="module")
def backend_for(snapshot_dir, tmp_path_factory):
    """(family, variant) -> a TorchBackend over the family's target and a random head loaded from disk."""
    models: dict[str, torch.nn.Module] = {}
    cache: dict[tuple[str, str], TorchBackend] = {}

    def get(family: str, variant: str) -> TorchBackend:
        if (family, variant) not in cache:
            snap = Snapshot(snapshot_dir(family))
            if family not in models:
                models[family] = snap.load_model()
            head_dir = tiny_eagle3_head(snap.path, tmp_path_factory.mktemp(f"eagle3_{family}") / variant,
                                        **VARIANTS[variant])
            cache[family, variant] = TorchBackend(snap, load_eagle3(head_dir), model=models[family])
        return cache[family, variant]

    return get


def _prompt(backend: TorchBackend, images):
    image = images["wide"] if backend.snapshot.is_vl else None
    return backend.snapshot.build_prompt("What colour is the square?", image)


@pytest.fixture(scope="module")
def oracle_for(backend_for, images):
    cache: dict[str, list[int]] = {}

    def get(family: str) -> list[int]:
        if family not in cache:
            backend = backend_for(family, "plain")
            cache[family] = greedy_reference(backend.model, backend.snapshot, _prompt(backend, images), MAX_NEW, ())
        return cache[family]

    return get


def test_limits_declare_a_step_drafter(backend_for, images):
    backend = backend_for("qwen3", "vocab_embed")
    limits = backend.info.limits
    assert (limits.drafter, limits.block_size, limits.max_branch_k) == ("steps", EAGLE3_DEPTH + 1, DRAFT_VOCAB)
    assert backend_for("qwen3", "plain").info.limits.max_branch_k == backend.snapshot.text_config["vocab_size"]
    backend.prefill(_prompt(backend, images))
    with pytest.raises(RuntimeError, match="draft_root"):
        backend.draft(0, 2)


@pytest.mark.parametrize("family,variant", CASES)
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_random_head_matches_oracle(backend_for, oracle_for, images, family, variant, budget):
    backend = backend_for(family, variant)
    nodes, k = BUDGETS[budget]
    result = decode(backend, _prompt(backend, images), DecodeConfig(max_new_tokens=MAX_NEW, budget=nodes, branch_k=k))
    assert result.tokens == oracle_for(family)
    assert all(r.tree_size <= nodes + 1 for r in result.rounds)


@pytest.mark.parametrize("family,variant", CASES)
def test_stop_token_ends_the_answer(backend_for, oracle_for, images, family, variant):
    backend = backend_for(family, variant)
    prompt = _prompt(backend, images)
    truth = oracle_for(family)
    stop = truth[5]
    expected = greedy_reference(backend.model, backend.snapshot, prompt, MAX_NEW, (stop,))
    assert expected[-1] == stop and len(expected) < len(truth)
    for drafter in (backend, SeededDrafter(backend, truth, prompt.length, SEEDS["full"])):
        result = decode(drafter, prompt, DecodeConfig(max_new_tokens=MAX_NEW, budget=31, branch_k=8),
                        stop_ids=(stop,))
        assert result.tokens == expected and result.stopped_on == stop


@pytest.mark.parametrize("family,variant", [(f, "mrope" if f in VL_FAMILIES else "vocab_embed")
                                            for f in ALL_FAMILIES])
@pytest.mark.parametrize("seed", list(SEEDS))
@pytest.mark.parametrize("budget", ["chain7", "b31"])
def test_seeded_acceptance(backend_for, oracle_for, images, family, variant, seed, budget):
    backend = backend_for(family, variant)
    prompt = _prompt(backend, images)
    truth = oracle_for(family)
    nodes, k = BUDGETS.get(budget, (31, 8))
    drafter = SeededDrafter(backend, truth, prompt.length, SEEDS[seed])
    result = decode(drafter, prompt, DecodeConfig(max_new_tokens=MAX_NEW, budget=nodes, branch_k=k))
    assert result.tokens == truth
    taus = [r.accepted for r in result.rounds[:-1]]  # the last round is cut by max_new_tokens
    assert taus
    if seed == "zero":
        assert all(t == 1 for t in taus)
    elif k == 1:  # a chain drafts every seeded depth, so acceptance is exact
        assert all(t == (3 if seed == "partial" else EAGLE3_DEPTH + 1) for t in taus)
    elif seed == "partial":
        assert all(2 <= t <= 3 for t in taus)
    else:
        assert all(t >= 2 for t in taus) and np.mean(taus) > 2


@pytest.mark.parametrize("family,variant", [("qwen2_5_vl", "mrope"), ("qwen3", "vocab_embed"),
                                            ("qwen3_vl", "plain"),
                                            ("llama", "plain")])
@pytest.mark.parametrize("seed", list(SEEDS))
def test_conversation_keeps_the_head_cache(backend_for, images, family, variant, seed):
    """Each turn prefills only the rows after the shared prefix (target and head caches cut back to them) and still
    decodes the oracle's answer."""
    backend = backend_for(family, variant)
    snap = backend.snapshot
    vl = family in VL_FAMILIES
    turns = [user_turn("What colour is the square?", [images["wide"]] if vl else []),
             user_turn("Describe the image."),
             user_turn("How many circles are there?", [images["tall"]] if vl else [])]
    kept = converse(backend, snap.build_messages, lambda ids: snap.tokenizer.decode(ids, skip_special_tokens=True),
                    lambda p: greedy_reference(backend.model, snap, p, 16, ()), turns, seed,
                    snap.image_token_id if vl else None,
                    snap.config.get("vision_config", {}).get("spatial_merge_size", 1))
    assert kept[0] == 0 and all(k > 10 for k in kept[1:])


# ---- The step drafts against one causal run of the head ----

def _head_rows(backend: TorchBackend, stream: list[int], anchor: int, prompt) -> tuple:
    """The committed rows' token embeddings and fused taps (from one plain target pass over the whole committed
    stream, no backend cache), the embedding the head reads, and the prompt (for positions)."""
    head: Eagle3Head = backend.head
    ids = torch.tensor(stream)[None]
    out = backend.model(input_ids=ids, position_ids=_target_positions(backend, prompt, len(stream)),
                        output_hidden_states=True, **_vision(backend, prompt, ids))
    layers = head.config.taps(backend.snapshot.text_config["num_hidden_layers"])
    taps = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)
    embed = head.embed_tokens if head.embed_tokens is not None else backend.model.get_input_embeddings()
    tokens = torch.tensor(stream[1:] + [anchor])
    return embed(tokens)[None], head.fuse(taps), embed, prompt


def _vision(backend: TorchBackend, prompt, ids: torch.Tensor) -> dict:
    from glance_export.model.torch_backend import vision_inputs

    if not backend.snapshot.is_vl:
        return {}
    extra = vision_inputs(backend.snapshot, prompt, ids[:, :prompt.length], ids.device, backend.model.dtype)
    if "mm_token_type_ids" in extra:
        pad = torch.zeros(1, ids.shape[1] - prompt.length, dtype=extra["mm_token_type_ids"].dtype)
        extra["mm_token_type_ids"] = torch.cat([extra["mm_token_type_ids"], pad], dim=1)
    return extra


def _rope_index(backend: TorchBackend, prompt) -> tuple[torch.Tensor, int]:
    """The target's own three position axes for the prompt, and the delta later rows continue with."""
    ids = torch.from_numpy(prompt.input_ids)[None]
    extra = _vision(backend, prompt, ids)
    pos, _ = backend.model.model.get_rope_index(
        input_ids=ids, mm_token_type_ids=extra["mm_token_type_ids"], image_grid_thw=extra.get("image_grid_thw"),
        attention_mask=torch.ones_like(ids))
    return pos, int(pos[0, 0, -1]) + 1 - ids.shape[1]


def _target_positions(backend: TorchBackend, prompt, rows: int) -> torch.Tensor:
    if not backend.snapshot.is_vl:
        return torch.arange(rows)[None]
    pos, delta = _rope_index(backend, prompt)
    later = (torch.arange(prompt.length, rows) + delta)[None, None].expand(3, 1, -1)
    return torch.cat([pos, later], dim=-1)


def _head_positions(backend: TorchBackend, prompt, rows: int) -> torch.Tensor:
    if backend.head.config.mrope_section is None:
        return torch.arange(rows)[None, None].expand(3, 1, -1)
    return _target_positions(backend, prompt, rows).expand(3, 1, -1)


def _path_top(backend: TorchBackend, rows: tuple[torch.Tensor, ...], path: list[int], k: int):
    """Top-k target ids and log-probs after `path` (tokens below the anchor), from whole-sequence causal passes of
    the head with no cache: each path row's hidden input is the previous row's pre-norm output of the pass before,
    so after len(path) + 1 passes every row has the input the head would see drafting it."""
    head: Eagle3Head = backend.head
    embeds, fused, embed, prompt = rows
    s = fused.shape[1]
    positions = _head_positions(backend, prompt, s + len(path))  # node rows at depth d: stream position s - 1 + d
    if path:
        embeds = torch.cat([embeds, embed(torch.tensor(path))[None]], dim=1)
    hidden = torch.cat([fused, torch.zeros(1, len(path), fused.shape[-1])], dim=1)
    for _ in range(len(path) + 1):
        normed, prenorm, _ = head(embeds, hidden, positions)
        hidden = torch.cat([fused, prenorm[:, s - 1:-1]], dim=1)
    logp = torch.log_softmax(head.logits(normed[0, -1]).float(), dim=-1)
    top = torch.topk(logp, k)
    return head.target_ids(top.indices).numpy(), top.values.double().numpy()


def _check_steps(backend: TorchBackend, prompt, result) -> None:
    """A chain (twice from the same anchor: the second round must not see the first's rows) and a branching tree,
    drafted step by step after `result`'s decode, against `_path_top` for each node's path."""
    stream = prompt.input_ids.tolist() + result.tokens[:-1]
    assert backend.start == len(stream)
    anchor = result.tokens[-1]
    rows = _head_rows(backend, stream, anchor, prompt)

    def check(got, path: list[int], k: int) -> None:
        ids, logp = _path_top(backend, rows, path, k)
        np.testing.assert_array_equal(got[0], ids)
        np.testing.assert_allclose(got[1], logp, rtol=0, atol=1e-5)

    for _ in range(2):
        ids, logp = backend.draft_root(anchor, 1)
        check((ids, logp), [], 1)
        chain, parent = [int(ids[0])], -1
        for node in range(EAGLE3_DEPTH - 1):
            ids, logp = backend.draft_step(np.array([chain[-1]]), np.array([parent]), 1)
            check((ids[0], logp[0]), chain, 1)
            chain.append(int(ids[0, 0]))
            parent = node

    root = backend.draft_root(anchor, 2)
    check(root, [], 2)
    paths = [[int(t)] for t in root[0]]  # node j's path; nodes 0, 1 at depth 1
    parents = np.array([-1, -1])
    frontier = [0, 1]
    for _ in range(2):
        got_ids, got_logp = backend.draft_step(np.array([paths[n][-1] for n in frontier]), parents, 2)
        for j, n in enumerate(frontier):
            check((got_ids[j], got_logp[j]), paths[n], 2)
        children = [(n, int(t)) for j, n in enumerate(frontier) for t in got_ids[j]]
        frontier = list(range(len(paths), len(paths) + len(children)))
        paths += [paths[n] + [t] for n, t in children]
        parents = np.array([n for n, _ in children])


STEP_CASES = [("qwen3", "plain"), ("llama", "vocab_embed"), ("qwen2_5_vl", "mrope"), ("qwen2_vl", "vocab_embed")]


@pytest.mark.parametrize("family,variant", STEP_CASES)
@torch.no_grad()
def test_step_drafts_equal_one_causal_pass(backend_for, oracle_for, images, family, variant):
    """After rounds that committed several tokens (the head's cache spans rounds), the step drafts equal the head run
    causally over the committed rows plus each node's path."""
    backend = backend_for(family, variant)
    prompt = _prompt(backend, images)
    truth = oracle_for(family)
    result = decode(SeededDrafter(backend, truth, prompt.length, SEEDS["partial"]), prompt,
                    DecodeConfig(max_new_tokens=12, budget=31, branch_k=8))
    assert result.tokens == truth[:12] and max(r.accepted for r in result.rounds) > 1
    _check_steps(backend, prompt, result)


@pytest.mark.parametrize("family,variant", STEP_CASES)
@torch.no_grad()
def test_step_drafts_after_a_follow_up_turn(backend_for, images, family, variant):
    """A follow-up turn keeps the shared rows (`prefill(keep=...)`); the head's cache is cut back to rows whose next
    token is still the stream's, so its drafts equal a causal run over the new stream."""
    from glance_runtime.prompt.prefix_reuse import Committed, image_runs, shared_rows

    backend = backend_for(family, variant)
    snap = backend.snapshot
    image_id = snap.image_token_id if snap.is_vl else None
    merge = snap.config.get("vision_config", {}).get("spatial_merge_size", 1)
    messages = [user_turn("What colour is the square?", [images["wide"]] if snap.is_vl else [])]
    first = snap.build_messages(messages)
    result = decode(backend, first, DecodeConfig(max_new_tokens=10, budget=15, branch_k=4))
    tokens = np.concatenate([first.input_ids, np.asarray(result.tokens, np.int64)])[:backend.start]
    messages += [{"role": "assistant", "content": snap.tokenizer.decode(result.tokens, skip_special_tokens=True)},
                 user_turn("Describe the image.")]
    second = snap.build_messages(messages)
    keep = shared_rows(Committed(tokens, tuple(image_runs(first, image_id, merge))), second, image_id, merge)
    assert 0 < keep < backend.start
    truth = greedy_reference(backend.model, snap, second, 8, ())
    result = decode(SeededDrafter(backend, truth, second.length, SEEDS["partial"]), second,
                    DecodeConfig(max_new_tokens=8, budget=31, branch_k=8), keep=keep)
    assert result.tokens == truth
    _check_steps(backend, second, result)
