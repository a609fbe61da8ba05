"""Next-layer guesses: counted as used or wasted by the pass they were for, paused when they do
not pay, and never a change to the output (the oracle tests run with guesses on)."""

from __future__ import annotations

from pathlib import Path

import pytest

from expertmesh.node.assembly import open_model
from expertmesh.node.config import StoreConfig
from expertmesh.node.devtools.local_hub import HubServer
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.hub import client as hub_client
from expertmesh.node.store.prefetch import PREFETCH_MIN_ACCURACY, PREFETCH_WINDOW

REPO_ID = "expertmesh/tiny-kimi_k3"


@pytest.fixture(scope="module")
def home(pulled_home, hub_root: Path, tmp_path_factory: pytest.TempPathFactory):
    with HubServer(hub_root) as server, hub_client.using_endpoint(server.url):
        home = tmp_path_factory.mktemp("home")
        pulled_home("kimi_k3", home)
        yield home


def test_every_guess_is_used_or_wasted_and_the_output_is_unchanged(home: Path) -> None:
    outputs = {}
    for prefetch in (False, True):
        sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="1", prefetch=prefetch))
        try:
            ids = sm.tokenizer.encode("Guess the next layer")
            outputs[prefetch] = [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=16))]
            sm.store.get_layer(sm.index.moe_layers[0], [])  # a last pass settles the last guesses
            sm.store.get_layer(sm.index.moe_layers[-1], [])
            pf = sm.store.stats.prefetch
        finally:
            sm.close()
        if prefetch:
            assert pf["issued"] > 0 and pf["used"] > 0
            assert pf["issued"] == pf["used"] + pf["wasted"]
            assert 0 < pf["ready"] <= pf["used"]  # some guesses arrived before their demand
        else:
            assert pf["issued"] == 0
    assert outputs[True] == outputs[False]


def test_poor_guesses_pause_prefetching(home: Path) -> None:
    sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="1"))
    try:
        store, layer = sm.store, sm.index.moe_layers[1]
        assert store.wants_guesses()
        for _ in range(4 * PREFETCH_WINDOW):  # always guess experts 0-3, always demand 4-5
            if not store.wants_guesses():
                break
            store.prefetch(layer, [0, 1, 2, 3])
            store.get_layer(layer, [4, 5])
        assert not store.wants_guesses()
        assert store.stats.prefetch["used"] < PREFETCH_MIN_ACCURACY * store.stats.prefetch["issued"]
        issued = store.stats.prefetch["issued"]
        store.prefetch(layer, [6, 7])
        assert store.stats.prefetch["issued"] == issued  # paused: nothing more is fetched
    finally:
        sm.close()
