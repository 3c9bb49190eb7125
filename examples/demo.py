"""kvmemo demo: several questions that share one long system prompt, answered one after another.

The first question computes the system prompt's KV; every later one reuses it from the prefix
cache, which shows as cached prompt tokens and a shorter time to first token.
"""

from __future__ import annotations

import time

from kvmemo import LLM, SamplingParams

SYSTEM_PROMPT = (
    "You are Ada, the friendly assistant of the Riverside Public Library. "
    "The library opens Monday to Friday from 9 am to 8 pm, Saturday from 10 am to 5 pm, and is "
    "closed on Sunday. Members may borrow up to 12 items at a time: books for three weeks, DVDs "
    "for one week and magazines for one week. Renewals can be made twice online or at the desk, "
    "unless another member has reserved the item. Late fees are 20 cents a day for books and "
    "1 dollar a day for DVDs, capped at 10 dollars per item. A library card is free for anyone "
    "who lives, works or studies in the county; bring a photo ID and proof of address. The "
    "children's room hosts story time every Wednesday at 10:30 am and a Lego club on Saturday "
    "afternoons. The makerspace on the second floor has two 3D printers, a laser cutter and a "
    "sewing machine; book a one-hour slot at the front desk after a short safety course. "
    "Study rooms seat up to six people and can be reserved for up to three hours a day. Free "
    "wifi is available throughout the building; the network name is RiversideLib and no "
    "password is needed. Printing costs 10 cents a page in black and white and 50 cents in "
    "colour. Answer questions about the library briefly and politely, in one or two sentences."
)

QUESTIONS = [
    "When is the library open on Saturday?",
    "How many items can I borrow at once?",
    "What does a late DVD cost me per day?",
    "Can I use the 3D printer?",
    "What is the wifi network called?",
]


def main() -> None:
    started = time.perf_counter()
    llm = LLM()
    print(f"engine ready in {time.perf_counter() - started:.1f} s\n")
    params = SamplingParams(temperature=0.0, max_tokens=48)
    for question in QUESTIONS:
        conversation = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
        ]
        out = llm.chat(conversation, params, use_tqdm=False)[0]
        m = out.metrics
        print(f"Q: {question}")
        print(f"A: {out.outputs[0].text.strip()}")
        print(
            f"   ttft {m.ttft_s * 1000:6.1f} ms | prompt {m.num_prompt_tokens} tokens, "
            f"{m.num_cached_tokens} from cache\n"
        )
    metrics = llm.get_metrics()
    print(
        f"prefix cache: {metrics.prefix_cache_hits_tokens} of "
        f"{metrics.prefix_cache_queries_tokens} "
        f"prompt tokens reused (hit rate {metrics.prefix_cache_hit_rate:.0%})"
    )


if __name__ == "__main__":
    main()
