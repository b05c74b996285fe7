"""What keeping a conversation's KV saves: a follow-up question about the same image, prefilled after the
rows the first turn committed, against the same conversation prefilled from scratch (same tokens).

    python benchmarks/chat_reuse.py [--backend onnxruntime] [--repeat 10] [--image examples/demo/receipt.png]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import glance_runtime as gr

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default=None, help="default: glance-run's")
    p.add_argument("--image", type=Path, default=ROOT / "examples" / "demo" / "receipt.png")
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    reused, fresh = [], []
    with gr.load(backend=args.backend) as model:
        model.generate("Warm up.", images=[args.image])
        for i in range(args.repeat):
            chat = model.chat(system="You are brief.")
            chat.send("What is the total?", images=[args.image])
            follow = chat.send("Is it more than 30?")
            again = model.generate(messages=chat.messages[:-1])
            if again.token_ids != follow.token_ids:
                raise SystemExit("the reused turn's tokens differ from the fresh decode's")
            reused.append(follow.stats)
            fresh.append(again.stats)
            print(f"run {i + 1}/{args.repeat}: prefill {follow.stats['prefill_ms']:.2f} ms reused, "
                  f"{again.stats['prefill_ms']:.2f} ms fresh", flush=True)
    ms = {name: statistics.median(s["prefill_ms"] for s in runs) for name, runs in (("reused", reused), ("fresh", fresh))}
    print(f"backend {reused[0]['backend']}, follow-up of {fresh[0]['prompt_tokens']} prompt tokens: "
          f"reused prefills {reused[0]['prefill_tokens']} tokens in {ms['reused']:.2f} ms (median of {args.repeat}); "
          f"fresh prefills {fresh[0]['prefill_tokens']} tokens in {ms['fresh']:.2f} ms ({ms['fresh'] / ms['reused']:.1f}x)")


if __name__ == "__main__":
    main()
