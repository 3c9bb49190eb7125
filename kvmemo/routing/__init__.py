"""Prefix-aware routing in front of kvmemo replicas: `kvmemo router` (router.py, an HTTP proxy),
its policy (policy.py: KV-hit first, then load), the prompt's block hashes predicted from the
tokenizer alone (prompt_hasher.py) and each replica's block index fed by its KV events
(block_index.py). It reads request bodies and event batches through server/'s wire formats
(protocol.py, chat_input.py, kv_events.py) and never imports the engine."""
