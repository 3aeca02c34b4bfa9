"""The run as the hub holds it, shared by the live hub, replay and reports.

``state`` holds the ranks, attempts and bounded windows; ``ring`` the per-rank rolling
windows; ``recording`` reads a recording back into that state (``blocks`` and
``columns``: the recording's format; ``facets`` and ``seek``: jumping in it);
``snapshot`` declares the shapes that go to viewers. It imports nothing of rtop's above
it (analysis, hub, UI): those build on it.
"""
