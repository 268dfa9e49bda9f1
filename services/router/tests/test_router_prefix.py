"""`PrefixTable`: which worker a prompt goes to by its prefix (pure; the placement
over a real bus with two version servers is in services/worker-gpu/tests/test_llm_recovery.py)."""

from __future__ import annotations

import pytest

from inferbus_common.generation import ChatMessage, GenerationRequest
from inferbus_router.prefix import PrefixTable, prompt_text

BLOCK = 16
SHARED = "s" * (3 * BLOCK)


def test_a_prompt_shorter_than_a_block_is_not_placed() -> None:
    table = PrefixTable(BLOCK)
    placed = table.place("m/1", "x" * (BLOCK - 1), ["w1", "w2"])
    assert (placed.worker, placed.outcome) == ("", "none")
    assert len(table) == 0
    assert table.place("m/1", SHARED, []).outcome == "none"


def test_a_shared_prefix_goes_to_the_worker_that_got_it_first() -> None:
    table = PrefixTable(BLOCK)
    first = table.place("m/1", SHARED + "a" * BLOCK, ["w1", "w2"])
    assert first.outcome == "new" and first.worker in {"w1", "w2"}
    for suffix in "bcdef":
        again = table.place("m/1", SHARED + suffix * BLOCK, ["w1", "w2"])
        assert (again.worker, again.outcome, again.matched_blocks) == (first.worker, "hit", 3)
    # The whole earlier prompt matches deeper.
    assert table.place("m/1", SHARED + "a" * BLOCK, ["w1", "w2"]).matched_blocks == 4


def test_the_longest_known_prefix_wins() -> None:
    table = PrefixTable(BLOCK)
    table._owner[table.block_hashes("m/1", SHARED)[0]] = "w1"
    table._owner[table.block_hashes("m/1", SHARED)[2]] = "w2"
    placed = table.place("m/1", SHARED + "z" * BLOCK, ["w1", "w2"])
    assert (placed.worker, placed.matched_blocks) == ("w2", 3)


def test_a_gone_worker_s_prefixes_move_and_others_stay() -> None:
    table = PrefixTable(BLOCK)
    prompts = [chr(ord("a") + i) * (2 * BLOCK) for i in range(20)]
    before = {p: table.place("m/1", p, ["w1", "w2", "w3"]).worker for p in prompts}
    assert len(set(before.values())) == 3, "20 distinct prefixes spread over the workers"
    after = {p: table.place("m/1", p, ["w1", "w2"]).worker for p in prompts}
    for p in prompts:
        if before[p] != "w3":
            assert after[p] == before[p], "a prefix held by a live worker stays there"
        else:
            assert after[p] in {"w1", "w2"}


def test_first_requests_of_a_prefix_agree_across_routers() -> None:
    """Rendezvous hashing on the first block: two routers that never saw the prefix
    choose the same worker."""
    a, b = PrefixTable(BLOCK), PrefixTable(BLOCK)
    for i in range(10):
        prompt = f"{i:02d}" * BLOCK
        assert (
            a.place("m/1", prompt, ["w1", "w2"]).worker
            == b.place("m/1", prompt, ["w2", "w1"]).worker
        )


def test_versions_are_kept_apart_and_the_table_is_bounded() -> None:
    table = PrefixTable(BLOCK, max_blocks=8)
    table.place("m/1", SHARED, ["w1"])
    assert table.place("m/2", SHARED, ["w1"]).outcome == "new"
    for i in range(10):
        table.place("m/1", f"{i}" * (2 * BLOCK), ["w1"])
    assert len(table) == 8
    with pytest.raises(ValueError):
        PrefixTable(0)


def test_prompt_text_follows_what_the_tokens_are_made_of() -> None:
    completion = GenerationRequest(kind="completion", prompt="hello world", max_tokens=1)
    assert prompt_text(completion.encode()) == "hello world"
    chat = GenerationRequest(
        kind="chat",
        messages=[
            ChatMessage(role="system", content="be brief"),
            ChatMessage(role="user", content="hi"),
        ],
        max_tokens=1,
    )
    text = prompt_text(chat.encode())
    assert text.index("be brief") < text.index("hi") and "system" in text
    assert prompt_text(b"not json") == ""
