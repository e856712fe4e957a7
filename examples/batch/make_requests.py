"""Builds requests.jsonl from the first 200 requests of the Azure LLM
inference trace 2023 (conversation service).

    python3 examples/batch/make_requests.py ../shared/traces/azure2023/AzureLLMInferenceTrace_conv.csv

Each trace row becomes one chat request: `max_tokens` is the row's
GeneratedTokens; the prompt has about ContextTokens/6 words (4 to 256) of
filler text, so prompt lengths follow the trace, scaled down to keep the file
small. The trace has sizes only, no text (it is anonymised), hence filler.
"""

import csv
import json
import random
import sys
from pathlib import Path

N = 200
WORDS = (
    "order delivery refund account invoice shipping address password update "
    "status customer support ticket product warranty replacement payment card "
    "subscription plan upgrade cancel tracking number package delayed return "
    "label exchange size colour stock store hours contact email phone chat"
).split()


def main() -> None:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/traces/azure2023/AzureLLMInferenceTrace_conv.csv")
    out = Path(__file__).with_name("requests.jsonl")
    rng = random.Random(2023)
    lines = []
    with src.open(newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i >= N:
                break
            ctx, gen = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            words = max(4, min(256, ctx // 6))
            text = " ".join(rng.choice(WORDS) for _ in range(words))
            lines.append(
                json.dumps(
                    {
                        "custom_id": f"conv-{i:03d}-ctx{ctx}-gen{gen}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {
                            "model": "llama-70b",
                            "messages": [
                                {"role": "system", "content": "You are a customer support assistant."},
                                {"role": "user", "content": text},
                            ],
                            "max_tokens": max(1, gen),
                        },
                    },
                    separators=(",", ":"),
                )
            )
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} requests to {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
