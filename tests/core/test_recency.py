"""The prompt caches' store: least recently used out first, past a count or a size."""

from ondeck.recency import LeastRecentlyUsed


def test_past_the_count_the_least_recently_used_entry_goes_and_asks_are_counted():
    kept = LeastRecentlyUsed(max_entries=2)
    kept.put("a", 1)
    kept.put("b", 2)
    assert kept.get("a") == 1  # "b" is now the least recently used
    kept.put("c", 3)
    assert ("a" in kept, "b" in kept, "c" in kept) == (True, False, True)
    assert kept.get("b") is None
    assert (kept.hits, kept.misses, kept.values()) == (1, 1, [1, 3])


def test_putting_a_key_again_replaces_its_bytes_rather_than_adding_them():
    kept = LeastRecentlyUsed(max_entries=10, max_bytes=100)
    kept.put("a", "first", nbytes=60)
    kept.put("a", "second", nbytes=60)
    kept.put("b", "other", nbytes=40)
    assert kept.values() == ["second", "other"]
    kept.clear()
    assert len(kept) == 0
