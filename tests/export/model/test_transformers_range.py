"""The transformers these tests run on is one pyproject.toml declares, and the declared lower bound is an exact
release, the one .ci/run installs to test the lowest (a release outside the range is what the tests did not pass)."""
from __future__ import annotations

from importlib.metadata import metadata, version

from packaging.requirements import Requirement


def _declared() -> Requirement:
    requirements = [Requirement(r) for r in metadata("glance-toolkit").get_all("Requires-Dist")]
    return next(r for r in requirements if r.name == "transformers")


def test_the_installed_transformers_is_in_the_declared_range():
    declared = _declared()
    assert declared.specifier.contains(version("transformers")), (
        f"transformers {version('transformers')} is outside the declared {declared.specifier}")


def test_the_lower_bound_is_an_exact_release():
    lower = [s for s in _declared().specifier if s.operator == ">="]
    assert len(lower) == 1 and len(lower[0].version.split(".")) == 3
