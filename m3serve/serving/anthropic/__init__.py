"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`): request conversion
(convert.py), content blocks and stream events (blocks.py), generation (messages.py), routes."""
