"""Exact sampling that speculation cannot change: the sampled token is a pure function of one position's
target distribution and noise keyed by (seed, position, token id).

Plain sampling is greedy decoding of perturbed scores (Gumbel-max): at answer position p the token is

    argmax over kept tokens t of   s(t) + G(seed, p, t),    s(t) = (logit(t) - row max) / temperature

with s computed in float32 (the temperature rounded to float32 too) and the sum in float64, ties going to
the lowest token id. G is a standard Gumbel drawn from a counter-based hash, never from a stream, so it
depends on nothing but its key:

    bits = mix64(mix64(mix64(seed) + (p + 1) * GAMMA) + (t + 1) * GAMMA)      (uint64, wrapping)
    U    = ((bits >> 12) + 1/2) * 2**-52          (the top 52 bits: exact in a double, never 0 or 1)
    G    = -log(-log(U))

mix64 is SplitMix64's finalizer and GAMMA its increment: integer ops a torch kernel or a CUDA graph can
repeat bit for bit. U is then exact too, and G as exact as each platform's log (an ulp apart, it changes
a token only where two scores tie to an ulp). Every drafted node at one depth shares its position's
noise, so a verify pass accepts a node exactly when it equals the token sampled at its row: the answer
does not depend on the tree, the budget, the batch or whether the draft is on, and a token's noise does
not depend on the vocabulary's size or on which tokens truncation keeps.

Only tokens that can still win have their noise finished: the best score among the likeliest few bounds the
noise any other token needs, and a token's noise grows with its hash's top bits, so one integer comparison sets
the others aside (exactly: the same token as scoring every one).

Truncation keeps a prefix of the row in (logit descending, token id ascending) order, applied in this
order: temperature, then top-k, then top-p over what top-k left (renormalized: the smallest prefix whose
mass reaches top_p), then min-p (tempered probability at least min_p times the top token's). Top-k and
top-p keep at least one token. Temperature 0 is greedy: np.argmax's first maximum, as before sampling.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..errors import GlanceError, InputError

GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (2**64 over the golden ratio, odd)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
SEED_LIMIT = 2**63  # seeds fit a signed 64-bit integer, the widest a torch tensor or a JSON client holds
MIN_TEMPERATURE = 1e-6  # below it a float32 temperature can round to 0; 1e-6 is already greedy but for ties
MAX_TOP_N = 20  # the OpenAI API's top_logprobs bound
_NUCLEUS_GUESS = 1e-4  # top-p's first try: the tokens within this weight of the top's
_DENSE = 4  # a row keeping more than 1/_DENSE of the vocabulary is truncated in place, not compacted first
_SURE = 64  # tokens whose noise is always finished: the best of them prunes the rest (`_perturbed_argmax`)
_MARGIN = 1e-9  # relative slack on that bound, far above float64's rounding of a score
_HASH_RUN = 1 << 15  # tokens hashed at once: 256 KB of uint64, kept in cache through the hash's nine passes


def draw_seed() -> int:
    """A fresh seed from the OS, so an answer sampled without one can still be reproduced."""
    return secrets.randbits(63)


def _number(name: str, value: object, accepted: str, ok) -> None:
    if type(value) not in (int, float) or not math.isfinite(value) or not ok(value):
        raise InputError(f"{name} {value!r:.40} is not a number in {accepted}; pass {name} in {accepted}")


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings; temperature 0 is greedy decoding and ignores the rest."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    def check(self) -> SamplingParams:
        """Refuse a setting out of range in one line naming it (InputError); returns self."""
        _number("temperature", self.temperature, f"0 (greedy) or [{MIN_TEMPERATURE}, inf)",
                lambda v: v == 0 or v >= MIN_TEMPERATURE)
        _number("top_p", self.top_p, "(0, 1] (1: off)", lambda v: 0 < v <= 1)
        if type(self.top_k) is not int or self.top_k < 0:
            raise InputError(f"top_k {self.top_k!r:.40} is not an integer >= 0; pass top_k >= 1, or 0 for off")
        _number("min_p", self.min_p, "[0, 1) (0: off)", lambda v: 0 <= v < 1)
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < SEED_LIMIT):
            raise InputError(f"seed {self.seed!r:.40} is outside 0..{SEED_LIMIT - 1}; pass seed in "
                             f"0..{SEED_LIMIT - 1}, or None to draw one")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self, seed: int) -> SamplingParams:
        return replace(self, seed=seed).check()

    def seeded(self) -> SamplingParams:
        """These settings with a seed: the given one, else a fresh draw to report with the answer."""
        return self if self.seed is not None else self.with_seed(draw_seed())


GREEDY = SamplingParams()  # temperature 0: the target's argmax, the decode every path served before sampling


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, in place on uint64 (multiplications wrap mod 2**64)."""
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def noise_bits(seed: int, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The hash of (seed, position, token id) as uint64, broadcast over positions and tokens."""
    step = np.uint64(GAMMA)
    key = _mix64(np.array([seed], np.uint64))
    row = _mix64(key + (np.atleast_1d(positions).astype(np.uint64) + np.uint64(1)) * step)
    return _mix64(row + (np.atleast_1d(tokens).astype(np.uint64) + np.uint64(1)) * step)


def uniform(bits: np.ndarray) -> np.ndarray:
    """U in (0, 1) from the top 52 bits: (m + 1/2) / 2**52 is exact in a double, from 2**-53 to 1 - 2**-53."""
    return _uniform_of(bits >> np.uint64(12))


def _uniform_of(mantissas: np.ndarray) -> np.ndarray:
    """U = (m + 1/2) 2**-52 of 52-bit mantissas m, as a new float64 array."""
    u = mantissas.astype(np.float64)
    u += 0.5
    u *= 2.0**-52
    return u


def _gumbel_of(u: np.ndarray) -> np.ndarray:
    """-log(-log(u)), in place."""
    for _ in range(2):
        np.log(u, out=u)
        np.negative(u, out=u)
    return u


def gumbel(seed: int, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """G(seed, position, token) in float64, broadcast like noise_bits."""
    return _gumbel_of(uniform(noise_bits(seed, positions, tokens)))


def _check_rows(logits: np.ndarray, name: str, per_row: np.ndarray, bound: int | None = None) -> None:
    """Logits are [N, V] with `per_row` ([N] int64, `name`) in 0..bound-1 (or >= 0)."""
    if np.ndim(logits) != 2 or np.shape(logits)[1] == 0:
        raise InputError(f"logits of shape {np.shape(logits)} are not [rows, vocabulary]; pass one row per token")
    if per_row.shape != np.shape(logits)[:1]:
        raise InputError(f"{name} of shape {per_row.shape} do not match the {len(logits)} logits rows; "
                         f"pass one of the {name} per row")
    if per_row.size and (per_row.min() < 0 or (bound is not None and per_row.max() >= bound)):
        accepted = f"0..{bound - 1}" if bound is not None else ">= 0"
        raise InputError(f"{name} hold {per_row.min()}..{per_row.max()}; pass {name} in {accepted}")


def _row_max(logits: np.ndarray) -> np.ndarray:
    top = logits.max(axis=1)
    bad = np.flatnonzero(~np.isfinite(top))
    if bad.size:
        raise GlanceError(f"the target's logits at row {bad[0]} are NaN or infinite, so there is no distribution "
                          "to sample; check the backend's precision (an fp16 overflow) or sample greedily")
    return top


def _kth_floor(logits: np.ndarray, k: int) -> np.ndarray:
    """A value at or below each row's k-th largest: the least of the maxima of k disjoint blocks."""
    width = logits.shape[1] // k
    return logits[:, :k * width].reshape(len(logits), k, width).max(axis=2).min(axis=1)


def _candidates(logits: np.ndarray, floor: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """The tokens at or above each row's floor, in id order: (values [N, C] padded with -inf, their ids or
    None where the rows themselves are returned, counts [N])."""
    n, vocab = logits.shape
    mask = logits >= floor[:, None]
    counts = mask.sum(axis=1)
    width = int(counts.max())
    if width * _DENSE > vocab:
        return logits, None, np.full(n, vocab)
    rows, cols = np.divmod(np.flatnonzero(mask), vocab)  # much faster than np.nonzero on a sparse mask
    slot = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
    values = np.full((n, width), -np.inf, np.float32)
    values[rows, slot] = logits[rows, cols]
    ids = np.zeros((n, width), np.int64)
    ids[rows, slot] = cols
    return values, ids, counts


def _weights(values: np.ndarray, top: np.ndarray, temperature: np.float32) -> np.ndarray:
    """Tempered probabilities times the row's total: exp((value - top) / temperature) in float32, 1 at the top."""
    weight = values - top[:, None]
    weight /= temperature
    return np.exp(weight, out=weight)


def _nucleus_floor(logits: np.ndarray, top: np.ndarray, temperature: np.float32, top_p: float,
                   floor: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-p alone: each row's total weight, and a floor under its nucleus. Weights below (1 - top_p) / vocab
    of the top's cannot reach it (the total is >= 1, the top's own weight); a row whose tokens within
    _NUCLEUS_GUESS of the top hold more than top_p of the total (by a margin far above the rounding of two
    float64 sums) gets that tighter floor."""
    total = _weights(logits, top, temperature).sum(axis=1, dtype=np.float64)
    loose = np.maximum(floor, top + temperature * np.float32(math.log((1 - top_p) / (2 * logits.shape[1]))))
    guess = np.maximum(floor, top + temperature * np.float32(math.log(_NUCLEUS_GUESS)))
    held = _weights(_candidates(logits, guess)[0], top, temperature).sum(axis=1, dtype=np.float64)
    return total, np.where(held >= total * top_p * (1 + 1e-9), guess, loose)


def _truncates(params: SamplingParams, vocab: int) -> bool:
    return 0 < params.top_k < vocab or params.top_p < 1 or params.min_p > 0


def _sample_whole(logits: np.ndarray, top: np.ndarray, positions: np.ndarray, params: SamplingParams) -> np.ndarray:
    """No truncation: every token competes; rows at one position (a tree's depth) share one noise row."""
    temperature = np.float32(params.temperature)
    out = np.empty(len(logits), np.int64)
    for position, rows in _by_position(positions):
        mantissas = _noise_mantissas(params.seed, position, logits.shape[1])
        for row in rows:
            out[row] = _perturbed_argmax((logits[row] - top[row]) / temperature, mantissas)
    return out


def _by_position(positions: np.ndarray) -> list[tuple[int, np.ndarray]]:
    unique, where = np.unique(positions, return_inverse=True)
    return [(int(position), np.flatnonzero(where == i)) for i, position in enumerate(unique)]


@lru_cache(maxsize=4)
def _token_steps(vocab: int) -> np.ndarray:
    """(t + 1) * GAMMA for every token id t (uint64, wrapping): the token half of every noise row, made once."""
    steps = (np.arange(vocab, dtype=np.uint64) + np.uint64(1)) * np.uint64(GAMMA)
    steps.flags.writeable = False
    return steps


def _noise_mantissas(seed: int, position: int, vocab: int) -> np.ndarray:
    """`noise_bits(seed, position, 0..vocab-1) >> 12` (U's 52-bit mantissa m: U = (m + 1/2) 2**-52), hashed in
    runs that stay in cache (a third of the time of one pass per operation over the vocabulary)."""
    row = _mix64(_mix64(np.array([seed], np.uint64)) + np.array([position + 1], np.uint64) * np.uint64(GAMMA))
    steps, out = _token_steps(vocab), np.empty(vocab, np.uint64)
    for first in range(0, vocab, _HASH_RUN):
        run = out[first:first + _HASH_RUN]
        np.add(steps[first:first + _HASH_RUN], row, out=run)
        _mix64(run)
        run >>= np.uint64(12)
    return out


def _scores(score: np.ndarray, mantissas: np.ndarray) -> np.ndarray:
    """float64(score) + G, each token's G from its mantissa as `gumbel` computes it."""
    total = _gumbel_of(_uniform_of(mantissas))
    total += score
    return total


def _perturbed_argmax(score: np.ndarray, mantissas: np.ndarray, eligible: np.ndarray | None = None) -> int:
    """The argmax over eligible tokens t of float64(score[t]) + G(t), ties to the lowest id (`score`: float32
    tempered logits less the row's max). Exact, and most tokens' noise is never finished: the best of the likeliest
    _SURE tokens bounds the noise any other token needs to win, and a token's noise grows with its mantissa, so
    one mantissa threshold sets aside every token that cannot."""
    pool = score if eligible is None else np.where(eligible, score, np.float32(-np.inf))
    width = len(pool) // _SURE
    floor = pool[:_SURE * width].reshape(_SURE, width).max(axis=1).min() if width else np.float32(-np.inf)
    if not np.isfinite(floor):  # a small vocabulary, or few eligible tokens: score them all
        ids = np.arange(len(pool)) if eligible is None else np.flatnonzero(eligible)
        return int(ids[_scores(score[ids], mantissas[ids]).argmax()])
    likely = np.flatnonzero(pool >= floor)
    best = float(_scores(score[likely], mantissas[likely]).max())
    need = best - float(floor)  # any other token scores below floor + G: it wins only with G above this
    need -= _MARGIN * max(1.0, abs(best))
    threshold = 0 if need < -700 else max(int(math.exp(-math.exp(-need)) * 2.0**52) - 2, 0)
    rest = np.flatnonzero(mantissas >= np.uint64(threshold))
    if eligible is not None:
        rest = rest[eligible[rest]]
    ids = np.concatenate([likely, rest])  # in no order, some twice: the best score's lowest id wins
    scores = _scores(score[ids], mantissas[ids])
    return int(ids[scores == scores.max()].min())


def _sample_kept(logits: np.ndarray, top: np.ndarray, positions: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Truncation: find each row's kept prefix among loose candidates, then draw noise for the kept only."""
    n, vocab = logits.shape
    temperature, rows = np.float32(params.temperature), np.arange(n)
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    floor = _kth_floor(logits, top_k) if top_k else np.full(n, -np.inf, np.float32)
    if params.min_p > 0 and not (top_k and params.top_p < 1):  # kept: weight >= min_p; the halving only absorbs
        # rounding. Not with top-k and top-p both: top-p's total is over every token top-k keeps, min-p's too
        floor = np.maximum(floor, top + temperature * np.float32(math.log(params.min_p) - math.log(2)))
    if params.top_p < 1 and not top_k:
        total, floor = _nucleus_floor(logits, top, temperature, params.top_p, floor)
    values, ids, counts = _candidates(logits, floor)
    best = np.sort(values, axis=1)[:, ::-1]
    weight = _weights(best, top, temperature)
    keep = np.minimum(counts, top_k) if top_k else counts
    if params.top_p < 1:
        mass = weight.astype(np.float64)
        np.cumsum(mass, axis=1, out=mass)  # in place: the same sums, without a second vocabulary-wide allocation
        if top_k:
            total = mass[rows, keep - 1]
        # the tokens whose mass before them is under top_p of the total: the first (nothing before it) and those
        # after a prefix still under it
        keep = np.minimum(keep, 1 + (mass[:, :-1] < params.top_p * total[:, None]).sum(axis=1))
    if params.min_p > 0:
        keep = np.minimum(keep, (weight >= np.float32(params.min_p)).sum(axis=1))
    cut = best[rows, keep - 1][:, None]  # the last kept value; of the tokens equal to it, the lowest ids fit
    above, ties = values > cut, values == cut
    room = keep - above.sum(axis=1)
    kept = above | ties
    crowded = np.flatnonzero(ties.sum(axis=1) > room)
    kept[crowded] = above[crowded] | (ties[crowded] & (np.cumsum(ties[crowded], axis=1) <= room[crowded, None]))
    if ids is None:  # rows kept in place: most of their tokens' noise is set aside unfinished
        out = np.empty(n, np.int64)
        for position, group in _by_position(positions):
            mantissas = _noise_mantissas(params.seed, position, vocab)
            for row in group:
                out[row] = _perturbed_argmax((values[row] - top[row]) / temperature, mantissas, kept[row])
        return out
    r, c = np.divmod(np.flatnonzero(kept), kept.shape[1])
    score = np.full(values.shape, -np.inf)
    score[r, c] = ((values[r, c] - top[r]) / temperature).astype(np.float64)
    score[r, c] += gumbel(params.seed, positions[r], ids[r, c])
    return ids[rows, score.argmax(axis=1)]


def sample(logits: np.ndarray, positions: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The token at each row: logits [N, V], positions [N] (the answer position each row predicts) -> [N] int64."""
    positions = np.asarray(positions, np.int64)
    _check_rows(logits, "positions", positions)
    if params.greedy:
        return np.argmax(logits, axis=1).astype(np.int64, copy=False)
    if params.seed is None:
        raise InputError("sampling with temperature > 0 needs a seed; pass SamplingParams.seeded() once per "
                         "request so every pass of one answer shares it")
    logits = np.asarray(logits, np.float32)
    with np.errstate(over="ignore", under="ignore"):
        top = _row_max(logits)
        if _truncates(params, logits.shape[1]):
            return _sample_kept(logits, top, positions, params)
        return _sample_whole(logits, top, positions, params)


class TokenLogprob(NamedTuple):
    """One answered token's report: its log-prob under the target's untempered distribution at its position, and
    the best `top_n` (token id, log-prob) there, best first, ties by id."""
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class LogProbs(NamedTuple):
    """What the OpenAI API reports: the chosen tokens' log-probs and each row's best, ties by id. Rows a pass did
    not report (the walk never read them) hold NaN and id -1."""
    chosen: np.ndarray  # [N] float32
    top_ids: np.ndarray  # [N, n] int64, best first
    top: np.ndarray  # [N, n] float32

    @staticmethod
    def blank(rows: int, top_n: int) -> LogProbs:
        """`rows` rows reported by none yet (see `put`)."""
        return LogProbs(np.full(rows, np.nan, np.float32), np.full((rows, top_n), -1, np.int64),
                        np.full((rows, top_n), np.nan, np.float32))

    def put(self, rows: np.ndarray, part: LogProbs) -> LogProbs:
        """`part`'s rows written at `rows`, in place; returns self."""
        self.chosen[rows], self.top_ids[rows], self.top[rows] = part
        return self

    def records(self, rows: np.ndarray | list[int]) -> list[TokenLogprob]:
        """The reports of `rows`, in order, as plain numbers."""
        rows = np.asarray(rows, np.int64)
        if rows.size and np.isnan(self.chosen[rows]).any():
            raise GlanceError("a pass did not report the log-prob of a row the answer took its token from; this is a "
                              "bug in the backend, please report it")
        return [TokenLogprob(float(c), tuple(zip(ids, top))) for c, ids, top in
                zip(self.chosen[rows].tolist(), self.top_ids[rows].tolist(), self.top[rows].tolist())]


def logprobs(logits: np.ndarray, tokens: np.ndarray, top_n: int = 0) -> LogProbs:
    """The target's own log-softmax of the untempered logits: at each row the chosen token's and the top_n best."""
    if type(top_n) is not int or not 0 <= top_n <= MAX_TOP_N:
        raise InputError(f"top_n {top_n!r:.40} is outside 0..{MAX_TOP_N}; pass top_n in 0..{MAX_TOP_N} "
                         "(the OpenAI API's top_logprobs)")
    tokens = np.asarray(tokens, np.int64)
    _check_rows(logits, "tokens", tokens, bound=np.shape(logits)[-1])
    logits = np.asarray(logits, np.float32)
    n, vocab = logits.shape
    with np.errstate(over="ignore", under="ignore"):
        top = _row_max(logits)
        norm = top + np.log(np.exp(logits - top[:, None]).sum(axis=1, dtype=np.float64))
        chosen = (logits[np.arange(n), tokens] - norm).astype(np.float32)
        width = min(top_n, vocab)
        if width == 0:
            return LogProbs(chosen, np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32))
        floor = _kth_floor(logits, width) if width < vocab else np.full(n, -np.inf, np.float32)
        values, ids, _ = _candidates(logits, floor)
        order = np.argsort(-values, axis=1, kind="stable")[:, :width]
        best = np.take_along_axis(values, order, axis=1)
        top_ids = order if ids is None else np.take_along_axis(ids, order, axis=1)
    return LogProbs(chosen, top_ids.astype(np.int64), (best - norm[:, None]).astype(np.float32))


def logprob_count(value: object) -> int | None:
    """A caller's `logprobs` setting, checked: None reports none; n in 0..MAX_TOP_N reports each token's log-prob
    and the n best alternatives at its position."""
    if value is None:
        return None
    if isinstance(value, np.integer):
        value = int(value)
    if type(value) is not int or not 0 <= value <= MAX_TOP_N:
        raise InputError(f"logprobs {value!r:.40} is not None or an integer in 0..{MAX_TOP_N}; pass logprobs=None "
                         f"(off), 0 (each token's own) or up to {MAX_TOP_N} (that many alternatives too)")
    return value


class Draw(NamedTuple):
    """One pass's sampling and reporting, as the loop hands it to a backend: seeded settings (greedy ones when the
    pass only reports), the answer position its first row predicts (a verify row at tree depth d predicts
    `first + d`; a prefill's row, position 0), and the log-probs to report (None: none; n: each chosen token's and
    the best n, `logprobs`)."""
    params: SamplingParams
    first: int
    top_n: int | None = None

    @property
    def samples(self) -> bool:
        """Whether the pass samples; a greedy one keeps the backend's own argmax, as without a Draw."""
        return not self.params.greedy

    @property
    def reports(self) -> bool:
        return self.top_n is not None

    def report(self, logits: np.ndarray, chosen: np.ndarray) -> LogProbs:
        """The log-probs of the chosen tokens after rows of logits [N, V], and each row's best `top_n`."""
        return logprobs(logits, chosen, self.top_n or 0)

    def choose(self, logits: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """The token sampled after each row of logits [N, V] at tree depths [N]."""
        return sample(logits, self.first + np.asarray(depths, np.int64), self.params)

    def choose_with_logprob(self, logits: np.ndarray, depths: np.ndarray, top_ids: np.ndarray,
                            top_logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`choose`, and each chosen token's log-prob under the row's untempered distribution, from a projection's
        logits and its argmax ids and log-probs [N]: a row's log-normalizer is its argmax's logit less that
        token's log-prob, so no vocabulary-wide sum is taken."""
        chosen = self.choose(logits, depths)
        rows = np.arange(len(logits))
        norm = logits[rows, top_ids].astype(np.float64) - np.asarray(top_logprobs, np.float64)
        return chosen, logits[rows, chosen].astype(np.float64) - norm


def sampling_params(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                    seed: int | None = None) -> SamplingParams:
    """The settings a caller passes (numpy numbers as plain ones), checked: one line naming a bad one. The seed
    is drawn later, where the answer is decoded (`SamplingParams.seeded`), so each answer of a greedy-free call
    gets its own."""
    def plain(value: object) -> object:
        if isinstance(value, np.generic) and not isinstance(value, np.bool_):
            return value.item()
        return value

    return SamplingParams(plain(temperature), plain(top_p), plain(top_k), plain(min_p), plain(seed)).check()


def derived(params: SamplingParams, index: int) -> SamplingParams:
    """The settings of answer `index` of a call that asks for several (a list of prompts, n answers): its seed is
    the call's plus `index` (mod 2**63), so each answer is the one that seed gives alone; unseeded or greedy
    settings are left as they are (each answer then draws its own seed)."""
    if params.greedy or params.seed is None:
        return params
    return params.with_seed((params.seed + index) % SEED_LIMIT)
