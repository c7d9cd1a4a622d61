"""The worked examples in docstrings are tests too."""

import doctest
import importlib
import pkgutil

import pytest

import kvserve.bench
import kvserve.cache
import kvserve.configs
import kvserve.kernels
import kvserve.server

PACKAGES = (kvserve.bench, kvserve.cache, kvserve.configs, kvserve.kernels, kvserve.server)
# Modules whose import needs the BLAS chosen before mlx loads are still safe here:
# the test process has already imported mlx through other tests or fixtures.
MODULES = sorted(
    info.name
    for package in PACKAGES
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    if not info.name.rsplit(".", 1)[-1].startswith("_")  # private launchers run elsewhere
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
