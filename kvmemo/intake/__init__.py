"""User input -> ProcessedPrompts. One front door, InputProcessor.process(PromptInput, cache_salt)
(processor.py); the input's forms and options (prompt_input.py), chat template options
(chat_options.py), tools (tools.py), segments (segments.py), and the ids of replies the engine
generated (reply_tokens.py)."""
