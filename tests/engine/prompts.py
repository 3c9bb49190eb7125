"""Test prompts: raw completions and chat conversations of varied length."""

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "In 1969, the first humans",
]

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are a helpful assistant who answers briefly."},
        {"role": "user", "content": "Name three fruits that are red."},
    ],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
]
