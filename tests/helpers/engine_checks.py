"""Checks of an engine's bookkeeping shared by the engine, executor and serving tests."""


def assert_drained(eng) -> None:
    """Every request is gone and holds nothing: once the prefix cache lets go of what it keeps for
    later requests, every state slot and cache block is free."""
    assert not eng.has_unfinished()
    if eng.prefix_cache is not None:
        eng.prefix_cache.settle()
        eng.prefix_cache.clear()
    assert eng.blocks.free_slots == eng.capacity.num_slots
    assert eng.blocks.free_blocks == eng.capacity.num_blocks
