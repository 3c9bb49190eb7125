"""PromptHasher: a request body (OpenAI's completions, chat or Responses, Anthropic's Messages) ->
the block hashes a replica will give its prompt.

Invariant: tokenization (tokenizer, chat template and its options, message normalisation, tools)
and hashing (RequestHasher from the replicas' namespace root, block size and algorithm,
cache_salt as an extra key) are the replica's own code paths, so equal prompts get equal hashes
on the router and on the replica.
Only the tokenizer is loaded, never the weights. A Responses request that continues a stored
conversation (previous_response_id) has no prediction here: its replica is the one that stored
it (router.py).
"""

from __future__ import annotations

from typing import Any

from kvmemo.intake.processor import InputProcessor
from kvmemo.intake.prompt_input import PromptInput
from kvmemo.intake.tools import render_tools
from kvmemo.kv.hashing import BlockHash, RequestHasher
from kvmemo.server.anthropic_protocol import MessagesRequest, chat_request
from kvmemo.server.chat_input import chat_options, chat_tools, engine_messages
from kvmemo.server.protocol import ChatCompletionRequest
from kvmemo.server.responses_protocol import ResponsesRequest
from kvmemo.server.responses_protocol import chat_request as responses_chat_request


class PromptHasher:
    """Owns the tokenizer side (InputProcessor) and the hashing side (RequestHasher)."""

    def __init__(
        self, tokenizer: Any, chat_template: str | None, root: BlockHash, block_size: int,
        algorithm: str,
    ) -> None:
        self.processor = InputProcessor(tokenizer, len(tokenizer), chat_template)
        self.hasher = RequestHasher(root, block_size, algorithm)

    @property
    def key(self) -> tuple[str, int, str]:
        """(namespace root hex, block size, algorithm): a replica's /kv/info must match it."""
        return (bytes(self.hasher.root).hex(), self.hasher.block_size, self.hasher.algorithm)

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt tokens the replica will see, or None when the body is not one it accepts
        (the replica then answers with the error)."""
        try:
            chat: ChatCompletionRequest | None = None
            if path.endswith("/messages"):  # Anthropic's, translated as its route does
                chat = chat_request(MessagesRequest.model_validate(body))
            elif path.endswith("/chat/completions"):
                chat = ChatCompletionRequest.model_validate(body)
            elif path.endswith("/responses"):  # OpenAI's Responses, translated as its route does
                responses = ResponsesRequest.model_validate(body)
                if responses.previous_response_id is not None:
                    return None
                chat = responses_chat_request(responses, [])
            if chat is not None:
                messages = engine_messages(chat)
                if _has_images(messages):
                    # Image blocks hash with the image's content, which the router does not
                    # compute: no prediction, so the prompt goes to the least loaded replica.
                    return None
                # The chat route's reading of the body and its tool rendering (intake.tools):
                # a request with tools or chat options predicts the replica's tokens too.
                request = chat
                options = chat_options(request)
                rendering = render_tools(messages, options, chat_tools(request),
                                         self.processor.template_for(options))
                inputs = PromptInput(messages=rendering.messages, chat_options=rendering.options,
                                     documents=request.documents)
            elif body.get("segments") is not None:
                inputs = PromptInput(segments=body["segments"])
            else:
                prompt = body["prompt"]
                if (isinstance(prompt, list) and len(prompt) == 1
                        and isinstance(prompt[0], (str, list))):
                    prompt = prompt[0]
                inputs = PromptInput(prompt=prompt,
                                     add_special_tokens=body.get("add_special_tokens", True))
            return self.processor.process(inputs).token_ids  # the replica's front door
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def block_hashes(self, path: str, body: dict[str, Any]) -> list[BlockHash]:
        """Hashes of the prompt's full blocks ([] when the body has no usable prompt)."""
        token_ids = self.token_ids(path, body)
        salt = body.get("cache_salt")
        if not token_ids or (salt is not None and not isinstance(salt, str)):
            return []
        return self.hasher.hash_prompt(token_ids, cache_salt=salt)


def _has_images(messages: list[dict[str, Any]]) -> bool:
    return any(
        isinstance(part, dict) and part.get("type") != "text"
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )

