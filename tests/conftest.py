import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import World  # noqa: E402


@pytest.fixture(scope="module")
def world2():
    world = World(2)
    yield world
    world.close()


@pytest.fixture(scope="module")
def world4():
    world = World(4)
    yield world
    world.close()
