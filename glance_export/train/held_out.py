"""Acceptance of the head being trained, measured the way it will be used: the real draft/verify loop on the
torch reference, over held-out prompts, at a few tree budgets.

tau pools rounds (accepted tokens, bonus included, over rounds). Acceptance at offset k is the share of
drafted rounds whose accepted path reaches depth k, so it falls with k and shows how far blocks carry (for an
EAGLE-3 head, depth k of its drafted tree, up to the backend's block size less one).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from glance_runtime.decode.loop import DecodeConfig, decode

from ..model.adapters import Prompt, Snapshot
from ..model.eagle3 import Eagle3Head
from ..model.head import DraftHead
from ..model.torch_backend import TorchBackend


@dataclass(frozen=True)
class HeldOut:
    prompts: list[Prompt]
    budgets: tuple[int, ...]
    max_new_tokens: int


def measure(snapshot: Snapshot, model, head: DraftHead | Eagle3Head, held_out: HeldOut) -> dict:
    """{"tau": {budget: tau}, "accept": [share reaching offset k, k = 1..B-1] at the largest budget}."""
    backend = TorchBackend(snapshot, copy.deepcopy(head).eval(), model=model, device=str(model.device))
    block = backend.block_size
    out: dict = {"tau": {}}
    for budget in held_out.budgets:
        accepted = rounds = 0
        depths = [0] * block
        for prompt in held_out.prompts:
            result = decode(backend, prompt, DecodeConfig(max_new_tokens=held_out.max_new_tokens, budget=budget),
                            snapshot.stop_token_ids)
            for r in result.rounds:
                accepted += r.accepted
                rounds += 1
                if r.drafted:
                    depths[0] += 1
                    for k in range(1, min(r.accepted, block)):
                        depths[k] += 1
        out["tau"][str(budget)] = round(accepted / rounds, 4) if rounds else 0.0
        out["accept"] = [round(d / depths[0], 4) if depths[0] else 0.0 for d in depths[1:]]
    return out
