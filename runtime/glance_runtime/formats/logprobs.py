"""Answered tokens' log-probs in OpenAI's JSON shape (per token its text, log-prob, UTF-8 bytes and best
alternatives): what glance-serve answers and `glance-run --json` prints."""
from __future__ import annotations

from typing import Any, Sequence

from ..decode.sampling import TokenLogprob
from ..prompt.token_bytes import TokenBytes


def _entry(token: int, logprob: float, spelling: TokenBytes) -> dict[str, Any]:
    return {"token": spelling.text(token), "logprob": logprob, "bytes": list(spelling.bytes(token))}


def token_logprobs(ids: Sequence[int], reports: Sequence[TokenLogprob], spelling: TokenBytes) -> list[dict[str, Any]]:
    """The `content` list of a choice's (or a chunk's) `logprobs` for tokens `ids` and their reports."""
    return [{**_entry(token, report.logprob, spelling),
             "top_logprobs": [_entry(alt, logprob, spelling) for alt, logprob in report.top]}
            for token, report in zip(ids, reports)]


def choice_logprobs(ids: Sequence[int], reports: Sequence[TokenLogprob] | None,
                    spelling: TokenBytes) -> dict[str, Any] | None:
    """A choice's `logprobs` object (None where the request did not ask for log-probs)."""
    if reports is None:
        return None
    return {"content": token_logprobs(ids, reports, spelling), "refusal": None}
