"""Speculative decoding from what the engine has already seen (issue 40).

A draft source proposes the tokens a request will likely produce next (config.py names the
sources with vLLM's keys): `ngram` matches the request's own tail earlier in its prompt and
output (ngram.py); `suffix` matches it against every sequence the engine has seen under the
same cache_salt (suffix.py); proposer.py cuts a draft to what the request may still produce.
The step then computes the request's last token and its draft in one forward, samples every row
as if it were an ordinary decode step, and keeps the draft up to the first row whose sampled
token differs (engine/draft_verify.py). Each row draws with the same (seed, step) generator
and the same logits as a plain decode, so a verified output is the plain output token for
token: greedy and seeded runs are identical with and without speculation, and unseeded ones
keep the target distribution exactly.
"""
