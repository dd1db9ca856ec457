def pytest_collection_modifyitems(items):
    """Tests a module names in RUN_LAST go to the end of the run: they wait on .ci/run's background
    compile, and waiting last keeps every xdist worker busy with the rest of the suite first."""
    def last(item):
        return any(s in item.nodeid for s in getattr(getattr(item, "module", None), "RUN_LAST", ()))
    items[:] = [i for i in items if not last(i)] + [i for i in items if last(i)]
