"""The contract between the exporters and the graph backends (ONNX Runtime, TensorRT): graph file
names, input/output names, shapes and layouts. Stated once here; both sides import it.

`B` = sequences in a pass (a lone sequence is a batch of one), `T` = rows each sequence carries in this pass,
`S` = past rows read, `H` = hidden size, `kvh`/`D` = KV heads / head dim.

One target graph and one draft graph serve every pass: a lone sequence's prefill, plain step and tree verify,
and a batched round over many sequences. Their past is the **KV pool** itself, one tensor per layer
`[P, C_pool, kvh, D]` (`P` slots of `C_pool` rows, read in place: no copy by the runtime): `slots` i64[B] names
each sequence's slot, `past_lengths` i64[B] its committed rows, and `past_rows` i64[S] is 0..S-1 for S = the
longest of them (a size given as an input, not computed from data, so TensorRT takes it as a shape). Each
sequence sees only its own slot's rows, and of them only its first `past_lengths`. A batch is padded: every
sequence carries T rows (a shorter tree's extra rows hidden by its mask, never read). KV rows are
sequence-major within a slot (`[C_pool, kvh, D]`), so a slot's committed rows of one layer are one contiguous
block and a pass's new rows (`present_*`, `[B, T, kvh, D]`) of a lone sequence can be written straight after
them. Weights exist once per graph kind: in memory, on disk and in an engine.

The target's embedding and LM head live in the vocab graph only, so no weight is stored twice (a
tied matrix stays one tensor); target and draft graphs work on hidden states. A round is four runs:
draft -> vocab or draft_vocab (project the block) -> target (verify the tree) -> vocab (project the tree rows).

vision graph (VL targets): `pixel_values` f[N_patch, C*t*p*p] and the grid-derived index tensors of
    `vision_indices` (declared in the manifest; the towers' grid loops cannot be traced)
    -> `image_embeds` f[N_img, H]; Qwen3-VL also -> `deepstack_embeds` f[n_deep, N_img, H].
vocab graph: `ids` i64[E] (tokens to embed), `hidden` f[R, H] (final-normed rows to project)
    -> `embeds` f[E, H], `topk_ids` i64[R, K] (descending; column 0 is the greedy token),
    `topk_logprobs` f32[R, K] (log-softmax over the vocabulary), `entropy` f32[1] (nats, of row 0:
    the anchor's in a verify projection, the last prompt row's in prefill),
    `topk_embeds` f[R, K, H] (embeddings of `topk_ids`, so the next pass's inputs need no extra run),
    `logits` f32[R, V] (the rows' logits, fetched only to sample; artifacts exported before sampling lack it).
    A run that only embeds projects no row on the CPU (ONNX Runtime reads none of the LM head then) and one
    dummy row elsewhere (engine profiles start at 1); a run that only projects embeds one dummy id.
draft_vocab graph (heads with a reduced draft vocabulary only): the vocab graph's inputs and outputs over
    the head's N draft tokens instead of the whole vocabulary, so a draft projection costs N/V of one:
    `ids` index the draft vocabulary (the runtime sends one dummy), `topk_ids` are target ids (the graph maps
    them), `topk_logprobs` and `entropy` are over the N draft tokens, as the head was trained to score them, and
    `logits` f32[R, N] by draft-vocabulary row.
target graph (prefill, plain decode and tree verify, alone or batched):
    `input_ids` i64[B, T] (VL only, to find image tokens); `inputs_embeds` f[B, T, H] (the vocab graph's
    embeddings of the pass's ids); `image_embeds` f[N_img, H] (VL only; rows replace the image tokens in
    order when the pass holds exactly N_img image tokens, so every pass after prefill sends zero rows:
    a generated image-pad token must stay a token); Qwen3-VL also `deepstack_embeds` f[n_deep, N_img, H];
    `position_ids` i64[3, B, T] for M-RoPE targets (stream position + delta on every axis after the
    prompt), i64[B, T] otherwise; `tree_mask` bool[B, T, T] (row i sees column j of this pass; every row
    sees its sequence's past rows; prefill passes the causal lower triangle); `slots`, `past_lengths`,
    `past_rows`; `pool_key_{l}` / `pool_value_{l}` f[P, C_pool, kvh, D] per target layer l
    -> `hidden` f[B, T, H] (after the final norm: the vocab graph's input), `present_key_{l}` /
    `present_value_{l}` f[B, T, kvh, D] (this pass's rows only), `taps` f[B, T, n_taps*H] (outputs of the
    head's tapped layers, concatenated in head order).
draft graph (GLANCE heads; one pass drafts every sequence's block): `context_taps` f[B, N, n_taps*H] (each
    sequence's newly committed rows, the first `context_lengths` i64[B] of them real), `context_positions`
    i64[B, N], `context_lengths`, `block_embeds` f[B, Bk, H] (embeddings of [anchor, MASK x (Bk-1)]; Bk is
    the pass's own, 2..block_size, where the manifest's axes bound it, else block_size: a round that uses d depths
    drafts d + 1 rows or a few more, `decode.backend.block_rows`), `start` i64[B] (stream position of each anchor;
    block rows sit at start..start+Bk-1), `slots`,
    `past_lengths` (rows in each slot's head cache), `past_rows` (0..S_h-1), `pool_ctx_key_{j}` /
    `pool_ctx_value_{j}` f[P, C_pool, kvh, D] per head layer j
    -> `hidden` f[B, Bk-1, H] (final-normed rows of offsets 1..Bk-1: the vocab graph's input),
    `ctx_key_{j}` / `ctx_value_{j}` f[B, N, kvh, D] (the new context rows' K/V, to append to each cache).
draft graph of an EAGLE-3 head (manifest `head_kind` "eagle3"; one sequence; one run per tree depth, the root run
    also over the committed rows not yet in the head's cache): `context_taps` f[N_taps, n_taps*H] (committed rows'
    taps: their hidden inputs are `fc` over them), `hidden` f[M, H] (hidden inputs given as they are: each drafted
    node's parent's `prenorm`), the rows being R_h = N_taps + M in that order; `embeds` f[R_h, H] (the target's
    embedding of each row's next token), `position_ids` i64[3, R_h] (the three M-RoPE axes for a head rotating
    with them, else the stream position on all three), `attention_mask` bool[R_h, S_h + R_h] (row i sees column
    j: the S_h cached rows, then this run's), `logit_rows` i64[Q] (the rows to project: the root run's last,
    a step's every row), `past_key_{j}` / `past_value_{j}` f[S_h, kvh, D] per head layer j
    -> `topk_ids` i64[Q, K] (target ids: the draft vocabulary's map applied), `topk_logprobs` f32[Q, K]
    (log-softmax over the draft vocabulary), `topk_embeds` f[Q, K, H] (the target's embeddings of `topk_ids`),
    `prenorm` f[R_h, H] (the rows' output before the final norm), `present_key_{j}` / `present_value_{j}`
    f[R_h, kvh, D] (this run's rows, to write after the cached ones).

The manifest's axes bound every size: B in [1, max_batch] (1 for an EAGLE-3 head), T up to max_context (a
prefill; a batched pass's T is at most max_tree), S and S_h up to max_context - 1, N up to max_context, P up to
max_batch, C_pool up to max_context.
"""
from __future__ import annotations

VISION_GRAPH = "vision.onnx"
TARGET_GRAPH = "target.onnx"
DRAFT_GRAPH = "draft.onnx"
VOCAB_GRAPH = "vocab.onnx"
DRAFT_VOCAB_GRAPH = "draft_vocab.onnx"
VOCABULARY_GRAPHS = ("vocab", "draft_vocab")  # same contract: ids + hidden rows -> embeddings, top-k
MANIFEST = "manifest.json"
EAGLE3_INPUTS = ("context_taps", "hidden", "embeds", "position_ids", "attention_mask", "logit_rows")  # then past K/V
EAGLE3_OUTPUTS = ("topk_ids", "topk_logprobs", "topk_embeds", "prenorm")  # then present K/V


def target_kv_names(num_layers: int) -> tuple[list[str], list[str]]:
    """(pool inputs, new-row outputs) KV names of the target graph, keys and values interleaved per layer."""
    ins = [f"pool_{kind}_{l}" for l in range(num_layers) for kind in ("key", "value")]
    outs = [f"present_{kind}_{l}" for l in range(num_layers) for kind in ("key", "value")]
    return ins, outs


def draft_kv_names(num_layers: int) -> tuple[list[str], list[str]]:
    """(pool inputs, new-row outputs) context-KV names of a GLANCE head's draft graph."""
    ins = [f"pool_ctx_{kind}_{j}" for j in range(num_layers) for kind in ("key", "value")]
    outs = [f"ctx_{kind}_{j}" for j in range(num_layers) for kind in ("key", "value")]
    return ins, outs


def step_kv_names(num_layers: int) -> tuple[list[str], list[str]]:
    """(past inputs, present outputs) KV names of an EAGLE-3 head's step graph, keys and values interleaved."""
    ins = [f"past_{kind}_{j}" for j in range(num_layers) for kind in ("key", "value")]
    outs = [f"present_{kind}_{j}" for j in range(num_layers) for kind in ("key", "value")]
    return ins, outs
