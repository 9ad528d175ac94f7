"""Reading prompts without a tokenizer: text, chat, token ids, batches, and block hashes."""

from __future__ import annotations

from baton.router.prompts import TOKEN_BLOCK, Prompt, prompt_of


def test_shared_prefixes_share_leading_block_hashes() -> None:
    """Two prompts with a common 200-character start share exactly its 3 full 64-char blocks."""
    system = "s" * 200
    a = prompt_of({"prompt": system + "first user"}).block_hashes(64)
    b = prompt_of({"prompt": system + "second user, longer"}).block_hashes(64)
    assert a[:3] == b[:3] and len(a) == 3 and len(b) == 3
    c = prompt_of({"prompt": "x" + system}).block_hashes(64)
    assert not set(c) & set(a)  # one character in front changes every block


def test_chat_messages_hash_in_template_order() -> None:
    """Chats with the same system message share blocks; roles are part of the text."""
    system = {"role": "system", "content": "rules " * 40}
    a = prompt_of({"messages": [system, {"role": "user", "content": "a"}]})
    b = prompt_of({"messages": [system, {"role": "user", "content": "b"}]})
    assert a.block_hashes(64)[:3] == b.block_hashes(64)[:3] and a.num_messages == 2
    parts = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    assert prompt_of({"messages": [parts]}).text == "<user>hi"


def test_token_id_prompts_hash_in_engine_blocks() -> None:
    """A token-id prompt has one hash per full block of 16 ids and an exact length."""
    p = prompt_of({"prompt": list(range(40))})
    assert len(p.block_hashes(64)) == 40 // TOKEN_BLOCK and p.estimated_tokens(4.0) == 40


def test_batches_and_malformed_prompts() -> None:
    """A batch is read by its first prompt; a malformed prompt is left for the engine."""
    batch = prompt_of({"prompt": ["a" * 100, "b"]})
    assert batch.num_prompts == 2 and batch.text == "a" * 100
    ids = prompt_of({"prompt": [[1, 2], [3]]})
    assert ids.num_prompts == 2 and ids.token_ids == [1, 2]
    assert prompt_of({"prompt": 5}).block_hashes(64) == [] and prompt_of({}) == Prompt()


def test_token_estimate_of_text() -> None:
    """Text is estimated at chars / chars_per_token, plus 4 template tokens per chat message."""
    assert prompt_of({"prompt": "x" * 400}).estimated_tokens(4.0) == 100
    chat = prompt_of({"messages": [{"role": "user", "content": "x" * 36}]})
    assert chat.estimated_tokens(4.0) == (36 + len("<user>")) // 4 + 4
