"""User input -> ProcessedPrompts: messages, chat templates and their options, tools, images,
segments, and the ids of replies the engine generated (processor.py is the one entry)."""
