"""The README walk's second chain (see tests/test_readme_walk.py): in a file of its own, so that `make test`'s
workers (whole files each) run the two chains side by side."""
import pytest

from tests.test_readme_walk import walk


@pytest.mark.slow(seconds=200)
def test_readme_walk_tools(tmp_path):
    print("\n".join(walk("tools", tmp_path)))
